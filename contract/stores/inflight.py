"""Requests in flight, kept in Redis: each message from publish to deadline, and the lease of the worker holding it.

The API keeps every request it publishes (`keep`); a worker that takes one for the device sets a holder lease a
few seconds long (`take`) and its lease keeper refreshes it (`heartbeat`); answering ends the record (`finish`).
A watchdog reads the other side: requests whose holder lease lapsed with no stored result (`lapsed`) are
published again, and requests past their deadline that nobody holds (`overdue`) are answered `expired`. Holder
leases are Redis keys with a TTL, so a dead worker's hold ends on Redis's clock, not on any host's.

The API's processes are watched the same way: each keeps a liveness key alive (`ProcessLiveness`), and a sync
request's partial log row is kept with its message (`keep(row=...)`) until a process claims it (`settle_row` by
its own process, `claim_row` by another once that one is dead): the claim is one ZREM, so the row is written once.

Callers decide what a Redis failure means: the worker and the API carry on without it, and a dead worker's
requests then come back through the broker's redelivery instead.
"""

from __future__ import annotations

import contextlib
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
# An API process whose liveness key is this old is dead (renewed every second): what it held is adopted.
API_LIVENESS_SECONDS = 5.0
# A published copy no worker took within this many of its model's ack deadlines is published again (the broker
# would have delivered it again by then, had a worker pulled it and died).
UNCLAIMED_WAIT_ACK_DEADLINES = 2


def claim_wait_ms(ack_deadline_seconds: int) -> int:
    """How long a published request may go untaken before the watchdog publishes it again."""
    return 1000 * UNCLAIMED_WAIT_ACK_DEADLINES * ack_deadline_seconds


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
redis.call('ZREM', KEYS[3], ARGV[3])
return false
"""
# Drop this worker's holds; with ARGV[2] == '1' the requests were answered, so their kept records go too.
_LET_GO = """
for i = 3, #KEYS - 1, 2 do
  local id = ARGV[(i - 3) / 2 + 3]
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[1], id)
  end
  if ARGV[2] == '1' then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[#KEYS], id)
    redis.call('DEL', KEYS[i + 1])
  end
end
return 0
"""
# Claim a kept log row: exactly one caller removes it from the index, and only that one gets the row.
_CLAIM_ROW = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return false end
local row = redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[2])
return row or ''
"""
# Count a published re-dispatch and drop the request from the held index, unless a worker holds it by now (the new
# copy, a redelivered one, or a stalled holder's heartbeat): then the index entry is that holder's.
_REDISPATCHED = """
local count = redis.call('HINCRBY', KEYS[1], 'redispatches', 1)
if redis.call('EXISTS', KEYS[3]) == 0 then redis.call('ZREM', KEYS[2], ARGV[1]) end
return count
"""
# Watch a kept request for a taker until ARGV[2], counting a copy (ARGV[3]) and its publish time (ARGV[4]); a record
# ended meanwhile (answered) is left alone, not re-created without its expiry.
_AWAIT_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if ARGV[3] == '1' then
  redis.call('HINCRBY', KEYS[1], 'unclaimed_republishes', 1)
end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'published_ms', ARGV[4])
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
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
    # When its latest copy was published (epoch ms); None for a record kept before this was stored.
    published_ms: int | None = None


@dataclass(frozen=True)
class UnloggedRow:
    """A published sync request whose log row is still waiting in Redis, and the API process that owns it."""

    request_id: str
    row: dict
    deadline_ms: int

    @property
    def owner(self) -> str:
        return str(self.row.get("api_instance") or "")


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
        self._claim_row = client.register_script(_CLAIM_ROW)
        self._redispatched = client.register_script(_REDISPATCHED)
        self._await_claim = client.register_script(_AWAIT_CLAIM)

    # The API's side.

    def keep(
        self,
        request_id: str,
        topic: str,
        data: bytes,
        attributes: dict[str, str],
        deadline_ms: int,
        row: dict | None = None,
        unclaimed_after_ms: int | None = None,
        backlog_key: str | None = None,
    ) -> None:
        """Keeps a just-published request until its deadline (and a margin past it); `row`: its partial log row,
        kept apart from the message (which the worker drops when it answers) until a process claims it.
        `unclaimed_after_ms`: if no worker takes it within this long, the watchdog publishes it again (a copy
        pulled by a worker that died before taking it is otherwise found only by the broker, if at all).
        `backlog_key`: its model's backlog at its priority, which admission counts (`naming.backlog_key`)."""
        key = naming.inflight_key(request_id)
        expiry_ms = deadline_ms + KEEP_PAST_DEADLINE_SECONDS * 1000
        now_ms = int(time.time() * 1000)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(
            key,
            mapping={
                "topic": topic,
                "data": data,
                "attributes": json.dumps(attributes),
                "deadline_ms": deadline_ms,
                "redispatches": 0,
                "published_ms": now_ms,
            },
        )
        pipe.pexpireat(key, expiry_ms)
        pipe.zadd(naming.INFLIGHT_DEADLINES_KEY, {request_id: deadline_ms})
        if unclaimed_after_ms is not None:
            pipe.zadd(naming.INFLIGHT_UNCLAIMED_KEY, {request_id: now_ms + unclaimed_after_ms})
        if row is not None:
            pipe.set(naming.inflight_row_key(request_id), json.dumps(row), pxat=expiry_ms)
            pipe.zadd(naming.INFLIGHT_UNLOGGED_KEY, {request_id: deadline_ms})
        if backlog_key is not None:
            pipe.zadd(backlog_key, {request_id: deadline_ms})
            pipe.pexpireat(backlog_key, expiry_ms)
        pipe.execute()

    def in_flight(self, request_id: str) -> bool:
        """True while a published request is kept: its message (unanswered) or its log row (unwritten)."""
        return bool(self._redis.exists(naming.inflight_key(request_id), naming.inflight_row_key(request_id)))

    def settle_row(self, request_id: str) -> bool:
        """The owning process's claim on its request's kept row: True when it is still this process's to write,
        False when another process adopted it (and wrote it) because this one looked dead."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.zrem(naming.INFLIGHT_UNLOGGED_KEY, request_id)
        pipe.delete(naming.inflight_row_key(request_id))
        return bool(pipe.execute()[0])

    def unlogged(self, limit: int = 500) -> list[UnloggedRow]:
        """Kept rows not yet written, oldest deadline first (a row whose key expired is dropped from the index)."""
        entries = self._redis.zrange(naming.INFLIGHT_UNLOGGED_KEY, 0, limit - 1, withscores=True)
        if not entries:
            return []
        ids = [raw.decode() for raw, _ in entries]
        rows = self._redis.mget([naming.inflight_row_key(request_id) for request_id in ids])
        found = []
        for (request_id, (_, deadline_ms)), raw in zip(zip(ids, entries, strict=True), rows, strict=True):
            if raw is None:
                self._redis.zrem(naming.INFLIGHT_UNLOGGED_KEY, request_id)
                continue
            found.append(UnloggedRow(request_id, json.loads(raw), int(deadline_ms)))
        return found

    def claim_row(self, request_id: str) -> dict | None:
        """Adopts a kept row: the row for exactly one caller across processes, None for every other."""
        raw = self._claim_row(
            keys=[naming.INFLIGHT_UNLOGGED_KEY, naming.inflight_row_key(request_id)], args=[request_id]
        )
        return json.loads(raw) if raw else None

    def beat(self, instance_id: str, ttl_seconds: float) -> None:
        """Says the API process `instance_id` is alive for `ttl_seconds` more."""
        self._redis.set(naming.api_liveness_key(instance_id), "1", px=int(ttl_seconds * 1000))

    def alive(self, instance_ids: list[str]) -> set[str]:
        """The API processes among `instance_ids` whose liveness key has not lapsed."""
        unique = sorted(set(instance_ids))
        if not unique:
            return set()
        pipe = self._redis.pipeline(transaction=False)
        for instance_id in unique:
            pipe.exists(naming.api_liveness_key(instance_id))
        return {instance_id for instance_id, live in zip(unique, pipe.execute(), strict=True) if live}

    def pass_away(self, instance_id: str) -> None:
        """Ends the process's liveness at once (a clean shutdown: it has nothing left in flight)."""
        self._redis.delete(naming.api_liveness_key(instance_id))

    # A worker's side.

    def take(self, request_id: str, holder: str, ttl_seconds: float) -> str | None:
        """Holds `request_id` for `holder`; returns None when taken, else the worker that already holds it."""
        other = self._take(
            keys=[naming.holder_key(request_id), naming.INFLIGHT_HELD_KEY, naming.INFLIGHT_UNCLAIMED_KEY],
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
        keys.append(naming.INFLIGHT_UNCLAIMED_KEY)
        self._let_go(keys=keys, args=[holder, "1" if answered else "0", *request_ids])

    # The watchdog's side.

    def lead(self, candidate: str, ttl_seconds: float) -> bool:
        """True while `candidate` holds (or has just taken) the fleet's one watchdog lease."""
        return bool(self._lead(keys=[naming.WATCHDOG_LEADER_KEY], args=[candidate, int(ttl_seconds * 1000)]))

    def now_ms(self) -> int:
        seconds, micros = self._redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def lapsed(self, limit: int = 200, grace_ms: int = 0) -> list[InflightState]:
        """Requests a worker took whose lease has run out at least `grace_ms` ago (on Redis's clock)."""
        due = self.now_ms() - grace_ms
        ids = self._redis.zrangebyscore(naming.INFLIGHT_HELD_KEY, "-inf", due, start=0, num=limit)
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

    def unclaimed(self, now_ms: int, limit: int = 200) -> list[InflightState]:
        """Requests published (or published again) that no worker has taken by their due time (epoch ms)."""
        ids = self._redis.zrangebyscore(naming.INFLIGHT_UNCLAIMED_KEY, "-inf", now_ms, start=0, num=limit)
        return self.states([raw.decode() for raw in ids])

    def await_claim(
        self, request_id: str, due_ms: int, republished_unclaimed: bool = False, published_ms: int | None = None
    ) -> None:
        """Marks a request as untaken until `due_ms`; `republished_unclaimed`: it was published again because
        nobody took it (counted: the watchdog doubles its wait each time, so a request that only waits in a
        backlog is copied rarely). `published_ms`: when its latest copy was published (None: no new copy, it
        still waits in its queue)."""
        self._await_claim(
            keys=[naming.inflight_key(request_id), naming.INFLIGHT_UNCLAIMED_KEY],
            args=[request_id, due_ms, "1" if republished_unclaimed else "0", published_ms or ""],
        )

    def unclaimed_republishes(self, request_id: str) -> int:
        """How often the watchdog published `request_id` again because no worker took it."""
        return int(self._redis.hget(naming.inflight_key(request_id), "unclaimed_republishes") or 0)

    def unclaim(self, request_id: str) -> None:
        """Stops watching a request for want of a taker (it is held, or ended)."""
        self._redis.zrem(naming.INFLIGHT_UNCLAIMED_KEY, request_id)

    def count_redispatch(self, request_id: str) -> int:
        """Counts a re-dispatch once its copy is published, and drops the request from the held index until a
        worker takes it again, unless a worker already holds it.

        One script, not a check then a write: a worker taking the request between the two would otherwise lose
        its index entry while holding it, and if it died before its next heartbeat re-added it, no sweep would
        ever find the request again (its other copies dropped as duplicates of a live hold)."""
        count = self._redispatched(
            keys=[naming.inflight_key(request_id), naming.INFLIGHT_HELD_KEY, naming.holder_key(request_id)],
            args=[request_id],
        )
        return int(count)

    def forget(self, request_id: str) -> None:
        """Ends a request's record: answered, or nothing left to do for it."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(naming.INFLIGHT_HELD_KEY, request_id)
        pipe.zrem(naming.INFLIGHT_DEADLINES_KEY, request_id)
        pipe.zrem(naming.INFLIGHT_UNCLAIMED_KEY, request_id)
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
        published_ms=int(record[b"published_ms"]) if b"published_ms" in record else None,
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

    def keep(
        self,
        topic: str,
        data: bytes,
        attributes: dict[str, str],
        row: dict | None = None,
        unclaimed_after_ms: int | None = None,
        backlog_key: str | None = None,
    ) -> bool:
        """True when kept (with `row`, if given): then the row is the process's to settle, or another's to adopt.
        `unclaimed_after_ms`: see `InflightStore.keep`; `backlog_key`: counted in its model's backlog too
        (admission)."""
        if time.monotonic() < self._skip_until:
            return False
        request_id, deadline_ms = attributes[Attr.REQUEST_ID], int(attributes[Attr.DEADLINE_MS])
        try:
            self._store.keep(request_id, topic, data, attributes, deadline_ms, row, unclaimed_after_ms, backlog_key)
        except redis.RedisError as exc:
            self._skip_until = time.monotonic() + self._retry_seconds
            self._outage.failed(exc)
            return False
        self._outage.succeeded()
        return True


class ProcessLiveness:
    """Keeps this API process's liveness key alive from a thread of its own: once it lapses (the process died),
    other processes adopt what it left in flight: its Idempotency-Key leases and its requests' log rows."""

    def __init__(
        self, store: InflightStore, instance_id: str, ttl_seconds: float = API_LIVENESS_SECONDS, interval: float = 1.0
    ) -> None:
        self._store = store
        self.instance_id = instance_id
        self._ttl = ttl_seconds
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    def start(self) -> None:
        self._beat()  # alive before the first request is served
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self._beat()

    def _beat(self) -> None:
        try:
            self._store.beat(self.instance_id, self._ttl)
        except redis.RedisError as exc:
            log.debug("liveness not renewed: %s", exc)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # else it lapses by itself
            self._store.pass_away(self.instance_id)
