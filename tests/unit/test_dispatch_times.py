"""The publish time the API records: never after a worker could have started the request."""

from __future__ import annotations

import time
from concurrent.futures import Future
from datetime import datetime
from types import SimpleNamespace

from api_server.predict.dispatch import DispatchTimings, InferenceDispatcher
from contract.catalog import load_catalog
from contract.generation import GenerationParameters
from contract.messages import InferenceRequest, RequestInstance

SPEC = load_catalog(overlay="contract/models.local.yaml").get("sleep")


class DeliveringPublisher:
    """Delivers as it publishes (a worker may start the request before `publish` returns), then acks late."""

    def __init__(self) -> None:
        self.delivered_at = 0.0

    def topic_path(self, project: str, topic: str) -> str:
        return f"projects/{project}/topics/{topic}"

    def publish(self, topic: str, data: bytes, **attributes) -> Future:
        self.delivered_at = time.time()
        time.sleep(0.05)  # the emulator's ack, after the worker already pulled it
        future: Future = Future()
        future.set_result("1")
        return future


class KeptRows:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def keep(self, topic, data, attributes, log_row, unclaimed_after_ms, backlog) -> bool:
        self.rows.append(log_row)
        return True


def test_the_publish_time_is_taken_before_the_publish_so_no_worker_starts_before_it():
    publisher, keeper = DeliveringPublisher(), KeptRows()
    pending = SimpleNamespace(wait=lambda seconds: None, close=lambda: None)
    waiter = SimpleNamespace(expect=lambda request_id: pending, request_attributes=lambda: {})
    dispatcher = InferenceDispatcher(publisher, waiter, "p", keeper)
    request = InferenceRequest(
        request_id="r1", model="sleep", model_version=SPEC.version, instances=[RequestInstance(prompt="p")],
        parameters=GenerationParameters(seed=1, num_inference_steps=2, guidance_scale=7.5, width=64, height=64),
    )  # fmt: skip
    timings = DispatchTimings()
    dispatcher.run(request, SPEC, timings, wait_seconds=0.01, log_row={"request_id": "r1"})
    assert timings.published_ms is not None and timings.published_ms <= publisher.delivered_at * 1000
    [row] = keeper.rows
    assert datetime.fromisoformat(row["published_at"]).timestamp() <= publisher.delivered_at
    dispatcher.submit(request, SPEC, int((time.time() + 60) * 1000), "normal", log_row={"request_id": "r1"})
    assert datetime.fromisoformat(keeper.rows[1]["published_at"]).timestamp() <= publisher.delivered_at
