"""Tells the watchdog, through Redis, which request topics this worker pulls and when a pull found one empty.

One thread beats for every topic the worker's pullers pull, a few times per holder lease, so a dead worker's
beat lapses as fast as its holder leases do; the pullers only note, in memory, when an empty pull began, and
the next beat carries it. A worker that stops cleanly leaves (it handed back what it held: its going loses
nothing). What the watchdog makes of it: `contract.stores.pullers`.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from contract.stores.inflight import RedisOutage
from contract.stores.pullers import PullerStore

log = logging.getLogger(__name__)
# Old members are dropped, and the keys' expiry renewed, this often (every beat: hundreds of commands a second).
PRUNE_SECONDS = 60.0


class PullerPresence:
    def __init__(self, store: PullerStore, worker_id: str, topics: list[str], lease_seconds: float) -> None:
        """`topics`: the short names of the request topics this worker pulls; `lease_seconds`: the holder lease,
        which a beat lapses after (the watchdog's reading of it)."""
        self._store = store
        self.worker_id = worker_id
        self.topics = sorted(set(topics))
        self._period = lease_seconds / 3
        self._pruned_at = float("-inf")
        self._empty: dict[str, int] = {}
        self._lock = threading.Lock()
        self._outage = RedisOutage("puller beats")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="puller-beats", daemon=True)

    def start(self) -> None:
        self.beat()  # known as a puller before the first pull
        self._thread.start()

    def pulled_empty(self, topic: str, started_ms: int) -> None:
        """A waiting pull on `topic` that began at `started_ms` (epoch ms) came back with nothing."""
        with self._lock:
            self._empty[topic] = max(started_ms, self._empty.get(topic, 0))

    def beat(self) -> None:
        with self._lock:
            empty, self._empty = self._empty, {}
        prune = time.monotonic() - self._pruned_at >= PRUNE_SECONDS
        try:
            self._store.beat(self.worker_id, self.topics, int(time.time() * 1000), empty, prune)
        except redis.RedisError as exc:
            self._outage.failed(exc)
            with self._lock:  # carried by the next beat
                for topic, started_ms in empty.items():
                    self._empty[topic] = max(started_ms, self._empty.get(topic, 0))
            return
        if prune:
            self._pruned_at = time.monotonic()
        self._outage.succeeded()

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            self.beat()

    def stop(self) -> None:
        """Stops beating and leaves: call once the pullers stopped and the held requests were handed back."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self._store.leave(self.worker_id, self.topics)
        except redis.RedisError as exc:  # its beats lapse: read as a death, its queued requests are copied
            log.warning("could not leave the puller records: %s", exc)
