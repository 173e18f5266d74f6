"""Requests in flight, kept in Redis: each message from publish to deadline, and the lease of the worker holding it.

The API keeps every request it publishes (`keep`); a worker that takes one for the device sets a holder lease a
few seconds long (`take`) and its lease keeper refreshes it (`heartbeat`); answering ends the record (`finish`).
A watchdog reads the other side: requests whose holder lease lapsed with no stored result (`lapsed`) are
published again, and requests past their deadline that nobody holds (`overdue`) are answered `expired`. Holder
leases are Redis keys with a TTL, so a dead worker's hold ends on Redis's clock, not on any host's.

Callers decide what a Redis failure means: the worker and the API carry on without it, and a dead worker's
requests then come back through the broker's redelivery instead.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import redis

from contract import naming
from contract.messages import Attr

log = logging.getLogger(__name__)
# The kept message outlives its deadline by this much, so the watchdog still finds it to answer `expired`.
KEEP_PAST_DEADLINE_SECONDS = 300

# Refresh (or re-claim, after a Redis outage) the holder lease of each request, unless another worker holds it.
_HEARTBEAT = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
local lost = {}
for i = 2, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder == false or holder == ARGV[1] then
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    redis.call('ZADD', KEYS[1], expiry, ARGV[i + 1])
  else
    table.insert(lost, ARGV[i + 1])
  end
end
return lost
"""
# Take a request unless another worker (or this one, through a duplicate delivery) holds it.
_TAKE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) == false then
  return redis.call('GET', KEYS[1]) or ''
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2]), ARGV[3])
return false
"""
# Drop this worker's holds; with ARGV[2] == '1' the requests were answered, so their kept records go too.
_LET_GO = """
for i = 3, #KEYS, 2 do
  local id = ARGV[(i - 3) / 2 + 3]
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[1], id)
  end
  if ARGV[2] == '1' then
    redis.call('ZREM', KEYS[2], id)
    redis.call('DEL', KEYS[i + 1])
  end
end
return 0
"""
# Renew the watchdog's leadership if this process holds it, else take it if it is free.
_LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class KeptRequest:
    """A request message as the API published it, and how often the watchdog has published it again."""

    request_id: str
    topic: str
    data: bytes
    attributes: dict[str, str]
    deadline_ms: int
    redispatches: int


@dataclass(frozen=True)
class InflightState:
    """What the watchdog needs to decide about one request: is it held, answered, still kept."""

    request_id: str
    held: bool
    answered: bool
    kept: KeptRequest | None


class RedisOutage:
    """Logs a lost Redis once per outage, and its return once: the fallback is the broker's redelivery."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._down = False
        self._lock = threading.Lock()

    def failed(self, exc: Exception) -> None:
        with self._lock:
            first, self._down = not self._down, True
        if first:
            log.warning(
                "Redis unavailable for %s (%s): a dead worker's requests now come back only through the "
                "broker's redelivery (its ack deadline)",
                self._what,
                exc,
            )

    def succeeded(self) -> None:
        if self._down:
            with self._lock:
                was, self._down = self._down, False
            if was:
                log.warning("Redis reachable again for %s: dead workers' requests are re-dispatched again", self._what)


class InflightStore:
    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._take = client.register_script(_TAKE)
        self._let_go = client.register_script(_LET_GO)
        self._lead = client.register_script(_LEAD)

    # The API's side.

    def keep(self, request_id: str, topic: str, data: bytes, attributes: dict[str, str], deadline_ms: int) -> None:
        """Keeps a just-published request until its deadline (and a margin past it)."""
        key = naming.inflight_key(request_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(
            key,
            mapping={
                "topic": topic,
                "data": data,
                "attributes": json.dumps(attributes),
                "deadline_ms": deadline_ms,
                "redispatches": 0,
            },
        )
        pipe.pexpireat(key, deadline_ms + KEEP_PAST_DEADLINE_SECONDS * 1000)
        pipe.zadd(naming.INFLIGHT_DEADLINES_KEY, {request_id: deadline_ms})
        pipe.execute()

    # A worker's side.

    def take(self, request_id: str, holder: str, ttl_seconds: float) -> str | None:
        """Holds `request_id` for `holder`; returns None when taken, else the worker that already holds it."""
        other = self._take(
            keys=[naming.holder_key(request_id), naming.INFLIGHT_HELD_KEY],
            args=[holder, int(ttl_seconds * 1000), request_id],
        )
        return None if other is None else (other.decode() if isinstance(other, bytes) else str(other))

    def heartbeat(self, request_ids: list[str], holder: str, ttl_seconds: float) -> list[str]:
        """Extends `holder`'s leases (re-taking any that lapsed unclaimed); returns those another worker holds now."""
        if not request_ids:
            return []
        lost = self._heartbeat(
            keys=[naming.INFLIGHT_HELD_KEY, *(naming.holder_key(request_id) for request_id in request_ids)],
            args=[holder, int(ttl_seconds * 1000), *request_ids],
        )
        return [item.decode() if isinstance(item, bytes) else str(item) for item in lost]

    def let_go(self, request_ids: list[str], holder: str, answered: bool) -> None:
        """Ends `holder`'s leases on `request_ids`; `answered`: their results are stored, forget them entirely."""
        if not request_ids:
            return
        keys = [naming.INFLIGHT_HELD_KEY, naming.INFLIGHT_DEADLINES_KEY]
        for request_id in request_ids:
            keys += [naming.holder_key(request_id), naming.inflight_key(request_id)]
        self._let_go(keys=keys, args=[holder, "1" if answered else "0", *request_ids])

    # The watchdog's side.

    def lead(self, candidate: str, ttl_seconds: float) -> bool:
        """True while `candidate` holds (or has just taken) the fleet's one watchdog lease."""
        return bool(self._lead(keys=[naming.WATCHDOG_LEADER_KEY], args=[candidate, int(ttl_seconds * 1000)]))

    def now_ms(self) -> int:
        seconds, micros = self._redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def lapsed(self, limit: int = 200) -> list[InflightState]:
        """Requests a worker took whose lease has since run out (on Redis's clock)."""
        ids = self._redis.zrangebyscore(naming.INFLIGHT_HELD_KEY, "-inf", self.now_ms(), start=0, num=limit)
        return self.states([raw.decode() for raw in ids])

    def overdue(self, now_ms: int, limit: int = 200) -> list[InflightState]:
        """Requests still kept whose deadline (epoch ms, the API's clock) has passed."""
        ids = self._redis.zrangebyscore(naming.INFLIGHT_DEADLINES_KEY, "-inf", now_ms, start=0, num=limit)
        return self.states([raw.decode() for raw in ids])

    def states(self, request_ids: list[str]) -> list[InflightState]:
        if not request_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(naming.holder_key(request_id))
            pipe.exists(naming.result_key(request_id))
            pipe.hgetall(naming.inflight_key(request_id))
        answers = pipe.execute()
        states = []
        for index, request_id in enumerate(request_ids):
            held, answered, record = answers[index * 3 : index * 3 + 3]
            states.append(InflightState(request_id, bool(held), bool(answered), _kept(request_id, record)))
        return states

    def count_redispatch(self, request_id: str) -> int:
        """Counts one more re-dispatch and drops the request from the held index until a worker takes it again."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hincrby(naming.inflight_key(request_id), "redispatches", 1)
        pipe.zrem(naming.INFLIGHT_HELD_KEY, request_id)
        return int(pipe.execute()[0])

    def mark_lapsed(self, request_id: str) -> None:
        """Puts a request back in the held index as lapsed: its re-dispatch failed and is tried again."""
        self._redis.zadd(naming.INFLIGHT_HELD_KEY, {request_id: 0})

    def forget(self, request_id: str) -> None:
        """Ends a request's record: answered, or nothing left to do for it."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(naming.INFLIGHT_HELD_KEY, request_id)
        pipe.zrem(naming.INFLIGHT_DEADLINES_KEY, request_id)
        pipe.delete(naming.inflight_key(request_id))
        pipe.execute()

    def holders(self) -> dict[str, str]:
        """Every held request and the worker holding it (operators, the chaos suite)."""
        ids = [raw.decode() for raw in self._redis.zrange(naming.INFLIGHT_HELD_KEY, 0, -1)]
        if not ids:
            return {}
        values = self._redis.mget([naming.holder_key(request_id) for request_id in ids])
        return {request_id: value.decode() for request_id, value in zip(ids, values, strict=True) if value}


def _kept(request_id: str, record: dict) -> KeptRequest | None:
    if not record or b"topic" not in record:
        return None
    return KeptRequest(
        request_id=request_id,
        topic=record[b"topic"].decode(),
        data=record[b"data"],
        attributes=json.loads(record[b"attributes"]),
        deadline_ms=int(record[b"deadline_ms"]),
        redispatches=int(record.get(b"redispatches", 0)),
    )


class RequestKeeper:
    """The API's one call: keep each published request, or carry on without Redis (logged once per outage).

    After a failure Redis is skipped for `retry_seconds`, so an outage costs the request path one failed call
    per period, not one per request."""

    def __init__(self, store: InflightStore, retry_seconds: float = 1.0) -> None:
        self._store = store
        self._retry_seconds = retry_seconds
        self._skip_until = 0.0
        self._outage = RedisOutage("keeping published requests")

    def keep(self, topic: str, data: bytes, attributes: dict[str, str]) -> None:
        if time.monotonic() < self._skip_until:
            return
        try:
            self._store.keep(attributes[Attr.REQUEST_ID], topic, data, attributes, int(attributes[Attr.DEADLINE_MS]))
        except redis.RedisError as exc:
            self._skip_until = time.monotonic() + self._retry_seconds
            self._outage.failed(exc)
            return
        self._outage.succeeded()
