"""Queues one request on its model's topic and waits for the reply: the API's half of the wire contract."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from google.api_core import exceptions
from google.cloud import pubsub_v1

from api_server.errors import ApiError
from api_server.reply_waiter import ReplyWaiter
from contract import naming
from contract.catalog import ModelSpec
from contract.messages import InferenceReply, InferenceRequest, request_attributes

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_SECONDS = 10


@dataclass
class DispatchTimings:
    subscribe_ms: float = 0.0
    publish_ms: float = 0.0
    wait_ms: float = 0.0
    cleanup_ms: float = 0.0


class InferenceDispatcher:
    def __init__(self, publisher: pubsub_v1.PublisherClient, waiter: ReplyWaiter, project_id: str) -> None:
        self._publisher = publisher
        self._waiter = waiter
        self._project_id = project_id
        self._replies_topic = publisher.topic_path(project_id, naming.REPLIES_TOPIC)

    def run(
        self,
        request: InferenceRequest,
        spec: ModelSpec,
        timings: DispatchTimings,
        priority: naming.Priority = "normal",
    ) -> InferenceReply:
        """Subscribe, publish, wait: raises 503 if the queue is unreachable and 504 when no reply comes in time."""
        timeout = spec.request_timeout_seconds
        deadline_ms = int((time.time() + timeout) * 1000)
        started = time.perf_counter()
        try:
            pending = self._waiter.expect(request.request_id)
        except exceptions.GoogleAPICallError as exc:
            log.error("cannot prepare reply subscription: %s", exc)
            raise ApiError(503, "request queue unavailable, retry later", headers={"Retry-After": "5"}) from exc
        timings.subscribe_ms = _ms_since(started)
        try:
            started = time.perf_counter()
            attributes = request_attributes(request, self._replies_topic, deadline_ms, priority)
            attributes.update(self._waiter.request_attributes())
            topic = self._publisher.topic_path(self._project_id, naming.request_topic(spec.name, priority))
            try:
                self._publisher.publish(topic, request.model_dump_json().encode(), **attributes).result(
                    timeout=PUBLISH_TIMEOUT_SECONDS
                )
            except Exception as exc:  # publish futures raise transport and timeout errors alike
                log.error("publish to %s failed: %s", topic, exc)
                raise ApiError(503, "request queue unavailable, retry later", headers={"Retry-After": "5"}) from exc
            timings.publish_ms = _ms_since(started)
            started = time.perf_counter()
            reply = pending.wait(max(0.0, deadline_ms / 1000 - time.time()))
            timings.wait_ms = _ms_since(started)
        finally:
            started = time.perf_counter()
            pending.close()
            timings.cleanup_ms = _ms_since(started)
        if reply is None:
            raise ApiError(504, f"no reply from {spec.name} within {timeout}s")
        return reply


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
