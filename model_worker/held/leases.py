"""Keeps every message a worker holds leased, and acks or hands back messages in one place.

Two leases per request. Pub/Sub's ack deadline: this thread extends it for everything held (waiting,
running or being answered) well before it passes. And a holder lease in Redis (`contract.stores.inflight`), a few
seconds long, on each request taken for the device, heartbeated by a thread of its own: when this process
dies, the lease lapses within seconds and the watchdog (`watchdog.py`) publishes the request again, instead
of waiting for the broker's redelivery. Acks are sent in batches by a thread of their own, one call per
subscription, so answering does not wait on them; answered requests' records are ended in the same pass.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from google.api_core import exceptions
from google.cloud import pubsub_v1

from contract.messages import Attr
from contract.stores.inflight import InflightStore, RedisOutage
from model_worker.held.pool import HeldMessage

log = logging.getLogger(__name__)
ACK_BATCH_SECONDS = 0.002


class LeaseKeeper:
    def __init__(
        self,
        subscriber: pubsub_v1.SubscriberClient,
        ack_deadlines: dict[str, int],
        inflight: InflightStore | None = None,
        holder: str = "",
        holder_lease_seconds: float = 3.0,
    ) -> None:
        """`ack_deadlines`: each subscription's ack deadline in seconds; `inflight`, `holder` (this worker's id)
        and `holder_lease_seconds`: the Redis holder leases (none without `inflight`)."""
        self._subscriber = subscriber
        self._deadlines = ack_deadlines
        self._held: dict[str, set[str]] = {subscription: set() for subscription in ack_deadlines}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # A third of the shortest deadline: two extensions can fail before a lease is lost.
        self._period = min(ack_deadlines.values(), default=10) / 3
        self._inflight = inflight
        self._holder = holder
        self._holder_lease = holder_lease_seconds
        # ack id -> request id of each request taken for the device (its holder lease is heartbeated).
        self._taken: dict[str, str] = {}
        self._redis_outage = RedisOutage("holder leases")
        self._heartbeat_period = holder_lease_seconds / 3
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="holder-leases", daemon=True)
        self._thread = threading.Thread(target=self._run, name="leases", daemon=True)
        self._acks: list[tuple[HeldMessage, bool]] = []
        self._acks_waiting = threading.Condition()
        self._ack_thread = threading.Thread(target=self._ack_loop, name="acks", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ack_thread.start()
        if self._inflight is not None:
            self._heartbeat_thread.start()

    def hold(self, message: HeldMessage) -> None:
        with self._lock:
            self._held[message.subscription].add(message.ack_id)

    def held_count(self) -> int:
        with self._lock:
            return sum(len(ack_ids) for ack_ids in self._held.values())

    def take(self, message: HeldMessage, request_id: str) -> bool:
        """Takes the holder lease on a request about to be held for the device; False when this worker already runs
        it under another delivery, or another live worker holds it (a duplicate delivery: that run answers it, or
        the watchdog re-dispatches it if its worker dies). Redis down: True, run without a lease (the broker's
        redelivery covers this worker's death)."""
        with self._lock:
            # Its own hold first: a Redis that lost its records (restarted without persistence) says nobody holds
            # what this worker is running, and a batch restored from GCS publishes its unanswered lines again.
            if request_id and request_id in self._taken.values():
                return False
            self._taken[message.ack_id] = request_id
        if self._inflight is not None and request_id:
            try:
                other = self._inflight.take(request_id, self._holder, self._holder_lease)
            except redis.RedisError as exc:
                self._redis_outage.failed(exc)
                other = None  # the heartbeat takes the lease once Redis answers again
            if other is not None:
                with self._lock:
                    self._taken.pop(message.ack_id, None)
                return False
        return True

    def _forget(self, message: HeldMessage) -> str | None:
        """Stops leasing `message`; returns its request id if it was taken for the device."""
        with self._lock:
            self._held[message.subscription].discard(message.ack_id)
            return self._taken.pop(message.ack_id, None)

    def ack(self, message: HeldMessage, answered: bool = True) -> None:
        """Queues the ack; the ack thread sends it within a few milliseconds, batched with others. `answered`:
        the request's answer is stored and published, so its in-flight record ends too (not for a duplicate)."""
        self._forget(message)
        with self._acks_waiting:
            self._acks.append((message, answered))
            self._acks_waiting.notify()

    def _ack_loop(self) -> None:
        while not self._stopped.is_set():
            with self._acks_waiting:
                self._acks_waiting.wait_for(lambda: self._acks or self._stopped.is_set(), timeout=1.0)
            time.sleep(ACK_BATCH_SECONDS)  # let the answers of one batch gather into one call
            self.flush_acks()

    def flush_acks(self) -> None:
        with self._acks_waiting:
            pending, self._acks = self._acks, []
        by_subscription: dict[str, list[str]] = {}
        for message, _ in pending:
            by_subscription.setdefault(message.subscription, []).append(message.ack_id)
        answered = [message.attributes.get(Attr.REQUEST_ID, "") for message, done in pending if done]
        self._let_go([request_id for request_id in answered if request_id], answered=True)
        for subscription, ack_ids in by_subscription.items():
            try:
                self._subscriber.acknowledge(request={"subscription": subscription, "ack_ids": ack_ids}, timeout=30)
            except exceptions.GoogleAPICallError as exc:
                # Each of these was answered: a redelivery is answered again from the stored reply.
                log.warning("could not ack %d answered messages on %s: %s", len(ack_ids), subscription, exc)

    def _let_go(self, request_ids: list[str], answered: bool) -> None:
        if self._inflight is None or not request_ids:
            return
        try:
            self._inflight.let_go(request_ids, self._holder, answered)
        except redis.RedisError as exc:
            self._redis_outage.failed(exc)  # the leases lapse by themselves; records end at their deadline

    def hand_over(self, message: HeldMessage) -> None:
        """Ends this worker's holder lease on a request another worker takes on next (a flow's stage published
        to another group's queue), before it is published: that worker takes the lease. The message stays leased
        until it is acked."""
        with self._lock:
            request_id = self._taken.pop(message.ack_id, None)
        if request_id:
            self._let_go([request_id], answered=False)

    def release(self, message: HeldMessage) -> None:
        """Hands a message back now (ack deadline 0), so another worker or attempt takes it."""
        request_id = self._forget(message)
        if request_id:
            self._let_go([request_id], answered=False)
        try:
            self._subscriber.modify_ack_deadline(
                request={"subscription": message.subscription, "ack_ids": [message.ack_id], "ack_deadline_seconds": 0},
                timeout=10,
            )
        except exceptions.GoogleAPICallError:
            log.warning("could not hand back a message; it returns when its ack deadline passes")

    def extend_all(self) -> None:
        with self._lock:
            held = {subscription: sorted(ack_ids) for subscription, ack_ids in self._held.items() if ack_ids}
        for subscription, ack_ids in held.items():
            try:
                self._subscriber.modify_ack_deadline(
                    request={
                        "subscription": subscription,
                        "ack_ids": ack_ids,
                        "ack_deadline_seconds": self._deadlines[subscription],
                    },
                    timeout=10,
                )
            except exceptions.GoogleAPICallError as exc:
                log.warning("could not extend %d leases on %s: %s", len(ack_ids), subscription, exc)

    def heartbeat(self) -> None:
        """Extends this worker's holder leases (taking any it ran without while Redis was down)."""
        if self._inflight is None:
            return
        with self._lock:
            taken = dict(self._taken)
        if not taken:
            return
        try:
            lost = set(self._inflight.heartbeat(sorted(set(taken.values()) - {""}), self._holder, self._holder_lease))
        except redis.RedisError as exc:
            self._redis_outage.failed(exc)
            return
        self._redis_outage.succeeded()
        if lost:
            # This process stalled past its leases and other workers took these: their answers stand (a result
            # is stored once), and ours will only be acked.
            log.warning("%d held requests were re-dispatched to another worker during a stall", len(lost))
            with self._lock:
                for ack_id, request_id in list(self._taken.items()):
                    if request_id in lost:
                        del self._taken[ack_id]

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            self.extend_all()

    def _heartbeat_loop(self) -> None:
        # A thread of its own: a slow Pub/Sub call must not let a live worker's holder leases lapse.
        while not self._stopped.wait(self._heartbeat_period):
            self.heartbeat()

    def stop(self) -> None:
        self._stopped.set()
        with self._acks_waiting:
            self._acks_waiting.notify_all()
        for thread in (self._thread, self._ack_thread, self._heartbeat_thread):
            if thread.is_alive():
                thread.join(timeout=5)
        self.flush_acks()
