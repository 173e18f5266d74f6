"""The API's own knobs (cache, idempotency, jobs), read once from the environment beside `contract.settings`."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ApiOptions:
    # Cached predict responses live this long; entries larger than the cap are never cached.
    cache_ttl_seconds: int = 24 * 3600
    cache_max_entry_bytes: int = 4 * 1024 * 1024
    # A Redis of its own for the cache (maxmemory + allkeys-lru); unset: the shared MAAS_REDIS_URL.
    cache_redis_url: str | None = None
    idempotency_ttl_seconds: int = 24 * 3600
    # How long a queued job (or a sync request turned into one) may wait for a worker before it expires.
    job_deadline_seconds: int = 900
    # After a Redis failure, the API stops trying Redis for this long, then tries again.
    redis_retry_seconds: float = 1.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ApiOptions:
        env = os.environ if environ is None else environ
        return cls(
            cache_ttl_seconds=int(env.get("MAAS_CACHE_TTL_SECONDS", cls.cache_ttl_seconds)),
            cache_max_entry_bytes=int(env.get("MAAS_CACHE_MAX_ENTRY_BYTES", cls.cache_max_entry_bytes)),
            cache_redis_url=env.get("MAAS_CACHE_REDIS_URL") or None,
            idempotency_ttl_seconds=int(env.get("MAAS_IDEMPOTENCY_TTL_SECONDS", cls.idempotency_ttl_seconds)),
            job_deadline_seconds=int(env.get("MAAS_JOB_DEADLINE_SECONDS", cls.job_deadline_seconds)),
            redis_retry_seconds=float(env.get("MAAS_REDIS_RETRY_SECONDS", cls.redis_retry_seconds)),
        )
