"""A test client for the worker's side of the wire contract: publish requests straight to a model's queue and
collect every reply from the replies topic, without the API in between.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass

import redis

from contract import google_clients, naming
from contract.messages import (
    GenerationParameters,
    InferenceReply,
    InferenceRequest,
    RequestInstance,
    request_attributes,
)
from contract.stores.inflight import InflightStore, RequestKeeper


@dataclass(frozen=True)
class Received:
    reply: InferenceReply
    at: float


class WorkerClient:
    """Publishes requests and records every reply (one subscription of its own on the replies topic)."""

    def __init__(self, settings) -> None:
        self._project = settings.project_id
        self._publisher = google_clients.publisher_client()
        self._subscriber = google_clients.subscriber_client()
        self._replies_topic = self._publisher.topic_path(self._project, naming.REPLIES_TOPIC)
        self._subscription = self._subscriber.subscription_path(self._project, f"test-replies-{uuid.uuid4().hex[:8]}")
        self._subscriber.create_subscription(request={"name": self._subscription, "topic": self._replies_topic})
        self._lock = threading.Condition()
        self.replies: dict[str, list[Received]] = {}
        self.published_at: dict[str, float] = {}
        self._streaming = self._subscriber.subscribe(self._subscription, self._on_reply)
        # As the API does: each request is kept until its deadline, so the watchdog can re-dispatch it.
        self._keeper = RequestKeeper(InflightStore(redis.Redis.from_url(settings.redis_url, socket_timeout=2)))

    def _on_reply(self, message) -> None:
        message.ack()
        reply = InferenceReply.model_validate_json(message.data)
        with self._lock:
            self.replies.setdefault(reply.request_id, []).append(Received(reply, time.time()))
            self._lock.notify_all()

    def send(
        self,
        model: str,
        prompts: list[str] | str = "a lighthouse",
        *,
        seed: int = 1,
        steps: int = 2,
        width: int = 64,
        height: int = 64,
        timeout: float = 30.0,
        priority: naming.Priority = "normal",
        request_id: str | None = None,
        negative_prompt: str | None = None,
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        prompts = [prompts] if isinstance(prompts, str) else prompts
        request = InferenceRequest(
            request_id=request_id,
            model=model,
            model_version="1",
            instances=[RequestInstance(prompt=prompt) for prompt in prompts],
            parameters=GenerationParameters(
                seed=seed,
                num_inference_steps=steps,
                guidance_scale=7.5,
                width=width,
                height=height,
                negative_prompt=negative_prompt,
            ),
        )
        return self._publish(request, model, timeout, priority)

    def send_flow(self, catalog, flow: str, prompt: str = "a lighthouse", *, timeout: float = 30.0, **asked) -> str:
        """Publishes a flow's request as the API does (contract/flows.py): every stage planned, to the first
        stage's queue; `asked`: the request's parameters (seed 1 unless given)."""
        from contract.flows import plan_stages
        from contract.messages import FlowContext

        spec = catalog.flow(flow)
        plans = plan_stages(spec, [catalog.get(stage.model) for stage in spec.stages], {"seed": 1, **asked})
        request = InferenceRequest(
            request_id=uuid.uuid4().hex, model=plans[0].model, model_version=plans[0].model_version,
            instances=[RequestInstance(prompt=prompt)], parameters=plans[0].parameters,
            flow=FlowContext(flow=flow, stages=plans),
        )  # fmt: skip
        return self._publish(request, plans[0].queue, timeout, "normal")

    def _publish(self, request: InferenceRequest, queue: str, timeout: float, priority: naming.Priority) -> str:
        deadline_ms = int((time.time() + timeout) * 1000)
        attributes = request_attributes(request, self._replies_topic, deadline_ms, priority)
        topic = self._publisher.topic_path(self._project, naming.request_topic(queue, priority))
        self.published_at[request.request_id] = time.time()
        data = request.model_dump_json().encode()
        # A bound for a hang, not a pace: on a busy host the emulator took over 10 s to confirm a publish.
        self._publisher.publish(topic, data, **attributes).result(timeout=60)
        self._keeper.keep(topic, data, attributes)
        return request.request_id

    def wait(self, request_ids: list[str], timeout: float) -> dict[str, InferenceReply]:
        """The first reply of each request; fails listing the ones still unanswered after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.wait_for(
                lambda: all(request_id in self.replies for request_id in request_ids),
                max(0.0, deadline - time.monotonic()),
            )
            missing = [request_id for request_id in request_ids if request_id not in self.replies]
            assert not missing, f"{len(missing)} of {len(request_ids)} requests unanswered after {timeout}s"
            return {request_id: self.replies[request_id][0].reply for request_id in request_ids}

    def answered_at(self, request_id: str) -> float:
        with self._lock:
            return self.replies[request_id][0].at

    def answered_by(self, worker_id_suffix: str) -> int:
        """Replies received so far from the worker whose id ends with `worker_id_suffix` (`-<pid>`: worker ids are
        `{host}-{pid}`)."""
        with self._lock:
            return sum(
                received.reply.worker_id.endswith(worker_id_suffix)
                for replies in self.replies.values()
                for received in replies
            )

    def close(self) -> None:
        self._streaming.cancel()
        with contextlib.suppress(Exception):
            self._streaming.result(timeout=5)
        with contextlib.suppress(Exception):
            self._subscriber.delete_subscription(request={"subscription": self._subscription}, timeout=10)
        self._publisher.stop()
