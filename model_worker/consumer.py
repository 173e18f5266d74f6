"""Pulls one model's requests only when free to run them, answers each once, and acks after the reply is out."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

from google.api_core import exceptions
from google.cloud import pubsub_v1
from pydantic import ValidationError

from contract import naming
from contract.catalog import ModelSpec
from contract.messages import Attr, InferenceReply, InferenceRequest, Prediction
from contract.payloads import PayloadCodec, PayloadError
from contract.results import ResultStore
from model_worker.health import WorkerHealth
from model_worker.pipeline import DiffusionRunner

log = logging.getLogger(__name__)
# Short, so a draining worker notices SIGTERM quickly; an idle pull costs one cheap RPC.
PULL_WAIT_SECONDS = 2.0


class RequestConsumer:
    def __init__(
        self,
        spec: ModelSpec,
        project_id: str,
        runner: DiffusionRunner,
        subscriber: pubsub_v1.SubscriberClient,
        publisher: pubsub_v1.PublisherClient,
        results: ResultStore,
        payloads: PayloadCodec,
        health: WorkerHealth,
    ) -> None:
        self.spec = spec
        self.runner = runner
        self.subscriber = subscriber
        self.publisher = publisher
        self.results = results
        self.payloads = payloads
        self.health = health
        self.subscription = subscriber.subscription_path(project_id, naming.worker_subscription(spec.name))
        self.replies_topic = publisher.topic_path(project_id, naming.REPLIES_TOPIC)
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        self.stopping = False

    def run(self) -> None:
        """Pull one message at a time: a worker never holds requests it cannot start now (no hoarding)."""
        log.info("pulling %s", self.subscription)
        while not self.stopping:
            self.health.beat()
            try:
                response = self.subscriber.pull(
                    request={"subscription": self.subscription, "max_messages": 1}, timeout=PULL_WAIT_SECONDS
                )
            except (exceptions.DeadlineExceeded, exceptions.RetryError):
                continue
            except exceptions.GoogleAPICallError as exc:
                log.warning("pull failed: %s", exc)
                time.sleep(1.0)
                continue
            for received in response.received_messages:
                try:
                    self.handle(received.message, received.ack_id)
                except Exception:  # noqa: BLE001 - e.g. the reply could not be published
                    # Not acked: hand it back now so another attempt (or the dead-letter topic) takes it.
                    log.exception(
                        "request %s not answered; returning it to the queue",
                        received.message.attributes.get(Attr.REQUEST_ID),
                    )
                    self._release(received.ack_id)
        log.info("stopped pulling %s", self.subscription)

    @contextlib.contextmanager
    def _lease(self, ack_id: str) -> Iterator[None]:
        """Extends the ack deadline while the model runs, so a slow batch is not redelivered to another worker."""
        done = threading.Event()
        period = self.spec.ack_deadline_seconds / 2

        def extend() -> None:
            while not done.wait(period):
                try:
                    self.subscriber.modify_ack_deadline(
                        request={
                            "subscription": self.subscription,
                            "ack_ids": [ack_id],
                            "ack_deadline_seconds": self.spec.ack_deadline_seconds,
                        }
                    )
                except exceptions.GoogleAPICallError as exc:
                    log.warning("could not extend the ack deadline: %s", exc)

        thread = threading.Thread(target=extend, name="lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _release(self, ack_id: str) -> None:
        try:
            self.subscriber.modify_ack_deadline(
                request={"subscription": self.subscription, "ack_ids": [ack_id], "ack_deadline_seconds": 0}
            )
        except exceptions.GoogleAPICallError:
            log.warning("could not release a message; it returns when its ack deadline passes")

    def handle(self, message, ack_id: str) -> None:
        attributes = dict(message.attributes)
        request_id = attributes.get(Attr.REQUEST_ID, "")
        started = time.time()
        stored = self.results.get(request_id) if request_id else None
        if stored is not None:
            # At-least-once delivery: a redelivered request gets the first answer again, not a second run.
            log.info("request %s already answered; republishing the stored reply", request_id)
            reply = stored
        elif _deadline_passed(attributes, started):
            reply = self._reply(request_id, status="expired", error="deadline passed before a worker was free")
        else:
            with self._lease(ack_id):
                reply = self._run(message.data, request_id, started)
        if stored is None and request_id:
            # Every outcome is kept: a duplicate delivery gets the same answer, and a waiter that missed
            # the notification finds it here.
            self.results.put(reply)
        self._publish(reply, attributes)
        self.subscriber.acknowledge(request={"subscription": self.subscription, "ack_ids": [ack_id]})
        log.info(
            "request %s %s",
            request_id,
            reply.status,
            extra={"fields": {"request_id": request_id, "status": reply.status, "inference_ms": reply.inference_ms}},
        )

    def _run(self, data: bytes, request_id: str, started: float) -> InferenceReply:
        try:
            request = InferenceRequest.model_validate_json(data)
        except ValidationError as exc:
            return self._reply(request_id, status="error", error=f"malformed request: {exc.errors()[0]['msg']}")
        queue_ms = max(0.0, started * 1000 - request.published_at_ms)
        try:
            images = (
                [self._input_image(instance.image) for instance in request.instances]
                if self.runner.needs_image
                else None
            )
            params = request.parameters
            began = time.perf_counter()
            pngs = self.runner.generate([instance.prompt for instance in request.instances], params, images)
            inference_ms = (time.perf_counter() - began) * 1000
            predictions = [
                Prediction(
                    image=self.payloads.pack(png, f"results/{request_id}/{index}.png"),
                    seed=params.seed + index,
                    width=params.width,
                    height=params.height,
                )
                for index, png in enumerate(pngs)
            ]
        except PayloadError as exc:
            return self._reply(request_id, status="error", error=str(exc), queue_ms=queue_ms)
        except Exception as exc:  # noqa: BLE001 - any pipeline failure becomes an error reply, never silence
            log.exception("inference failed for %s", request_id)
            return self._reply(
                request_id, status="error", error=f"inference failed: {type(exc).__name__}", queue_ms=queue_ms
            )
        return self._reply(
            request_id, status="ok", predictions=predictions, queue_ms=queue_ms, inference_ms=inference_ms
        )

    def _input_image(self, payload):
        from PIL import Image, UnidentifiedImageError

        if payload is None:
            raise PayloadError("image-to-image needs an input image")
        try:
            return Image.open(io.BytesIO(self.payloads.unpack(payload))).convert("RGB")
        except UnidentifiedImageError as exc:
            raise PayloadError("input image is not a readable image") from exc

    def _reply(self, request_id: str, **fields) -> InferenceReply:
        return InferenceReply(
            request_id=request_id,
            model=self.spec.name,
            model_version=self.spec.version,
            worker_id=self.worker_id,
            **fields,
        )

    def _publish(self, reply: InferenceReply, request_attributes: dict[str, str]) -> None:
        attributes = {
            Attr.REQUEST_ID: reply.request_id,
            Attr.MODEL: reply.model,
            Attr.MODEL_VERSION: reply.model_version,
        }
        if Attr.INSTANCE in request_attributes:
            attributes[Attr.INSTANCE] = request_attributes[Attr.INSTANCE]
        topic = request_attributes.get(Attr.REPLY_TO) or self.replies_topic
        future = self.publisher.publish(topic, reply.model_dump_json().encode(), **attributes)
        future.result(timeout=30)


def _deadline_passed(attributes: dict[str, str], now: float) -> bool:
    """A missing or unreadable deadline runs the request: better late work than a dropped request."""
    try:
        return int(attributes[Attr.DEADLINE_MS]) < now * 1000
    except (KeyError, ValueError):
        return False
