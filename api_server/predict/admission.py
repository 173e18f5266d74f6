"""Admission by predicted wait: refuse at once (503, `Retry-After`) a request that would miss its deadline in queue.

The estimate, from what the system already records in Redis:

- **backlog ahead**: the model's published requests not yet taken by a worker, at the request's priority and
  above (high counts high; normal counts high and normal). Every request the API publishes is kept in a sorted
  set per model and priority, by deadline, with its in-flight record (`InflightStore.keep`). A request leaves it
  when its deadline passes, its answer is stored (the worker stores it before it publishes the reply: the caller
  never sees a request it has been answered counted as waiting) or its in-flight record is gone (the watchdog
  ended it); one a worker holds (its holder lease, `naming.holder_key`: running, or next in that worker's hands)
  is not waiting, but what the workers hold beyond what they run at once has not started either: it is ahead too.
- **capacity**: the model's ready workers (each says so in Redis while it serves, with the requests it runs at
  once, `contract/stores/ready_workers.py`), so a freshly started model is judged by the workers it has; before
  any says so, the most workers seen holding its requests at once (within the window, else the count last seen
  within the hour) times the model's `max_batch_size`.
- **call time**: how long a worker takes per call when busy: from the end of its previous call to the end of this
  one when the request was already waiting (its run time plus what the worker spends between calls), else the
  run time; smoothed from the replies the API receives, with its mean deviation (the spread).

- **answer's trip**: from a call's end until the API has its answer (storing and publishing it, the reply's
  delivery), plus, from a reply of an idle worker, the pickup from the publish to the call's start; smoothed from
  the same replies: what the caller waits beyond the calls.

The rule (the default margin, with `safety_factor` 1): a call counts as its smoothed time plus `SPREAD_MARGIN` mean
deviations. A request that a free place (capacity less what the workers hold) takes at once starts now; else it
waits for a call to end, counted whole (one may have just begun), then for the requests queued beyond the free
places (waiting, and held beyond what runs) at capacity / call a second. It is refused when `safety_factor` x
(start + call + trip) is past its deadline: a sync request's wait (`request_timeout_seconds`), a job's deadline
(`MAAS_JOB_DEADLINE_SECONDS`). `Retry-After` is when the backlog ahead will have drained enough for it to fit, at
the same rate. Without an estimate (no call time or capacity known yet, or Redis unavailable) a request is
admitted: admission never refuses on a guess. Each refusal is counted and logged once, as what became of the
request: `refused` (its 503) or `fallback` (answered by the model's fallback).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import redis

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.core.redis_state import RedisState
from contract import naming
from contract.messages import InferenceReply
from contract.model_spec import ModelSpec

log = logging.getLogger(__name__)
# The priorities whose backlog is counted ahead of a request of each priority (batch lines are never judged).
AHEAD: dict[str, tuple[str, ...]] = {"high": ("high",), "normal": ("high", "normal")}
# At most this many kept requests per priority are looked at per estimate (held or waiting, stale ones dropped);
# the rest of the backlog beyond them is counted as waiting without a look (a fleet answering more than
# SCAN_LIMIT per deadline must still be refused when its queue is longer than that).
SCAN_LIMIT = 2000
# An admitted request counts in its model's backlog from its decision until it is kept with its published message;
# this long at most, if it never is (its publish failed).
RESERVATION_SECONDS = 10
# Weight of the newest call time in the smoothed one, and of its distance from the mean in the smoothed spread.
RUN_TIME_WEIGHT = 0.3
SPREAD_WEIGHT = 0.25
# A call counts as its smoothed time plus this many mean deviations: the default margin (RFC 6298 keeps 4 for one
# round trip's timeout; a backlog is a sum of calls whose deviations partly cancel). It is learnt from the second
# reply on: a model's first reply sets it to 0 (TCP starts from half the first round trip, which here made the
# first minutes' Retry-After twice the real drain).
SPREAD_MARGIN = 2.0

# KEYS: the answered set, the call-time key, its spread's, the answer trip's, the peak-workers key, the last-workers key (the count
# last seen, kept an hour: after an idle window the fleet is taken to be what it last was), the ready workers (by
# the expiry of their word, `contract/stores/ready_workers.py`) and their batch sizes, then per priority its
# backlog set and its reservations (requests admitted and not yet kept: counted, so that requests judged at the
# same moment see each other). ARGV: the window (ms), the scan limit, the key prefixes of in-flight records, holder
# leases, stored results and cancel marks, and the request to reserve a place for in the last priority's
# reservations ('' for none) and for how long (ms). A request whose answer is stored leaves the backlog (and its
# reservation) at once, before its worker lets go of it: a sequential client's answered requests are never work
# ahead of its next one. A waiting request marked cancelled is dropped: a worker answers it unrun, so it is
# neither work ahead nor an answer that says how fast the model drains (25 cancelled jobs once kept a model
# refusing for 50 s). Returns: now (ms), answered in the window, the smoothed call time (ms, or -1), the most
# workers seen holding its requests at once in the window, the spread (ms, or -1), the ready workers and the
# requests they run at once, the answer's trip (ms), then waiting and held per priority.
_BACKLOG = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local inflight, holder, result = ARGV[3], ARGV[4], ARGV[5]
local reserve, reserve_ms = ARGV[6], tonumber(ARGV[7])
local cancel = ARGV[8]
local out = {now, 0, tonumber(redis.call('GET', KEYS[2]) or '-1'), 0, tonumber(redis.call('GET', KEYS[3]) or '-1'), 0, 0,
             tonumber(redis.call('GET', KEYS[4]) or '0')}
for _, worker in ipairs(redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)) do
  redis.call('ZREM', KEYS[7], worker)
  redis.call('HDEL', KEYS[8], worker)
end
for _, worker in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
  out[6] = out[6] + 1
  out[7] = out[7] + (tonumber(redis.call('HGET', KEYS[8], worker) or '1') or 1)
end
local workers, count = {}, 0
for i = 9, #KEYS, 2 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  local reservations = KEYS[i + 1]
  local waiting, running = 0, 0
  for _, id in ipairs(redis.call('ZRANGE', KEYS[i], 0, limit - 1)) do
    local answered = redis.call('EXISTS', result .. id) == 1
    if answered or redis.call('EXISTS', inflight .. id) == 0 then
      redis.call('ZREM', KEYS[i], id)
      redis.call('ZREM', reservations, id)
      if answered and redis.call('EXISTS', cancel .. id) == 0 then
        redis.call('ZADD', KEYS[1], now, id)
      end
    else
      local worker = redis.call('GET', holder .. id)
      if worker then
        running = running + 1
        if not workers[worker] then
          workers[worker] = true
          count = count + 1
        end
      elseif redis.call('EXISTS', cancel .. id) == 1 then
        redis.call('ZREM', KEYS[i], id)
      else
        waiting = waiting + 1
      end
    end
  end
  local unseen = redis.call('ZCARD', KEYS[i]) - waiting - running
  if unseen > 0 then
    waiting = waiting + unseen
  end
  redis.call('ZREMRANGEBYSCORE', reservations, '-inf', now)
  for _, id in ipairs(redis.call('ZRANGE', reservations, 0, limit - 1)) do
    if redis.call('ZSCORE', KEYS[i], id) or redis.call('EXISTS', result .. id) == 1 then
      redis.call('ZREM', reservations, id)
    elseif id ~= reserve then
      waiting = waiting + 1
    end
  end
  if reserve ~= '' and i + 1 == #KEYS then
    redis.call('ZADD', reservations, now + reserve_ms, reserve)
    redis.call('PEXPIRE', reservations, reserve_ms)
  end
  table.insert(out, waiting)
  table.insert(out, running)
end
local peak = tonumber(redis.call('GET', KEYS[5]) or '0')
if count >= peak and count > 0 then
  peak = count
  redis.call('SET', KEYS[5], peak, 'PX', window)
end
if count > 0 then
  redis.call('SET', KEYS[6], count, 'EX', 3600)
end
if peak == 0 then
  peak = tonumber(redis.call('GET', KEYS[6]) or '0')
end
out[4] = peak
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window)
out[2] = redis.call('ZCARD', KEYS[1])
return out
"""
# KEYS: the call time, its spread, the answer's trip. ARGV: one call's time (ms), the two weights, the trip (ms; -1:
# not known). The spread moves first, by the distance of the new time from the old mean (RFC 6298's order).
_RAN = """
local mean = tonumber(redis.call('GET', KEYS[1]) or '-1')
local spread = tonumber(redis.call('GET', KEYS[2]) or '-1')
local new, weight = tonumber(ARGV[1]), tonumber(ARGV[2])
if mean < 0 then
  mean, spread = new, 0
else
  if spread < 0 then spread = 0 end
  spread = spread + tonumber(ARGV[3]) * (math.abs(new - mean) - spread)
  mean = mean + weight * (new - mean)
end
redis.call('SET', KEYS[1], tostring(mean), 'EX', 3600)
redis.call('SET', KEYS[2], tostring(spread), 'EX', 3600)
local trip = tonumber(ARGV[4])
if trip >= 0 then
  local old = tonumber(redis.call('GET', KEYS[3]) or '-1')
  if old >= 0 then trip = old + weight * (trip - old) end
  redis.call('SET', KEYS[3], tostring(trip), 'EX', 3600)
end
return 0
"""


@dataclass(frozen=True)
class Backlog:
    """What admission knows of a model when a request arrives."""

    ahead: int  # requests waiting at the request's priority and above
    held: int  # requests its workers hold now (running, or next in a worker's hands)
    workers: int  # its ready workers; before any says so, the most seen holding its requests at once
    per_worker: int  # requests one worker runs at once (the model's `max_batch_size`)
    answered: int  # requests answered in the window
    window_seconds: float
    run_seconds: float | None  # the smoothed call time of a busy worker; None before any reply was seen
    spread_seconds: float = 0.0  # the smoothed mean deviation of the call time
    trip_seconds: float = 0.0  # the smoothed time from a call's end until the API has its answer
    slots: int | None = None  # requests the ready workers run at once (their batch sizes); None: workers x per_worker

    @property
    def call_seconds(self) -> float | None:
        """A call as admission counts it: its smoothed time plus the margin of `SPREAD_MARGIN` deviations."""
        return None if self.run_seconds is None else self.run_seconds + SPREAD_MARGIN * self.spread_seconds

    @property
    def capacity(self) -> int:
        """Requests the fleet runs at once (0: no worker known)."""
        return self.slots if self.slots else self.workers * self.per_worker

    @property
    def free(self) -> int:
        """Requests the workers known could start now beside what they hold."""
        return max(0, self.capacity - self.held)

    @property
    def queued(self) -> int:
        """Requests ahead of a new one that no call runs yet: those waiting, and those held beyond what runs."""
        return self.ahead + max(0, self.held - self.capacity) if self.capacity else self.ahead

    @property
    def rate(self) -> float | None:
        """Requests answered per second now: the fleet's capacity over the call time, or, before either is known,
        the window's answers; None before anything was answered or any worker known."""
        call = self.call_seconds
        if self.capacity and call:
            return self.capacity / call
        return self.answered / self.window_seconds if self.answered and self.window_seconds > 0 else None

    def predicted_start(self) -> float | None:
        """When a request arriving now would start, in seconds (None: no estimate). A free place takes it at once;
        else it waits for a call to end, counted whole (one may have just begun), then for the requests queued
        beyond the free places, at the fleet's rate."""
        if self.queued < self.free or (self.queued == 0 and not self.capacity):
            return 0.0
        rate = self.rate
        if rate is None:
            return None
        return (self.call_seconds or 0.0) + (self.queued - self.free) / rate


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    # The predicted wait before it starts, and before it ends (safety factor applied); None: no estimate.
    start_seconds: float | None = None
    finish_seconds: float | None = None
    retry_after: int | None = None

    @property
    def known(self) -> bool:
        return self.start_seconds is not None


ADMITTED_UNKNOWN = Verdict(True)


def judge(backlog: Backlog, left_seconds: float, safety_factor: float = 1.0) -> Verdict:
    """Admit when the predicted finish (start + call time + the answer's trip, times the safety factor) is within
    `left_seconds`, or nothing is ahead; else refuse, with `retry_after` the seconds until the backlog ahead has
    drained enough at the same rate."""
    start = backlog.predicted_start()
    if start is None:
        return ADMITTED_UNKNOWN
    call = (backlog.call_seconds or 0.0) + backlog.trip_seconds
    finish = (start + call) * safety_factor
    if finish <= left_seconds or start == 0.0:
        return Verdict(True, start, finish)
    # After t seconds, t x rate of the backlog ahead is gone: it fits when (start - t + call) x safety <= left.
    retry_after = max(1, math.ceil(start + call - left_seconds / safety_factor))
    return Verdict(False, start, finish, retry_after)


class AdmissionLedger:
    """The Redis side: a model's backlog, answered requests and run time (the keys in `contract/naming.py`)."""

    def __init__(self, client: redis.Redis, window_seconds: float, scan_limit: int = SCAN_LIMIT) -> None:
        self._redis = client
        self._window_seconds = window_seconds
        self._scan_limit = scan_limit
        self._backlog = client.register_script(_BACKLOG)
        self._ran = client.register_script(_RAN)

    def backlog(self, queue: str, priority: str, per_worker: int = 1, reserve: str = "") -> Backlog:
        """The model's backlog ahead of a request of `priority`, its answer rate and run time (one script call).
        `reserve`: the request's id, counted from now on in its priority's backlog until it is kept with its
        published message (or `RESERVATION_SECONDS` pass, or `release`), so that requests judged at the same
        moment each see the others."""
        return self.by_priority(queue, AHEAD[priority], per_worker, reserve)[1]

    def release(self, queue: str, priority: str, request_id: str) -> None:
        """Gives up a refused request's reservation."""
        self._redis.zrem(naming.reservations_key(queue, priority), request_id)

    def by_priority(
        self, queue: str, priorities: tuple[str, ...], per_worker: int = 1, reserve: str = ""
    ) -> tuple[dict[str, int], Backlog]:
        """Requests waiting per priority of `priorities`, and the backlog of them all (one script call)."""
        keys = [naming.answered_key(queue), naming.run_time_key(queue), naming.run_spread_key(queue),
                naming.answer_trip_key(queue), naming.peak_workers_key(queue), naming.last_workers_key(queue),
                naming.ready_workers_key(queue), naming.ready_batches_key(queue)]  # fmt: skip
        for priority in priorities:
            keys += [naming.backlog_key(queue, priority), naming.reservations_key(queue, priority)]
        prefixes = [naming.inflight_key(""), naming.holder_key(""), naming.result_key("")]
        window_ms, reserve_ms = int(self._window_seconds * 1000), RESERVATION_SECONDS * 1000
        args = [window_ms, self._scan_limit, *prefixes, reserve, reserve_ms, naming.cancel_key("")]
        out = [int(value) for value in self._backlog(keys=keys, args=args)]
        _, answered, run_ms, peak, spread_ms, ready, slots, trip_ms = out[:8]
        counts = out[8:]
        backlog = Backlog(
            ahead=sum(counts[0::2]),
            held=sum(counts[1::2]),
            workers=ready or peak,
            per_worker=per_worker,
            answered=answered,
            window_seconds=self._window_seconds,
            run_seconds=run_ms / 1000 if run_ms >= 0 else None,
            spread_seconds=max(0, spread_ms) / 1000,
            trip_seconds=max(0, trip_ms) / 1000,
            slots=slots if ready else None,
        )
        return dict(zip(priorities, counts[0::2], strict=True)), backlog

    def ran(self, queue: str, call_ms: float, trip_ms: float | None = None) -> None:
        """One call's time (and the answer's trip from its end to the API, if known), from a reply: folded into the
        model's smoothed call time, its spread and trip."""
        keys = [naming.run_time_key(queue), naming.run_spread_key(queue), naming.answer_trip_key(queue)]
        trip = -1 if trip_ms is None else max(0, round(trip_ms))
        self._ran(keys=keys, args=[round(call_ms), RUN_TIME_WEIGHT, SPREAD_WEIGHT, trip])


class AdmissionControl:
    """Admission as the serving stage asks it: a verdict per request, admitted whenever there is no estimate.

    Each request's decision is counted once: `check` counts `admitted` and `unknown` itself; a refusal is counted
    (and logged, one line) by the caller once it knows what became of it, `refused` (its 503) or `fallback`
    (answered by the model's fallback): `decided`."""

    def __init__(self, ledger: AdmissionLedger, state: RedisState) -> None:
        self._ledger = ledger
        self._state = state

    def check(self, spec: ModelSpec, priority: str, left_seconds: float, request_id: str = "") -> Verdict | None:
        """The verdict for a request of `spec` at `priority` with `left_seconds` to its deadline; None when the
        model has admission off (or the request is a batch line's, which is never judged). An admitted
        `request_id` counts in the model's backlog at once, before it is published. A refusal is not counted
        here: the caller says what became of it (`decided`)."""
        policy = spec.admission
        if policy is None or not policy.enabled or priority not in AHEAD:
            return None
        if not self._state.available():
            return self._count(spec, ADMITTED_UNKNOWN)
        try:
            backlog = self._ledger.backlog(spec.queue, priority, spec.max_batch_size, request_id)
            verdict = judge(backlog, left_seconds, policy.safety_factor)
            if not verdict.admitted and request_id:
                self._ledger.release(spec.queue, priority, request_id)
        except redis.RedisError as exc:
            self._state.failed(exc)
            return self._count(spec, ADMITTED_UNKNOWN)
        if verdict.start_seconds is not None:
            metrics.PREDICTED_START.labels(spec.name, priority).set(round(verdict.start_seconds, 3))
        return self._count(spec, verdict) if verdict.admitted else verdict

    def decided(self, spec: ModelSpec, decision: str, verdict: Verdict) -> None:
        """What became of a refused request of `spec`: `refused` (a 503) or `fallback` (its fallback answers it).
        One count and one log line per request, what the dashboard's admission series counts."""
        metrics.ADMISSION.labels(spec.name, decision).inc()
        _log_decision(spec, decision, verdict)

    def ran(self, spec: ModelSpec, reply: InferenceReply, published_ms: float | None = None) -> None:
        """A reply's call time, for a model with admission on (nothing kept for the others): a busy worker's time
        from its previous call's end to this one's (gaps between calls included), else the run time; and, with
        `published_ms` (when the API published the request, epoch ms), the answer's trip: the time since the publish
        less the run time and, for a busy worker, the queue wait (an idle worker's pickup counts in the trip)."""
        if spec.admission is None or not spec.admission.enabled or reply.inference_ms <= 0:
            return
        if not self._state.available():
            return
        call_ms = reply.inference_ms
        if reply.previous_call_ended_ms is not None and reply.worker_finished_ms is not None:
            call_ms = max(call_ms, reply.worker_finished_ms - reply.previous_call_ended_ms)
        trip_ms = None
        if published_ms is not None:
            # A busy worker had it in hand (its wait was the calls ahead): only the way back. An idle one pulled it
            # after its publish: that pickup is part of the trip too, as it is for a burst's first request.
            waited_ms = reply.queue_ms if reply.previous_call_ended_ms is not None else 0.0
            trip_ms = time.time() * 1000 - published_ms - waited_ms - reply.inference_ms
        try:
            self._ledger.ran(spec.queue, call_ms, trip_ms)
        except redis.RedisError as exc:
            self._state.failed(exc)

    def fleet(self, specs: list[ModelSpec]) -> list[dict]:
        """`status` of each model, or a 503 while Redis is unreachable."""
        try:
            return [self.status(spec) for spec in specs]
        except redis.RedisError as exc:
            self._state.failed(exc)
            raise ApiError(503, "status unavailable: Redis is unreachable", headers={"Retry-After": "5"}) from exc

    def status(self, spec: ModelSpec) -> dict:
        """What the status view draws for one model: its waiting requests by priority, what its workers hold, its
        ready workers, answer rate, call time and the wait a normal request would be predicted now (the admission's
        inputs)."""
        waiting, backlog = self._ledger.by_priority(spec.queue, AHEAD["normal"], spec.max_batch_size)
        rate = backlog.rate
        start = backlog.predicted_start()
        return {
            "model": spec.name,
            "model_version": spec.version,
            "admission": spec.admission is not None and spec.admission.enabled,
            "waiting": waiting,
            "held": backlog.held,
            "workers": backlog.workers,
            "answered_per_second": round(backlog.answered / backlog.window_seconds, 3),
            "rate_per_second": None if rate is None else round(rate, 3),
            "run_seconds": backlog.run_seconds,
            "run_spread_seconds": backlog.spread_seconds,
            "predicted_start_seconds": None if start is None else round(start, 1),
        }

    @staticmethod
    def _count(spec: ModelSpec, verdict: Verdict) -> Verdict:
        metrics.ADMISSION.labels(spec.name, "admitted" if verdict.known else "unknown").inc()
        return verdict


def _log_decision(spec: ModelSpec, decision: str, verdict: Verdict | None = None) -> None:
    """One line per refused request, saying what became of it (`refused`: its 503; `fallback`: its fallback answered
    it), with its model: what the production dashboard counts (Cloud Run does not export the API's Prometheus
    metrics; terraform/dashboard.tf's log-based metric reads `admission`)."""
    fields = {"model": spec.name, "decision": decision}
    if verdict is not None:
        fields |= {"start_seconds": round(verdict.start_seconds or 0.0, 1), "retry_after": verdict.retry_after}
    log.info("admission %s a request for %s", decision, spec.name, extra={"fields": {"admission": fields}})
