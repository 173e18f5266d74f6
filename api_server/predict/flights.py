"""Runs one computation per key across API processes: a Redis lease per key, the others wait for its outcome.

Used twice: identical cacheable predict requests in flight together are coalesced (one inference, every
caller gets the same bytes), and requests repeating an Idempotency-Key are answered by the first one.

Within a process, callers of the same key wait on an in-memory event behind one local caller; across
processes, that caller takes the Redis lease (`SET NX PX`) or polls for the lease holder's outcome.
A waiter that outlives its bound, or sees the lease vanish with no outcome (its holder died), computes
by itself. Without Redis every process still coalesces its own callers and nothing else changes.

A lease names its holder's API process and ticket (the request computing it). A waiter that finds that process
dead (its liveness key lapsed, `contract/stores/inflight.py`) takes the lease over in one atomic step, so exactly one
waiter does, and adopts the dead holder's computation: `adopt(ticket)` answers from what the holder started
(its request's stored answer) instead of computing again, or returns None to compute afresh.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import redis

from api_server.core import metrics
from api_server.core.redis_state import RedisState
from contract import naming

log = logging.getLogger(__name__)
# Outcomes not kept for later callers stay this long, for the callers already waiting on them.
SETTLED_TTL_SECONDS = 30
POLL_FIRST_SECONDS = 0.01
POLL_MAX_SECONDS = 0.1

# One round trip per poll: the kept outcome, the settled one (for a caller already waiting), else the lease's
# holder, else the lease taken. KEYS: kept, settled, lease; ARGV: waiting (0/1), token, lease ms.
_BEGIN = """
local kept = redis.call('GET', KEYS[1])
if kept then return {'kept', kept} end
if ARGV[1] == '1' then
  local settled = redis.call('GET', KEYS[2])
  if settled then return {'settled', settled} end
end
local holder = redis.call('GET', KEYS[3])
if holder then return {'held', holder} end
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
return {'leader'}
"""
# The outcome stored and the lease released (only if still ours) in one round trip.
# KEYS: where the outcome goes, lease; ARGV: record, seconds to keep it, token.
_FINISH = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""
# A dead holder's lease taken over, only if it is still that holder's and its process's liveness key has lapsed.
# KEYS: lease, the holder's liveness key; ARGV: the holder's token, the new token, lease ms.
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
# How often a waiter looks whether the lease's holder is still alive.
TAKE_OVER_CHECK_SECONDS = 0.5


@dataclass
class ResponseRecord:
    """An HTTP answer as bytes, so every caller of a key gets exactly the same one."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""
    # The `contract.outcomes.Outcome` value it answers with, so a later caller logs the same outcome.
    outcome: str = ""

    def encode(self) -> bytes:
        meta = {"status": self.status, "headers": self.headers, "fingerprint": self.fingerprint}
        if self.outcome:
            meta["outcome"] = self.outcome
        return json.dumps(meta, separators=(",", ":")).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, raw: bytes) -> ResponseRecord:
        meta, _, body = raw.partition(b"\n")
        parsed = json.loads(meta)
        return cls(parsed["status"], body, parsed["headers"], parsed["fingerprint"], parsed.get("outcome", ""))


class Role(StrEnum):
    LEADER = "leader"  # computed it
    FOLLOWER = "follower"  # waited for an identical request's computation
    STORED = "stored"  # found a kept outcome (a cache hit, an idempotent replay)
    ALONE = "alone"  # computed without coordination (Redis down, or the wait ran out)
    ADOPTED = "adopted"  # its holder's process died: answered from the holder's computation, taken over


class FingerprintMismatchError(Exception):
    """The key is in use with a different request body (an Idempotency-Key reused for another request)."""


class CoordinationUnavailableError(Exception):
    """A strict flight could not be coordinated (Redis down): computing anyway could run it twice."""


class StillRunningError(Exception):
    """A strict flight's holder is still computing after the caller's wait ran out."""


@dataclass(frozen=True)
class FlightPolicy:
    # Seconds to keep an outcome for later callers (None: only for those already waiting).
    keep_for: Callable[[ResponseRecord], int | None]
    # Longer than the computation can take: a lease that outlives its holder only delays the next caller.
    lease_seconds: float
    # How long a caller waits for another's outcome before computing by itself.
    wait_seconds: float
    # Strict flights never compute without the lease (idempotency): they raise instead of going alone.
    strict: bool = False


@dataclass
class _LocalFlight:
    fingerprint: str
    done: threading.Event = field(default_factory=threading.Event)
    record: ResponseRecord | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class _Holder:
    """Who holds a lease, read from its token `{fingerprint}|{instance}|{ticket}`."""

    fingerprint: str
    instance: str
    ticket: str

    @classmethod
    def parse(cls, token: str) -> _Holder:
        fingerprint, _, rest = token.partition("|")
        instance, separator, ticket = rest.partition("|")
        return cls(fingerprint, instance, ticket) if separator else cls(fingerprint, "", "")


class SharedFlights:
    def __init__(self, state: RedisState, instance_id: str = "") -> None:
        """`instance_id`: this API process, named in its leases so that waiters can adopt them if it dies."""
        self._state = state
        self._instance = instance_id
        self._lock = threading.Lock()
        self._local: dict[str, _LocalFlight] = {}
        self._begin = state.client.register_script(_BEGIN)
        self._finish = state.client.register_script(_FINISH)
        self._take_over = state.client.register_script(_TAKE_OVER)

    def lookup(self, key: str, fingerprint: str = "") -> ResponseRecord | None:
        """The kept outcome for `key`, or None (also when Redis is down)."""
        if not self._state.available():
            return None
        try:
            raw = self._state.client.get(key)
        except redis.RedisError as exc:
            self._state.failed(exc)
            return None
        self._state.succeeded()
        return self._check(ResponseRecord.decode(raw), fingerprint) if raw else None

    def store(self, key: str, record: ResponseRecord, policy: FlightPolicy) -> None:
        ttl = policy.keep_for(record)
        if ttl is None or not self._state.available():
            return
        try:
            self._state.client.set(key, record.encode(), ex=ttl)
        except redis.RedisError as exc:
            self._state.failed(exc)

    def run(
        self,
        key: str,
        fingerprint: str,
        compute: Callable[[], ResponseRecord],
        policy: FlightPolicy,
        ticket: str | None = None,
        adopt: Callable[[str], ResponseRecord | None] | None = None,
    ) -> tuple[ResponseRecord, Role]:
        """`ticket`: what this caller's computation is (its request id), named in its lease; `adopt`: how to answer
        from a dead holder's ticket (None: compute afresh). Without `adopt` a dead holder's lease is taken over and
        computed again at once, rather than waited for until it lapses."""
        flight_token = f"{fingerprint}|{self._instance}|{ticket or uuid.uuid4().hex}"
        with self._lock:
            flight = self._local.get(key)
            first = flight is None
            if first:
                flight = self._local[key] = _LocalFlight(fingerprint)
        if not first:
            return self._follow_local(flight, fingerprint, compute, policy)
        try:
            flight.record, role = self._run_shared(key, fingerprint, flight_token, compute, adopt, policy)
            return flight.record, role
        except Exception as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                self._local.pop(key, None)
            flight.done.set()

    def _follow_local(self, flight: _LocalFlight, fingerprint: str, compute, policy) -> tuple[ResponseRecord, Role]:
        if flight.fingerprint != fingerprint:
            raise FingerprintMismatchError
        metrics.INFLIGHT_WAITS.inc()
        try:
            finished = flight.done.wait(policy.wait_seconds)
        finally:
            metrics.INFLIGHT_WAITS.dec()
        if finished and flight.record is not None:
            return flight.record, Role.FOLLOWER
        if isinstance(flight.error, FingerprintMismatchError):
            raise FingerprintMismatchError
        if policy.strict:
            raise StillRunningError
        return compute(), Role.ALONE

    def _run_shared(
        self, key: str, fingerprint: str, token: str, compute, adopt, policy: FlightPolicy
    ) -> tuple[ResponseRecord, Role]:
        lease_key, settled_key = f"{key}:lease", f"{key}:settled"
        deadline = time.monotonic() + policy.wait_seconds
        next_liveness_check = 0.0
        pause = POLL_FIRST_SECONDS
        waiting = False
        lease_ms = int(policy.lease_seconds * 1000)
        try:
            while True:
                if not self._state.available():
                    return _alone(compute, policy, CoordinationUnavailableError), Role.ALONE
                try:
                    # A settled outcome answers only callers that waited for it; a newcomer runs afresh.
                    found, *value = self._begin(
                        keys=[key, settled_key, lease_key], args=[int(waiting), token, lease_ms]
                    )
                    self._state.succeeded()
                except redis.RedisError as exc:
                    self._state.failed(exc)
                    return _alone(compute, policy, CoordinationUnavailableError), Role.ALONE
                if found in (b"kept", b"settled"):
                    record = self._check(ResponseRecord.decode(value[0]), fingerprint)
                    return record, (Role.FOLLOWER if waiting else Role.STORED)
                if found == b"held" and value[0].decode().split("|", 1)[0] != fingerprint:
                    raise FingerprintMismatchError
                if found == b"leader":
                    return self._lead(key, lease_key, settled_key, token, fingerprint, compute, policy), Role.LEADER
                if found == b"held" and time.monotonic() >= next_liveness_check:
                    next_liveness_check = time.monotonic() + TAKE_OVER_CHECK_SECONDS
                    holder = value[0].decode()
                    if self._took_over(lease_key, holder, token, lease_ms):
                        return self._adopt(key, lease_key, settled_key, token, fingerprint, holder, compute, adopt,
                                           policy)  # fmt: skip
                if time.monotonic() >= deadline:
                    log.warning("gave up waiting for the holder of %s", lease_key)
                    return _alone(compute, policy, StillRunningError), Role.ALONE
                if not waiting:
                    waiting = True
                    metrics.INFLIGHT_WAITS.inc()
                time.sleep(pause)
                pause = min(pause * 1.5, POLL_MAX_SECONDS)
        finally:
            if waiting:
                metrics.INFLIGHT_WAITS.dec()

    def _took_over(self, lease_key: str, holder: str, token: str, lease_ms: int) -> bool:
        """True when the lease's holder process is dead and this caller now holds its lease (one caller does)."""
        instance = _Holder.parse(holder).instance
        if not instance or not self._instance:
            return False  # a holder that names no process (or a caller that cannot be named) is waited for
        try:
            took = self._take_over(keys=[lease_key, naming.api_liveness_key(instance)], args=[holder, token, lease_ms])
        except redis.RedisError as exc:
            self._state.failed(exc)
            return False  # the next poll finds out what Redis can say
        if took:
            log.warning("took over %s from API process %s, which is gone", lease_key, instance)
        return bool(took)

    def _adopt(
        self, key, lease_key, settled_key, token, fingerprint, holder: str, compute, adopt, policy: FlightPolicy
    ) -> tuple[ResponseRecord, Role]:
        """Holding a dead holder's lease: its computation's answer if `adopt` finds one, else computed afresh."""
        adopted: list[bool] = []

        def answer() -> ResponseRecord:
            if adopt is not None and (record := adopt(_Holder.parse(holder).ticket)) is not None:
                adopted.append(True)
                return record
            return compute()

        record = self._lead(key, lease_key, settled_key, token, fingerprint, answer, policy)
        return record, (Role.ADOPTED if adopted else Role.LEADER)

    def _lead(self, key, lease_key, settled_key, token, fingerprint, compute, policy: FlightPolicy) -> ResponseRecord:
        computed = compute()
        record = ResponseRecord(computed.status, computed.body, computed.headers, fingerprint, computed.outcome)
        ttl = policy.keep_for(record)
        destination, keep = (key, ttl) if ttl is not None else (settled_key, SETTLED_TTL_SECONDS)
        try:
            self._finish(keys=[destination, lease_key], args=[record.encode(), keep, token])
        except redis.RedisError as exc:
            self._state.failed(exc)
        return record

    @staticmethod
    def _check(record: ResponseRecord, fingerprint: str) -> ResponseRecord:
        if record.fingerprint != fingerprint:
            raise FingerprintMismatchError
        return record


def _alone(compute: Callable[[], ResponseRecord], policy: FlightPolicy, refusal: type[Exception]) -> ResponseRecord:
    if policy.strict:
        raise refusal
    return compute()
