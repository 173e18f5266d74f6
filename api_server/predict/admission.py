"""Admission by predicted wait: refuse at once (503, `Retry-After`) a request that would miss its deadline in queue.

The estimate, from what the system already records in Redis:

- **backlog ahead**: the model's published requests not yet taken by a worker, at the request's priority and
  above (high counts high; normal counts high and normal). Every request the API publishes is kept in a sorted
  set per model and priority, by deadline, with its in-flight record (`InflightStore.keep`). A request leaves it
  when its deadline passes or its in-flight record is gone (the worker answered it, or the watchdog ended it);
  one a worker holds (its holder lease, `naming.holder_key`: running, or next in that worker's hands) is not
  waiting.
- **rate**: requests the model's workers answered in the last `MAAS_ADMISSION_WINDOW_SECONDS` (a request is
  counted when its stored result is seen), per second; and at least the fleet's capacity: the most workers seen
  holding its requests at once in that window (after an idle window: the count last seen, within the hour), times
  the requests one worker runs at once (`max_batch_size`), over the run time, so a burst from idle is not judged
  by the idle minute before it.
- **run time**: the model's recent inference time per request (smoothed from the replies the API receives).

Predicted start = backlog ahead / rate; the request is refused when `safety_factor` x (start + run time) is past
its deadline: a sync request's wait (`request_timeout_seconds`), a job's deadline (`MAAS_JOB_DEADLINE_SECONDS`).
`Retry-After` is when the backlog ahead will have drained enough for it to fit, at the same rate. Without an
estimate (no rate seen yet, or Redis unavailable) a request is admitted: admission never refuses on a guess.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import redis

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.core.redis_state import RedisState
from contract import naming
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
# Weight of the newest run time in the smoothed one.
RUN_TIME_WEIGHT = 0.3

# KEYS: the answered set, the run-time key, the peak-workers key, the last-workers key (the count last seen, kept an
# hour: after an idle window the fleet is taken to be what it last was), then per priority its backlog set and its
# reservations (requests admitted and not yet kept: counted, so that requests judged at the same moment see each
# other). ARGV: the window (ms), the scan limit, the key prefixes of in-flight records, holder leases, stored
# results and cancel marks, and the request to reserve a place for in the last priority's reservations ('' for
# none) and for how long (ms). A waiting request marked cancelled is dropped: a worker answers it unrun, so it is
# neither work ahead nor an answer that says how fast the model drains (25 cancelled jobs once kept a model
# refusing for 50 s). Returns: now (ms), answered in the window, the smoothed run time (ms, or -1), the most
# workers seen holding its requests at once in the window, then waiting and held per priority.
_BACKLOG = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local inflight, holder, result = ARGV[3], ARGV[4], ARGV[5]
local reserve, reserve_ms = ARGV[6], tonumber(ARGV[7])
local cancel = ARGV[8]
local out = {now, 0, tonumber(redis.call('GET', KEYS[2]) or '-1'), 0}
local workers, count = {}, 0
for i = 5, #KEYS, 2 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  local waiting, running = 0, 0
  for _, id in ipairs(redis.call('ZRANGE', KEYS[i], 0, limit - 1)) do
    if redis.call('EXISTS', inflight .. id) == 0 then
      redis.call('ZREM', KEYS[i], id)
      if redis.call('EXISTS', result .. id) == 1 then
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
  local reservations = KEYS[i + 1]
  redis.call('ZREMRANGEBYSCORE', reservations, '-inf', now)
  for _, id in ipairs(redis.call('ZRANGE', reservations, 0, limit - 1)) do
    if redis.call('ZSCORE', KEYS[i], id) then
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
local peak = tonumber(redis.call('GET', KEYS[3]) or '0')
if count >= peak and count > 0 then
  peak = count
  redis.call('SET', KEYS[3], peak, 'PX', window)
end
if count > 0 then
  redis.call('SET', KEYS[4], count, 'EX', 3600)
end
if peak == 0 then
  peak = tonumber(redis.call('GET', KEYS[4]) or '0')
end
out[4] = peak
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window)
out[2] = redis.call('ZCARD', KEYS[1])
return out
"""
_RAN = """
local old = tonumber(redis.call('GET', KEYS[1]) or '-1')
local new = tonumber(ARGV[1])
if old >= 0 then new = old + tonumber(ARGV[2]) * (new - old) end
redis.call('SET', KEYS[1], tostring(new), 'EX', 3600)
return 0
"""


@dataclass(frozen=True)
class Backlog:
    """What admission knows of a model when a request arrives."""

    ahead: int  # requests waiting at the request's priority and above
    held: int  # requests its workers hold now (running, or next in a worker's hands)
    workers: int  # the most workers seen holding its requests at once in the window
    per_worker: int  # requests one worker runs at once (the model's `max_batch_size`)
    answered: int  # requests answered in the window
    window_seconds: float
    run_seconds: float | None  # the smoothed run time of one request; None before any reply was seen

    @property
    def rate(self) -> float | None:
        """Requests answered per second now: the window's, or the fleet's capacity if that is more; None before
        anything was answered or seen held."""
        rates = [self.answered / self.window_seconds] if self.answered and self.window_seconds > 0 else []
        if self.workers and self.run_seconds:
            rates.append(self.workers * self.per_worker / self.run_seconds)
        return max(rates) if rates else None


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
    """Admit when the predicted finish (start + run time, times the safety factor) is within `left_seconds`;
    else refuse, with `retry_after` the seconds until the backlog ahead has drained enough at the same rate."""
    run = backlog.run_seconds or 0.0
    if backlog.ahead == 0:
        return Verdict(True, 0.0, run * safety_factor)
    rate = backlog.rate
    if rate is None:
        return ADMITTED_UNKNOWN
    start = backlog.ahead / rate
    finish = (start + run) * safety_factor
    if finish <= left_seconds:
        return Verdict(True, start, finish)
    # After t seconds, t x rate of the backlog ahead is gone: it fits when (start - t + run) x safety <= left.
    retry_after = max(1, math.ceil(start + run - left_seconds / safety_factor))
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
        keys = [naming.answered_key(queue), naming.run_time_key(queue), naming.peak_workers_key(queue),
                naming.last_workers_key(queue)]  # fmt: skip
        for priority in priorities:
            keys += [naming.backlog_key(queue, priority), naming.reservations_key(queue, priority)]
        prefixes = [naming.inflight_key(""), naming.holder_key(""), naming.result_key("")]
        window_ms, reserve_ms = int(self._window_seconds * 1000), RESERVATION_SECONDS * 1000
        args = [window_ms, self._scan_limit, *prefixes, reserve, reserve_ms, naming.cancel_key("")]
        out = [int(value) for value in self._backlog(keys=keys, args=args)]
        counts = out[4:]
        run_ms = out[2]
        backlog = Backlog(
            ahead=sum(counts[0::2]),
            held=sum(counts[1::2]),
            workers=out[3],
            per_worker=per_worker,
            answered=out[1],
            window_seconds=self._window_seconds,
            run_seconds=run_ms / 1000 if run_ms >= 0 else None,
        )
        return dict(zip(priorities, counts[0::2], strict=True)), backlog

    def ran(self, queue: str, inference_ms: float) -> None:
        """One request's run time, from its reply: folded into the model's smoothed one."""
        self._ran(keys=[naming.run_time_key(queue)], args=[round(inference_ms), RUN_TIME_WEIGHT])


class AdmissionControl:
    """Admission as the serving stage asks it: a verdict per request, admitted whenever there is no estimate."""

    def __init__(self, ledger: AdmissionLedger, state: RedisState) -> None:
        self._ledger = ledger
        self._state = state

    def check(self, spec: ModelSpec, priority: str, left_seconds: float, request_id: str = "") -> Verdict | None:
        """The verdict for a request of `spec` at `priority` with `left_seconds` to its deadline; None when the
        model has admission off (or the request is a batch line's, which is never judged). An admitted
        `request_id` counts in the model's backlog at once, before it is published."""
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
        return self._count(spec, verdict)

    def ran(self, spec: ModelSpec, inference_ms: float) -> None:
        """A reply's run time, for a model with admission on (nothing kept for the others)."""
        if spec.admission is None or not spec.admission.enabled or inference_ms <= 0 or not self._state.available():
            return
        try:
            self._ledger.ran(spec.queue, inference_ms)
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
        answer rate, run time and the wait a normal request would be predicted now (the admission's inputs)."""
        waiting, backlog = self._ledger.by_priority(spec.queue, AHEAD["normal"], spec.max_batch_size)
        rate = backlog.rate
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
            "predicted_start_seconds": 0.0
            if backlog.ahead == 0
            else None
            if rate is None
            else round(backlog.ahead / rate, 1),
        }

    def fell_back(self, spec: ModelSpec) -> None:
        metrics.ADMISSION.labels(spec.name, "fallback").inc()
        _log_decision(spec, "fallback")

    @staticmethod
    def _count(spec: ModelSpec, verdict: Verdict) -> Verdict:
        decision = "unknown" if not verdict.known else "admitted" if verdict.admitted else "refused"
        metrics.ADMISSION.labels(spec.name, decision).inc()
        if decision == "refused":
            _log_decision(spec, decision, verdict)
        return verdict


def _log_decision(spec: ModelSpec, decision: str, verdict: Verdict | None = None) -> None:
    """One line per refusal or fallback, with its model: what the production dashboard counts (Cloud Run does not
    export the API's Prometheus metrics; terraform/dashboard.tf's log-based metric reads `admission`)."""
    fields = {"model": spec.name, "decision": decision}
    if verdict is not None:
        fields |= {"start_seconds": round(verdict.start_seconds or 0.0, 1), "retry_after": verdict.retry_after}
    log.info("admission %s a request for %s", decision, spec.name, extra={"fields": {"admission": fields}})
