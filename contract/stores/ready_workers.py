"""The workers ready to serve each model, kept in Redis by the workers themselves: admission's capacity.

A worker says it is ready for each model it serves (`announce`, with the requests it runs at once) every few
seconds while it serves, and leaves when it drains (`leave`); a worker that dies just stops saying so, and its
word lapses on Redis's clock after `READY_SECONDS`. The API reads these keys in admission's backlog script
(`api_server/predict/admission.py`), so a model whose workers are up and idle is judged by them, not by an
answer history it does not have yet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from contract import naming

log = logging.getLogger(__name__)
# A worker's word that it is ready lasts this long; it renews it every `READY_SECONDS / 4`.
READY_SECONDS = 8.0

# KEYS: per queue, its ready set and its batch sizes. ARGV: the worker, how long its word lasts (ms), then the
# requests it runs at once for each queue. The keys live as long as the longest word in them (another worker's
# shorter one never cuts it).
_ANNOUNCE = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
for i = 1, #KEYS, 2 do
  redis.call('ZADD', KEYS[i], expiry, ARGV[1])
  redis.call('HSET', KEYS[i + 1], ARGV[1], ARGV[(i + 1) / 2 + 2])
  for _, key in ipairs({KEYS[i], KEYS[i + 1]}) do
    if redis.call('PTTL', key) < tonumber(ARGV[2]) then redis.call('PEXPIRE', key, ARGV[2]) end
  end
end
return 0
"""


class ReadyWorkers:
    """A worker's side: say it is ready for its queues (with its batch sizes), or that it no longer is."""

    def __init__(self, client: redis.Redis, worker_id: str, batch_sizes: dict[str, int]) -> None:
        """`batch_sizes`: the requests this worker runs at once, per queue it serves (`ModelSpec.queue`)."""
        self._redis = client
        self._worker_id = worker_id
        self._batch_sizes = dict(batch_sizes)
        self._announce = client.register_script(_ANNOUNCE)

    def _keys(self) -> list[str]:
        keys: list[str] = []
        for queue in self._batch_sizes:
            keys += [naming.ready_workers_key(queue), naming.ready_batches_key(queue)]
        return keys

    def announce(self, seconds: float = READY_SECONDS) -> None:
        """Ready for every queue, for `seconds` more."""
        args = [self._worker_id, int(seconds * 1000), *self._batch_sizes.values()]
        self._announce(keys=self._keys(), args=args)

    def leave(self) -> None:
        """No longer ready (draining): admission stops counting this worker at once."""
        pipe = self._redis.pipeline(transaction=False)
        for queue in self._batch_sizes:
            pipe.zrem(naming.ready_workers_key(queue), self._worker_id)
            pipe.hdel(naming.ready_batches_key(queue), self._worker_id)
        pipe.execute()


class ReadinessBeacon:
    """Renews a worker's word that it is ready from a thread of its own while `ready()` says so; leaves on stop.
    Redis down: nothing said (admission then falls back on the workers it saw holding requests)."""

    def __init__(self, workers: ReadyWorkers, ready: Callable[[], bool], seconds: float = READY_SECONDS) -> None:
        self._workers = workers
        self._ready = ready
        self._seconds = seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readiness", daemon=True)

    def start(self) -> None:
        self.beat()  # counted before the first pull returns
        self._thread.start()

    def beat(self) -> None:
        try:
            if self._ready():
                self._workers.announce(self._seconds)
            else:
                self._workers.leave()
        except redis.RedisError as exc:
            log.debug("readiness not said: %s", exc)

    def _run(self) -> None:
        while not self._stopped.wait(self._seconds / 4):
            self.beat()

    def stop(self) -> None:
        """Stops saying so and leaves at once (a draining worker takes nothing new)."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        try:
            self._workers.leave()
        except redis.RedisError as exc:
            log.debug("could not leave the ready workers (its word lapses by itself): %s", exc)
