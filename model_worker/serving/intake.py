"""Pulls requests only when the worker has room for them, and answers at once what needs no GPU.

One puller per subscription (each model's high, normal and batch queues, or those MAAS_WORKER_PRIORITIES names),
each a waiting pull so a request
reaching an idle worker starts about one pull round trip after it is published. Before a request is
held for the device it is triaged: a redelivery with a stored reply gets that reply again, a request past
its deadline or cancelled gets `expired`/`cancelled`, a malformed one or one with an unreadable or
oversized input image gets an error; none of these reach the GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from google.api_core import exceptions
from google.cloud import pubsub_v1
from pydantic import ValidationError

from contract import naming
from contract.images import InputImageError, decode_input_image
from contract.messages import Attr, InferenceReply, InferenceRequest, Payload
from contract.model_spec import ModelSpec
from contract.payloads import PayloadCodec, PayloadError
from contract.stores.results import ResultStore
from model_worker.adapters.loader import AdapterLoader
from model_worker.controls.images import ControlImageError, control_image
from model_worker.controls.loader import ControlLoader
from model_worker.flows.stages import FlowStages
from model_worker.held.leases import LeaseKeeper
from model_worker.held.log_context import request_log_context
from model_worker.held.pool import HeldMessage, PendingRequest, RequestPool
from model_worker.model.runners import GenerationItem
from model_worker.serving.finisher import ReplyFinisher
from model_worker.serving.health import WorkerHealth
from model_worker.serving.presence import PullerPresence

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)
# How long a request pull waits for a message. An idle subscription costs one pull RPC per wait (the emulator answers
# an empty pull about 0.9 s before it): at 2 s an idle test stack's ~180 pull threads kept a third of a core busy.
# A draining worker waits its request pulls out (a message handed to one then is handed back at once), so this is
# also the longest a drain waits for them: well inside the 15 s a stop allows before SIGKILL.
PULL_WAIT_SECONDS = 5.0
# Dead letters are rare, and a waiting pull is not free: the Pub/Sub emulator polls each one every 50 ms (an idle test
# stack's ~35 dead-letter pulls were a quarter of its emulator's CPU). So a dead-letter queue is looked at with a short
# pull every `DEAD_LETTER_LOOK_SECONDS` while it is empty: a dead-lettered request, already failed after several
# delivery attempts of an ack deadline each, is answered up to that much later. A draining worker cancels the pull.
DEAD_LETTER_PULL_WAIT_SECONDS = 2.0
DEAD_LETTER_LOOK_SECONDS = 10.0
PULL_ERROR_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0)


class ReplyFactory:
    """Replies stamped with this worker's identity and the model's version."""

    def __init__(self, worker_id: str, accelerator: dict[str, str]) -> None:
        self.worker_id = worker_id
        self._accelerator = accelerator

    def make(self, spec: ModelSpec, request_id: str, message: HeldMessage | None = None, **fields) -> InferenceReply:
        fields.setdefault("accelerator", self._accelerator.get(spec.queue))
        if message is not None:
            fields.setdefault("attempt", message.delivery_attempt)
        return InferenceReply(
            request_id=request_id, model=spec.name, model_version=spec.version, worker_id=self.worker_id, **fields
        )


def deadline_of(attributes: dict[str, str]) -> int | None:
    """A missing or unreadable deadline runs the request: better late work than a dropped request."""
    try:
        return int(attributes[Attr.DEADLINE_MS])
    except (KeyError, ValueError):
        return None


def redispatches_of(attributes: dict[str, str]) -> int:
    """How many times the watchdog published this request again (0 for the API's own publish)."""
    try:
        return max(0, int(attributes.get(Attr.REDISPATCHES, 0)))
    except ValueError:
        return 0


def decode_image(data: bytes, max_pixels: int):
    """Opens an input image as the API checked it (`contract.images`); any refusal fails this request alone."""
    try:
        return decode_input_image(data, max_pixels)
    except InputImageError as exc:
        raise PayloadError(f"input image: {exc}") from exc


class Triage:
    """Decides what a pulled message needs: an answer now, or a place in the pool."""

    def __init__(
        self,
        results: ResultStore,
        payloads: PayloadCodec,
        finisher: ReplyFinisher,
        replies: ReplyFactory,
        adapters: AdapterLoader | None = None,
        flows: FlowStages | None = None,
        controls: ControlLoader | None = None,
    ) -> None:
        self._adapters = adapters
        self._controls = controls
        self._flows = flows
        self._results = results
        self._payloads = payloads
        self._finisher = finisher
        self._replies = replies

    def _stored(self, request_id: str) -> tuple[InferenceReply | None, bool]:
        try:
            stored = self._results.get(request_id)
            cancelled = bool(self._results.cancelled([request_id]))
        except Exception as exc:  # noqa: BLE001 - Redis down: run the request, the reply is the answer
            self._finisher.redis_trouble.warn("lookup", exc)
            return None, False
        return stored, cancelled

    def __call__(self, spec: ModelSpec, message: HeldMessage, priority: str) -> PendingRequest | None:
        request_id = message.attributes.get(Attr.REQUEST_ID, "")
        stored, cancelled = self._stored(request_id) if request_id else (None, False)
        if stored is not None:
            # At-least-once delivery: a redelivered request gets the first answer again, not a second run.
            log.info("request %s already answered; republishing the stored reply", request_id)
            self._finisher.answer(message, stored, store=False)
            return None
        deadline_ms = deadline_of(message.attributes)
        now_ms = time.time() * 1000
        if deadline_ms is not None and deadline_ms < now_ms:
            self._answer(spec, message, request_id, "expired", "expired", "deadline passed before a worker was free")
            return None
        if cancelled:
            self._answer(spec, message, request_id, "cancelled", "cancelled", "cancelled before it started")
            return None
        try:
            request = InferenceRequest.model_validate_json(message.data)
        except ValidationError as exc:
            detail = exc.errors()[0]["msg"]
            self._answer(spec, message, request_id, "error", "malformed", f"malformed request: {detail}")
            return None
        try:
            if (
                request.flow is not None
            ):  # a flow's stage: model_worker/flows/stages.py makes it a request like this one
                if self._flows is None:
                    raise PayloadError("this worker runs no flows")
                return self._flows.intake(spec, message, request, priority, deadline_ms, self.items)
            items = self.items(spec, request)
        except PayloadError as exc:
            self._answer(spec, message, request.request_id, "error", "bad_input", str(exc))
            return None
        return PendingRequest(
            message=message, spec=spec, request=request, items=items, priority=priority, deadline_ms=deadline_ms
        )

    def items(self, spec: ModelSpec, request: InferenceRequest, inputs: list | None = None) -> list[GenerationItem]:
        """The request's images to generate; `inputs`: a flow's later stage's, one per instance (the previous
        stage's latents, or its images already at this stage's size), in place of the instances' images."""
        params = request.parameters
        adapters = None
        if params.adapters:
            if self._adapters is None:
                raise PayloadError("this worker serves no adapters")
            adapters = self._adapters.request(spec, params.adapters)  # loads in the background if not cached
        controls, control_images = self._controls_of(spec, request)
        items = []
        for index, instance in enumerate(request.instances):
            image = mask = None
            if inputs is not None:
                image = inputs[index]
            elif spec.needs_image:
                # Resized here, on the puller's thread, so the device thread only runs the model.
                if instance.image is None:
                    raise PayloadError(f"{spec.task} needs an input image")
                image = self._image(instance.image, spec.limits.max_input_pixels).resize((params.width, params.height))
            if spec.takes_mask:
                if instance.mask is None:
                    raise PayloadError("inpaint needs a mask")
                mask = self._image(instance.mask, spec.limits.max_input_pixels).resize((params.width, params.height))
            items.append(
                GenerationItem(
                    prompt=instance.prompt,
                    seed=params.seed + index,
                    negative_prompt=params.negative_prompt,
                    image=image,
                    mask=mask,
                    adapters=adapters,
                    controls=controls,
                    control_images=control_images,
                )
            )
        if not items:
            raise PayloadError("request has no instances")
        if len(items) > spec.max_batch_size:
            raise PayloadError(f"{len(items)} images exceed the model's batch limit of {spec.max_batch_size}")
        return items

    def _controls_of(self, spec: ModelSpec, request: InferenceRequest) -> tuple:
        """The request's ControlNets (loading in the background when not cached) and their control images, decoded
        and preprocessed here, off the device thread; (None, ()) without."""
        refs = request.parameters.controls
        if not refs:
            return None, ()
        if self._controls is None:
            raise PayloadError("this worker serves no control models")
        if len(request.control_images) != len(refs):
            raise PayloadError(f"{len(refs)} controls but {len(request.control_images)} control images")
        try:
            images = tuple(control_image(self._payloads.unpack(payload), ref, spec.limits.max_input_pixels)
                           for payload, ref in zip(request.control_images, refs, strict=True))  # fmt: skip
        except ControlImageError as exc:
            raise PayloadError(str(exc)) from exc
        return self._controls.request(spec, refs), images

    def _image(self, payload: Payload, max_pixels: int):
        return decode_image(self._payloads.unpack(payload), max_pixels)

    def _answer(
        self, spec: ModelSpec, message: HeldMessage, request_id: str, status: str, kind: str, error: str
    ) -> None:
        reply = self._replies.make(spec, request_id, message, status=status, error_kind=kind, error=error)
        self._finisher.answer(message, reply)


class SubscriptionLoop:
    """A thread pulling one subscription: the error handling, readiness reports and backoff both loops share."""

    # How long one pull waits, and whether `stop` cancels a waiting pull instead of waiting it out.
    wait_seconds = PULL_WAIT_SECONDS
    cancel_on_stop = False

    def __init__(self, subscriber: pubsub_v1.SubscriberClient, subscription: str, health: WorkerHealth, name: str):
        self.subscription = subscription
        self._subscriber = subscriber
        self._health = health
        self._failures = 0
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._waiting: grpc.Future | None = None  # the pull in flight, cancelled by `stop`
        self._waiting_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops pulling: the pull under way ends at its wait (anything it brings is handed back), or now where
        `cancel_on_stop` (a message the broker hands a pull in the instant it is cancelled comes back after its
        ack deadline, as any unacked message does: the emulator was seen to take a moment to drop a cancelled
        pull on a loaded machine)."""
        self.stopping.set()
        if self.cancel_on_stop:
            with self._waiting_lock:
                if self._waiting is not None:
                    self._waiting.cancel()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError

    def _pull(self, max_messages: int) -> list | None:
        """One waiting pull: what came ([] when the queue had nothing for it), or None when it failed (reported to
        readiness, then backed off)."""
        import grpc  # here: the GPU check runs the worker's stages in an image without the service clients

        try:
            response = self._waiting_pull(max_messages)
        except grpc.FutureCancelledError:
            return []  # stopped
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.stopping.is_set():
                return []
            error = exceptions.from_grpc_error(exc)
            if isinstance(error, exceptions.DeadlineExceeded):
                response = None
            elif isinstance(error, exceptions.NotFound):
                self._failed("subscription does not exist (run the bootstrap)")
                return None
            else:
                self._failed(f"pull failed: {type(error).__name__}")
                return None
        self._health.clear_problem(self.subscription)
        self._failures = 0
        return list(response.received_messages) if response is not None else []

    def _waiting_pull(self, max_messages: int) -> pubsub_v1.types.PullResponse:
        """The pull RPC as a future (the client library's blocking call cannot be cancelled), with the routing
        header the library would send."""
        import grpc

        request = pubsub_v1.types.PullRequest(subscription=self.subscription, max_messages=max_messages)
        metadata = (("x-goog-request-params", f"subscription={self.subscription}"),)
        with self._waiting_lock:
            if self.stopping.is_set():
                raise grpc.FutureCancelledError()
            waiting = self._subscriber.api.transport.pull.future(request, timeout=self.wait_seconds, metadata=metadata)
            self._waiting = waiting
        try:
            # Woken by the RPC's end, not by polling: the future's own `result()` wakes its thread ten times a second
            # (grpc's signal-friendly wait), a third of the worker's CPU when idle with a dozen pullers.
            ended = threading.Event()
            waiting.add_done_callback(lambda _: ended.set())
            ended.wait()
            return waiting.result()
        finally:
            with self._waiting_lock:
                self._waiting = None

    def _failed(self, reason: str) -> None:
        self._health.report_problem(self.subscription, reason)
        self.stopping.wait(PULL_ERROR_BACKOFF_SECONDS[min(self._failures, len(PULL_ERROR_BACKOFF_SECONDS) - 1)])
        self._failures += 1


class SubscriptionPuller(SubscriptionLoop):
    """Pulls one subscription into the pool, never more than the pool has room for (a batch subscription: only
    into an empty pool, `RequestPool.room`), and tells `presence` when a pull found the queue empty."""

    def __init__(
        self,
        subscriber: pubsub_v1.SubscriberClient,
        subscription: str,
        spec: ModelSpec,
        priority: str,
        pool: RequestPool,
        leases: LeaseKeeper,
        triage: Triage,
        health: WorkerHealth,
        presence: PullerPresence | None = None,
    ) -> None:
        super().__init__(subscriber, subscription, health, f"pull-{spec.queue}-{priority}")
        self._presence = presence
        self._topic = naming.request_topic(spec.queue, priority)  # type: ignore[arg-type]
        self._spec = spec
        self._priority = priority
        self._pool = pool
        self._leases = leases
        self._triage = triage

    def _run(self) -> None:
        log.info("pulling %s", self.subscription)
        while not self.stopping.is_set():
            room = self._pool.wait_for_room(self._priority, timeout=1.0)
            if room <= 0 or self.stopping.is_set():
                continue
            started_ms = int(time.time() * 1000)
            received_messages = self._pull(room)
            if received_messages == [] and self._presence is not None:
                self._presence.pulled_empty(self._topic, started_ms)
            for received in received_messages or []:
                self._take(received)
        log.info("stopped pulling %s", self.subscription)

    def _take(self, received) -> None:
        attributes = dict(received.message.attributes)
        message = HeldMessage(
            subscription=self.subscription,
            ack_id=received.ack_id,
            attributes=attributes,
            data=bytes(received.message.data),
            # A request the watchdog re-dispatched is a new message: its earlier deliveries count too.
            delivery_attempt=(received.delivery_attempt or 1) + redispatches_of(attributes),
            received_at=time.time(),
        )
        self._leases.hold(message)
        if self.stopping.is_set():
            self._leases.release(message)
            return
        try:
            with request_log_context(message):
                pending = self._triage(self._spec, message, self._priority)
        except Exception:
            log.exception("could not triage a request on %s; handing it back", self.subscription)
            self._leases.release(message)
            return
        if pending is None:
            return
        if not self._leases.take(message, pending.request_id):
            # This worker or another live one holds this request (the broker redelivered it, the watchdog
            # re-dispatched it while its holder only stalled, or a batch restored after a Redis loss published it
            # again): that run answers it, so this copy is dropped, not run twice.
            log.info("request %s is held already; dropping this copy", pending.request_id)
            self._leases.ack(message, answered=False)
            return
        self._pool.add(pending)


class DeadLetterResponder(SubscriptionLoop):
    """Answers requests that exhausted their delivery attempts, so their clients hear `failed`, not a timeout."""

    wait_seconds = DEAD_LETTER_PULL_WAIT_SECONDS
    cancel_on_stop = True

    def __init__(
        self,
        subscriber: pubsub_v1.SubscriberClient,
        subscription: str,
        spec: ModelSpec,
        leases: LeaseKeeper,
        results: ResultStore,
        finisher: ReplyFinisher,
        replies: ReplyFactory,
        health: WorkerHealth,
    ) -> None:
        super().__init__(subscriber, subscription, health, f"dead-letter-{spec.queue}")
        self._spec = spec
        self._leases = leases
        self._results = results
        self._finisher = finisher
        self._replies = replies

    def _run(self) -> None:
        while not self.stopping.is_set():
            received_messages = self._pull(10)
            for received in received_messages or []:
                self._answer(received)
            if received_messages == []:  # empty (a failed pull has backed off already): look again later
                self.stopping.wait(DEAD_LETTER_LOOK_SECONDS)

    def _answer(self, received) -> None:
        attributes = dict(received.message.attributes)
        request_id = attributes.get(Attr.REQUEST_ID, "")
        message = HeldMessage(
            subscription=self.subscription,
            ack_id=received.ack_id,
            attributes=attributes,
            data=received.message.data,  # a flow's answer names the flow and stage its message was at
            delivery_attempt=self._spec.max_delivery_attempts,
            received_at=time.time(),
        )
        self._leases.hold(message)
        try:
            stored = self._results.get(request_id) if request_id else None
        except Exception as exc:  # noqa: BLE001 - Redis down: answer with the failure instead
            self._finisher.redis_trouble.warn("lookup", exc)
            stored = None
        if stored is not None:
            self._finisher.answer(message, stored, store=False)
            return
        attempts = attributes.get("CloudPubSubDeadLetterSourceDeliveryCount") or str(self._spec.max_delivery_attempts)
        try:
            cause = self._results.failure_cause(request_id) if request_id else None
        except Exception as exc:  # noqa: BLE001 - Redis down: answered without the cause
            self._finisher.redis_trouble.warn("lookup", exc)
            cause = None
        log.error("request %s dead-lettered after %s attempts: %s", request_id, attempts, cause)
        reply = self._replies.make(
            self._spec,
            request_id,
            message,
            status="error",
            error_kind="dead_lettered",
            error=f"failed after {attempts} delivery attempts" + (f"; the last: {cause}" if cause else ""),
        )
        self._finisher.answer(message, reply)
