"""Queues one request on its model's topic and waits for the reply: the API's half of the wire contract."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from google.api_core import exceptions
from google.cloud import pubsub_v1

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.predict.reply_waiter import ReplyWaiter
from contract import naming
from contract.messages import Attr, InferenceReply, InferenceRequest, request_attributes
from contract.model_spec import ModelSpec
from contract.stores.inflight import RequestKeeper, claim_wait_ms
from contract.tracing import current_trace

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_SECONDS = 10


@dataclass
class DispatchTimings:
    subscribe_ms: float = 0.0
    publish_ms: float = 0.0
    wait_ms: float = 0.0
    cleanup_ms: float = 0.0
    # When the publish began (epoch ms): the log row's `published_at`, never after a worker could start the request.
    published_ms: float | None = None
    # The request's partial log row is kept in Redis with its message: settled by this process when it answers,
    # adopted by another if this one dies first (`contract/stores/inflight.py`).
    row_kept: bool = False


class InferenceDispatcher:
    def __init__(
        self,
        publisher: pubsub_v1.PublisherClient,
        waiter: ReplyWaiter,
        project_id: str,
        keeper: RequestKeeper | None = None,
        publish_timeout_seconds: float = PUBLISH_TIMEOUT_SECONDS,
    ) -> None:
        """`keeper`: keeps each published request in Redis, so a dead worker's requests are re-dispatched."""
        self._publish_timeout = publish_timeout_seconds
        self._publisher = publisher
        self._keeper = keeper
        self._waiter = waiter
        self._project_id = project_id
        self._replies_topic = publisher.topic_path(project_id, naming.REPLIES_TOPIC)

    def run(
        self,
        request: InferenceRequest,
        spec: ModelSpec,
        timings: DispatchTimings,
        priority: naming.Priority = "normal",
        deadline_ms: int | None = None,
        wait_seconds: float | None = None,
        log_row: dict | None = None,
    ) -> InferenceReply | None:
        """Subscribe, publish, wait up to the model's timeout (or `wait_seconds`): raises 503 if the queue is
        unreachable and returns None when no reply comes in time. A `deadline_ms` beyond the wait keeps the
        request runnable after it (a sync request turned into a job). `log_row`: the request's partial log row,
        kept with the request (`timings.row_kept` says whether it was) so that its row is written even if this
        process dies."""
        timeout = spec.request_timeout_seconds if wait_seconds is None else wait_seconds
        wait_until = time.time() + timeout
        deadline_ms = deadline_ms or int(wait_until * 1000)
        started = time.perf_counter()
        try:
            pending = self._waiter.expect(request.request_id)
        except exceptions.GoogleAPICallError as exc:
            log.error("cannot prepare reply subscription: %s", exc)
            raise ApiError(503, "request queue unavailable, retry later", headers={"Retry-After": "5"}) from exc
        timings.subscribe_ms = _ms_since(started)
        try:
            started = time.perf_counter()
            attributes = _traced(request_attributes(request, self._replies_topic, deadline_ms, priority))
            attributes.update(self._waiter.request_attributes())
            timings.published_ms = time.time() * 1000
            timings.row_kept = self._publish(request, spec, attributes, priority, log_row, timings.published_ms)
            timings.publish_ms = _ms_since(started)
            started = time.perf_counter()
            reply = pending.wait(max(0.0, wait_until - time.time()))
            timings.wait_ms = _ms_since(started)
        finally:
            started = time.perf_counter()
            pending.close()
            timings.cleanup_ms = _ms_since(started)
        return reply

    def submit(
        self,
        request: InferenceRequest,
        spec: ModelSpec,
        deadline_ms: int,
        priority: naming.Priority,
        log_row: dict | None = None,
        reply_to: str | None = None,
    ) -> bool:
        """Publish only (a job): nobody waits for the reply message; the worker's stored reply is read later.
        True when `log_row` was kept with the request (see `run`). `reply_to`: a reply topic other than the
        API's (a batch line's, `naming.BATCH_REPLIES_TOPIC`)."""
        reply_topic = self._publisher.topic_path(self._project_id, reply_to) if reply_to else self._replies_topic
        attributes = _traced(request_attributes(request, reply_topic, deadline_ms, priority))
        return self._publish(request, spec, attributes, priority, log_row)

    def _publish(
        self,
        request: InferenceRequest,
        spec: ModelSpec,
        attributes: dict,
        priority: naming.Priority,
        log_row: dict | None = None,
        published_ms: float | None = None,
    ) -> bool:
        """Publishes, then keeps the request in Redis; True when `log_row` was kept with it. The row's `published_at`
        is when the publish began (`published_ms`, or now): a worker may start the request before the call returns."""
        topic = self._publisher.topic_path(self._project_id, naming.request_topic(spec.queue, priority))
        data = request.model_dump_json().encode()
        published_ms = published_ms or time.time() * 1000
        try:
            self._publisher.publish(topic, data, **attributes).result(timeout=self._publish_timeout)
        except Exception as exc:  # publish futures raise transport and timeout errors alike
            log.error("publish to %s failed: %s", topic, f"{type(exc).__name__} {exc}".strip())
            raise ApiError(503, "request queue unavailable, retry later", headers={"Retry-After": "5"}) from exc
        metrics.PUBLISHES.labels(spec.queue).inc()
        if self._keeper is None:
            return False
        if log_row is not None:
            log_row = {**log_row, "published_at": datetime.fromtimestamp(published_ms / 1000, UTC).isoformat()}
        # Watched for a taker (see `InflightStore.keep`), except batch lines: they wait in a backlog by design.
        unclaimed_after_ms = None if priority == "batch" else claim_wait_ms(spec.ack_deadline_seconds)
        # High and normal requests are counted in their model's backlog (admission); batch lines never wait on it.
        backlog = naming.backlog_key(spec.queue, priority) if priority != "batch" else None
        return self._keeper.keep(topic, data, attributes, log_row, unclaimed_after_ms, backlog) and log_row is not None


def _traced(attributes: dict[str, str]) -> dict[str, str]:
    """Adds the trace of the request being handled, so the worker's lines can be found from it."""
    if (trace := current_trace()) is not None:
        attributes[Attr.TRACEPARENT] = trace.traceparent()
    return attributes


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
