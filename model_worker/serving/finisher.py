"""Answers requests off the device thread: encode PNGs, upload large ones, store the reply, publish it, ack.

Order matters for at-least-once delivery: the reply is stored (best effort: Redis may be down) and
published before the message is acked; if the publish fails the message is handed back, and its retry
is answered from the store without running the model again.

The finisher's threads run at a lower CPU priority than the device thread (`nice`, MAAS_FINISHER_NICE). Their heavy
part, turning an image into PNG bytes (numpy's conversion and Pillow's zlib encode), releases the GIL, so it never
holds the interpreter from the device thread; but it takes whole cores for tens of milliseconds an image, and where
cores are short it took them from the device thread, which then woke late from each step and left the device idle
(docs/results/benchmarks.md, "Step-level vs request-level on a stand-in H100"). Lowered, the encode gets what the device thread leaves.

Lowered, it can also fall behind the device: images waiting for it are bounded (`max_images`, two of the worker's
largest batches), so a finisher that cannot keep up makes the device thread wait (counted in
`maas_worker_finisher_wait_seconds`) instead of holding ever more decoded images in memory; the pool then stops
pulling, and other workers take the queue.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from google.cloud import pubsub_v1

from contract import naming
from contract.messages import Attr, InferenceReply, Prediction
from contract.payloads import PayloadCodec
from contract.stores.results import ResultStore
from model_worker.held.leases import LeaseKeeper
from model_worker.held.log_context import request_log_context
from model_worker.held.pool import HeldMessage, PendingRequest
from model_worker.model.runners import as_pil
from model_worker.serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_SECONDS = 30
REDIS_WARNING_INTERVAL_SECONDS = 30.0


class RedisTrouble:
    """Logs a Redis outage once per interval instead of once per request: the reply still goes out."""

    def __init__(self) -> None:
        self._last = 0.0
        self._lock = threading.Lock()

    def warn(self, what: str, exc: Exception) -> None:
        with self._lock:
            due = time.monotonic() - self._last >= REDIS_WARNING_INTERVAL_SECONDS
            if due:
                self._last = time.monotonic()
        if due:
            log.warning("result store unavailable (%s: %s); replies are published without being stored", what, exc)


class ReplyFinisher:
    def __init__(
        self,
        publisher: pubsub_v1.PublisherClient,
        replies_topic: str,
        results: ResultStore,
        payloads: PayloadCodec,
        leases: LeaseKeeper,
        metrics: WorkerMetrics,
        threads: int,
        nice: int = 0,
        max_images: int = 0,
    ) -> None:
        """`max_images`: images handed to `finish` and not yet answered before it waits (0: no bound)."""
        self._publisher = publisher
        self._replies_topic = replies_topic
        self._results = results
        self._payloads = payloads
        self._leases = leases
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="finisher", initializer=lower_priority, initargs=(nice,)
        )
        self._in_flight = threading.Condition()
        self._publishing = 0
        self._max_images = max_images
        self._room = threading.Condition()
        self._images = 0
        self.redis_trouble = RedisTrouble()

    def note_failure(self, request_id: str, cause: str) -> int:
        """The runs of this request that failed and were handed back, this one included (1 when Redis cannot say)."""
        try:
            return self._results.note_failure(request_id, cause)
        except Exception as exc:  # noqa: BLE001 - Redis down: the broker's delivery attempts still bound the runs
            self.redis_trouble.warn("failure count", exc)
            return 1

    def answer(self, message: HeldMessage, reply: InferenceReply, store: bool = True) -> Future:
        """Publish `reply` for `message` and ack it, in the background."""
        return self._pool.submit(self._answer, message, reply, store)

    def finish(self, pending: PendingRequest, images: list, reply_fields: dict) -> Future:
        """Encode a finished request's images and answer it, in the background; first waits while the images not
        yet answered would pass `max_images` (one request always gets in, however large)."""
        count = len(images)

        def room() -> bool:
            return not self._max_images or not self._images or self._images + count <= self._max_images

        with self._room:
            if not room():
                waited = time.monotonic()
                self._room.wait_for(room)
                self._metrics.finisher_wait_seconds.inc(time.monotonic() - waited)
            self._images += count
            self._metrics.finisher_images.set(self._images)
        future = self._pool.submit(self._finish, pending, images, reply_fields)
        future.add_done_callback(lambda _: self._answered(count))
        return future

    def _answered(self, count: int) -> None:
        with self._room:
            self._images -= count
            self._metrics.finisher_images.set(self._images)
            self._room.notify_all()

    def _finish(self, pending: PendingRequest, images: list, reply_fields: dict) -> None:
        with request_log_context(pending.message):
            self._finish_traced(pending, images, reply_fields)

    def _finish_traced(self, pending: PendingRequest, images: list, reply_fields: dict) -> None:
        try:
            pictures = [as_pil(image) for image in images]
            predictions = [
                Prediction(
                    image=self._payloads.pack(_png_bytes(image), naming.result_object(pending.request_id, index)),
                    seed=item.seed,
                    width=image.width,
                    height=image.height,
                )
                for index, (item, image) in enumerate(zip(pending.items, pictures, strict=True))
            ]
        except Exception as exc:  # noqa: BLE001 - e.g. the payload bucket is unreachable: retry the request
            log.exception("could not keep the images of %s; handing it back", pending.request_id)
            self._metrics.errors.labels(kind="payload_upload").inc()
            self._leases.release(pending.message)
            raise exc
        reply = InferenceReply(predictions=predictions, status="ok", **reply_fields)
        self._answer_traced(pending.message, reply, store=True)

    def _answer(self, message: HeldMessage, reply: InferenceReply, store: bool) -> None:
        with request_log_context(message):
            self._answer_traced(message, reply, store)

    def _answer_traced(self, message: HeldMessage, reply: InferenceReply, store: bool) -> None:
        if store and reply.answered_ms is None:
            reply = reply.model_copy(update={"answered_ms": int(time.time() * 1000)})
        if store and reply.request_id:
            try:
                # Every outcome is kept: a duplicate delivery gets the same answer, and a waiter that missed
                # the notification finds it here.
                batch_line = message.attributes.get(Attr.PRIORITY) == "batch"
                keep_until = int(message.attributes.get(Attr.DEADLINE_MS) or 0) if batch_line else None
                first = self._results.put(reply, keep_until_ms=keep_until)
            except Exception as exc:  # noqa: BLE001 - Redis down is not a request failure
                self.redis_trouble.warn("store", exc)
                self._metrics.errors.labels(kind="result_store").inc()
                first = True
            if not first:
                # Answered already (re-dispatched while this worker stalled, or expired by the watchdog): that
                # answer was published and stands; a second, different one must not follow it.
                log.info("request %s was answered elsewhere first; acking without a second reply", reply.request_id)
                self._leases.ack(message)
                return
        try:
            future = self.publish_reply(reply, message.attributes)
        except Exception as exc:  # noqa: BLE001 - the publisher refused at once (e.g. it is shut down)
            self._not_published(message, reply, exc)
            return
        with self._in_flight:
            self._publishing += 1
        # The ack waits for the publish, but no thread does: the callback acks (batched) or hands back.
        future.add_done_callback(lambda done: self._published(message, reply, done))

    def _published(self, message: HeldMessage, reply: InferenceReply, future) -> None:
        with request_log_context(message):
            self._published_traced(message, reply, future)

    def _published_traced(self, message: HeldMessage, reply: InferenceReply, future) -> None:
        try:
            error = future.exception()
            if error is not None:
                self._not_published(message, reply, error)
                return
            self._leases.ack(message)
            self._metrics.requests.labels(model=reply.model, status=reply.status).inc()
            log.info(
                "request %s %s",
                reply.request_id,
                reply.status,
                extra={
                    "fields": {
                        "request_id": reply.request_id,
                        "model": reply.model,
                        "status": reply.status,
                        "error_kind": reply.error_kind,
                        "batch_id": reply.batch_id,
                        "batch_size": reply.batch_size,
                        "queue_ms": round(reply.queue_ms, 1),
                        "inference_ms": round(reply.inference_ms, 1),
                        "attempt": reply.attempt,
                    }
                },
            )
        finally:
            with self._in_flight:
                self._publishing -= 1
                self._in_flight.notify_all()

    def _not_published(self, message: HeldMessage, reply: InferenceReply, error: BaseException) -> None:
        log.error("reply for %s not published (%s); handing the request back", reply.request_id, error)
        self._metrics.errors.labels(kind="reply_publish").inc()
        self._leases.release(message)

    def publish_reply(self, reply: InferenceReply, request_attributes: dict[str, str]):
        """Publishes `reply` where the request asked (its `reply_to`, its API instance); returns the future."""
        attributes = {
            Attr.REQUEST_ID: reply.request_id,
            Attr.MODEL: reply.model,
            Attr.MODEL_VERSION: reply.model_version,
        }
        if Attr.INSTANCE in request_attributes:
            attributes[Attr.INSTANCE] = request_attributes[Attr.INSTANCE]
        topic = request_attributes.get(Attr.REPLY_TO) or self._replies_topic
        return self._publisher.publish(topic, reply.model_dump_json().encode(), **attributes)

    def close(self) -> None:
        """Waits for every answer in flight, publishes included."""
        self._pool.shutdown(wait=True)
        with self._in_flight:
            self._in_flight.wait_for(lambda: self._publishing == 0, timeout=PUBLISH_TIMEOUT_SECONDS)


def lower_priority(nice: int) -> None:
    """Raises the calling thread's nice value by `nice` (Linux schedules each thread on its own, so the device thread
    keeps its priority). Elsewhere, or where the kernel refuses, the thread runs at the process's priority."""
    if nice <= 0 or sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except OSError as exc:
        log.warning("finisher thread left at the process's CPU priority: %s", exc)


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
