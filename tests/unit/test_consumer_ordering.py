"""The worker acks only after the reply is out, and hands a message back when the reply cannot be sent."""

from __future__ import annotations

import time
from types import SimpleNamespace

from contract.catalog import load_catalog
from contract.messages import GenerationParameters, InferenceRequest, Payload, RequestInstance
from model_worker.consumer import RequestConsumer
from model_worker.health import WorkerHealth


class FakeSubscriber:
    def __init__(self, consumer_ref: list, message) -> None:
        self.calls: list[str] = []
        self._consumer_ref = consumer_ref
        self._message = message

    def subscription_path(self, project, name):
        return f"projects/{project}/subscriptions/{name}"

    def pull(self, request, timeout):
        self._consumer_ref[0].stopping = True  # one message, then the loop ends
        return SimpleNamespace(received_messages=[SimpleNamespace(message=self._message, ack_id="ack-1")])

    def acknowledge(self, request):
        self.calls.append("ack")

    def modify_ack_deadline(self, request):
        seconds = request["ack_deadline_seconds"]
        self.calls.append("release:0" if seconds == 0 else "extend")


class FakePublisher:
    def __init__(self, log: list[str], fail: bool) -> None:
        self._log, self._fail = log, fail

    def topic_path(self, project, name):
        return f"projects/{project}/topics/{name}"

    def publish(self, topic, data, **attributes):
        if self._fail:
            raise ConnectionError("pubsub unreachable")
        self._log.append("publish")
        return SimpleNamespace(result=lambda timeout: "id")


class FakeRunner:
    needs_image = False

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds

    def generate(self, prompts, params, images):
        time.sleep(self.seconds)
        return [b"png-bytes" for _ in prompts]


class MemoryResults:
    def __init__(self) -> None:
        self.stored = {}

    def get(self, request_id):
        return self.stored.get(request_id)

    def put(self, reply):
        self.stored[reply.request_id] = reply


def run_once(
    fail_publish: bool, ack_deadline: float | None = None, model_seconds: float = 0.0
) -> tuple[list[str], MemoryResults]:
    spec = load_catalog().get("sd15-txt2img")
    if ack_deadline is not None:
        spec = spec.model_copy(update={"ack_deadline_seconds": ack_deadline})
    params = GenerationParameters(seed=1, num_inference_steps=2, guidance_scale=7.5, width=64, height=64)
    request = InferenceRequest(
        request_id="r1", model=spec.name, model_version="1", instances=[RequestInstance(prompt="p")], parameters=params
    )
    message = SimpleNamespace(
        data=request.model_dump_json().encode(),
        attributes={"request_id": "r1", "deadline_ms": str(int((time.time() + 60) * 1000))},
    )
    ref: list = [None]
    subscriber = FakeSubscriber(ref, message)
    results = MemoryResults()
    consumer = RequestConsumer(
        spec=spec,
        project_id="p",
        runner=FakeRunner(model_seconds),
        subscriber=subscriber,
        publisher=FakePublisher(subscriber.calls, fail_publish),
        results=results,
        payloads=SimpleNamespace(pack=lambda data, name: Payload(b64="cG5n")),
        health=WorkerHealth(stall_seconds=60),
    )
    ref[0] = consumer
    consumer.run()
    return subscriber.calls, results


def test_reply_is_published_before_the_request_is_acked():
    calls, results = run_once(fail_publish=False)
    assert calls == ["publish", "ack"]
    assert results.get("r1").status == "ok"


def test_a_reply_that_cannot_be_published_returns_the_request_to_the_queue():
    calls, results = run_once(fail_publish=True)
    assert calls == ["release:0"]
    # The result is kept, so the retry republishes it instead of running the model again.
    assert results.get("r1").status == "ok"


def test_ack_deadline_is_extended_while_the_model_runs():
    calls, _ = run_once(fail_publish=False, ack_deadline=0.1, model_seconds=0.35)
    assert calls[-2:] == ["publish", "ack"]
    assert calls[:-2].count("extend") >= 3 and set(calls[:-2]) == {"extend"}
