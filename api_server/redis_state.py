"""Redis as a dependency the API can lose: after a failure it is skipped for a short back-off, then tried again.

The cache, coalescing and idempotency are optimisations; while Redis is down the API serves without them,
and each request pays at most one failed call per back-off period instead of one per Redis operation.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)


class RedisState:
    def __init__(self, client: redis.Redis, retry_seconds: float = 1.0) -> None:
        self.client = client
        self._retry_seconds = retry_seconds
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return not self._down

    def available(self) -> bool:
        """False during the back-off after a failure; True (try it) otherwise."""
        return time.monotonic() >= self._down_until

    def failed(self, exc: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self._retry_seconds
            if not self._down:
                self._down = True
                log.error("redis unavailable, serving without cache, coalescing and idempotency: %s", exc)
        from api_server import metrics

        metrics.REDIS_UP.set(0)

    def succeeded(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    log.warning("redis reachable again")
            from api_server import metrics

            metrics.REDIS_UP.set(1)


def api_redis_client(url: str) -> redis.Redis:
    """One immediate retry (a connection gone stale across a Redis restart), no backoff: redis-py's default
    retries for ~3 s, which every request would pay while Redis is down."""
    return redis.Redis.from_url(
        url, socket_timeout=5, socket_connect_timeout=2, retry=Retry(NoBackoff(), 1), health_check_interval=30
    )
