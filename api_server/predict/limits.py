"""Per-API-key rate and concurrency limits, enforced in Redis so they hold across every API process.

One Lua script decides atomically on Redis's own clock (no skew between API instances):

- **rate**: a token bucket per key holding up to a minute's allowance (`MAAS_RATE_LIMIT_PER_MINUTE`),
  refilled continuously; an empty bucket is a 429 whose `Retry-After` is the time until the next token.
- **concurrency**: a sorted set of leases per key (`MAAS_CONCURRENCY_LIMIT`), each scored by its expiry.
  A request holds one lease while it is served and releases it at the end; a process killed mid-request
  cannot leak its slot for longer than the lease (the model's request timeout plus a margin), since
  expired leases are dropped before counting.

Limits are an overload guard, not the billing record: while Redis is unreachable requests are admitted
(fail open), counted as `unenforced` in `maas_api_limit_decisions_total` and logged once per outage.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass

import redis

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.core.redis_state import RedisState

log = logging.getLogger(__name__)
# A lease outlives the longest legitimate hold by this much; a crashed holder frees its slot after that.
LEASE_MARGIN_SECONDS = 30

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local per_minute, concurrent = tonumber(ARGV[1]), tonumber(ARGV[2])
if concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= concurrent then
    return {0, 1000}
  end
end
if per_minute > 0 then
  local per_ms = per_minute / 60000
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(state[1]) or per_minute
  local last = tonumber(state[2]) or now
  tokens = math.min(per_minute, tokens + math.max(0, now - last) * per_ms)
  local admitted = tokens >= 1
  if admitted then tokens = tokens - 1 end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], 60000 + 1000)
  if not admitted then
    return {0, math.ceil((1 - tokens) / per_ms), 'rate'}
  end
end
if concurrent > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
end
return {1, 0}
"""


@dataclass(frozen=True)
class KeyLimits:
    per_minute: int  # 0: unlimited
    concurrent: int  # 0: unlimited

    @property
    def unlimited(self) -> bool:
        return self.per_minute <= 0 and self.concurrent <= 0


@dataclass(frozen=True)
class Lease:
    """A held concurrency slot (or nothing to release, when the key has no concurrency limit)."""

    key: str | None
    member: str = ""


NO_LEASE = Lease(None)


class RequestLimiter:
    def __init__(
        self,
        state: RedisState,
        default: KeyLimits,
        overrides: dict[str, tuple[int, int]] | None = None,
        lease_margin_seconds: float = LEASE_MARGIN_SECONDS,
    ) -> None:
        self._state = state
        self._default = default
        self._overrides = {digest: KeyLimits(*limits) for digest, limits in (overrides or {}).items()}
        self._admit = state.client.register_script(_ADMIT)
        self._lease_margin = lease_margin_seconds
        self._unenforced_logged = False

    def limits_for(self, key_digest: str) -> KeyLimits:
        return self._overrides.get(key_digest, self._default)

    def admit(self, key_id: str, key_digest: str, hold_seconds: float) -> Lease:
        """A lease to release when the request ends, or a 429 with `Retry-After`; admits while Redis is down."""
        limits = self.limits_for(key_digest)
        if limits.unlimited:
            return NO_LEASE
        if not self._state.available():
            return self._unenforced("redis in back-off")
        rate_key, lease_key = f"maas:limit:{{{key_id}}}:rate", f"maas:limit:{{{key_id}}}:leases"
        member = uuid.uuid4().hex
        lease_ms = int((hold_seconds + self._lease_margin) * 1000)
        try:
            admitted, wait_ms, *reason = self._admit(
                keys=[rate_key, lease_key], args=[limits.per_minute, limits.concurrent, member, lease_ms]
            )
        except redis.RedisError as exc:
            self._state.failed(exc)
            return self._unenforced(str(exc))
        self._state.succeeded()
        self._unenforced_logged = False
        if admitted:
            metrics.LIMIT_DECISIONS.labels("admitted").inc()
            return Lease(lease_key if limits.concurrent > 0 else None, member)
        retry_after = str(max(1, math.ceil(int(wait_ms) / 1000)))
        if reason:
            metrics.LIMIT_DECISIONS.labels("rate_limited").inc()
            message = f"rate limit of {limits.per_minute} requests a minute exceeded for this API key"
        else:
            metrics.LIMIT_DECISIONS.labels("concurrency_limited").inc()
            message = f"at most {limits.concurrent} concurrent requests for this API key"
        raise ApiError(429, message, headers={"Retry-After": retry_after})

    def release(self, lease: Lease) -> None:
        if lease.key is None or not self._state.available():
            return  # a lease that cannot be released now expires by itself
        try:
            self._state.client.zrem(lease.key, lease.member)
        except redis.RedisError as exc:
            self._state.failed(exc)

    def _unenforced(self, why: str) -> Lease:
        metrics.LIMIT_DECISIONS.labels("unenforced").inc()
        if not self._unenforced_logged:
            self._unenforced_logged = True
            log.error("rate and concurrency limits not enforced while Redis is unavailable (%s)", why)
        return NO_LEASE
