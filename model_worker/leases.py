"""Keeps every message a worker holds leased, and acks or hands back messages in one place.

Ack deadlines are short (a crashed worker's requests come back quickly); this thread extends the lease
of everything held (waiting, running or being answered) well before the deadline passes. Acks are sent
in batches by a thread of their own, one call per subscription, so answering does not wait on them.
"""

from __future__ import annotations

import logging
import threading
import time

from google.api_core import exceptions
from google.cloud import pubsub_v1

from model_worker.pool import HeldMessage

log = logging.getLogger(__name__)
ACK_BATCH_SECONDS = 0.002


class LeaseKeeper:
    def __init__(self, subscriber: pubsub_v1.SubscriberClient, ack_deadlines: dict[str, int]) -> None:
        """`ack_deadlines`: each subscription's ack deadline in seconds."""
        self._subscriber = subscriber
        self._deadlines = ack_deadlines
        self._held: dict[str, set[str]] = {subscription: set() for subscription in ack_deadlines}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # A third of the shortest deadline: two extensions can fail before a lease is lost.
        self._period = min(ack_deadlines.values(), default=10) / 3
        self._thread = threading.Thread(target=self._run, name="leases", daemon=True)
        self._acks: list[HeldMessage] = []
        self._acks_waiting = threading.Condition()
        self._ack_thread = threading.Thread(target=self._ack_loop, name="acks", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ack_thread.start()

    def hold(self, message: HeldMessage) -> None:
        with self._lock:
            self._held[message.subscription].add(message.ack_id)

    def held_count(self) -> int:
        with self._lock:
            return sum(len(ack_ids) for ack_ids in self._held.values())

    def _forget(self, message: HeldMessage) -> None:
        with self._lock:
            self._held[message.subscription].discard(message.ack_id)

    def ack(self, message: HeldMessage) -> None:
        """Queues the ack; the ack thread sends it within a few milliseconds, batched with others."""
        self._forget(message)
        with self._acks_waiting:
            self._acks.append(message)
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
        for message in pending:
            by_subscription.setdefault(message.subscription, []).append(message.ack_id)
        for subscription, ack_ids in by_subscription.items():
            try:
                self._subscriber.acknowledge(request={"subscription": subscription, "ack_ids": ack_ids}, timeout=30)
            except exceptions.GoogleAPICallError as exc:
                # Each of these was answered: a redelivery is answered again from the stored reply.
                log.warning("could not ack %d answered messages on %s: %s", len(ack_ids), subscription, exc)

    def release(self, message: HeldMessage) -> None:
        """Hands a message back now (ack deadline 0), so another worker or attempt takes it."""
        self._forget(message)
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

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            self.extend_all()

    def stop(self) -> None:
        self._stopped.set()
        with self._acks_waiting:
            self._acks_waiting.notify_all()
        for thread in (self._thread, self._ack_thread):
            if thread.is_alive():
                thread.join(timeout=5)
        self.flush_acks()
