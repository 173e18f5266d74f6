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
        from api_server.core import metrics

        metrics.REDIS_UP.set(0)

    def succeeded(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    log.warning("redis reachable again")
            from api_server.core import metrics

            metrics.REDIS_UP.set(1)


class RedisPoolExhaustedError(Exception):
    """No Redis connection came free within the pool's wait: the API is busy, Redis is not down.

    Deliberately not a `redis.RedisError`: the code that serves without Redis while Redis is down must not
    take a full pool for a dead Redis (and skip the cache for a back-off); the app answers it 503."""

    def __init__(self, max_connections: int, timeout: float) -> None:
        super().__init__(
            f"the API is busy: all {max_connections} of its Redis connections stayed in use for {timeout:g} s "
            "(MAAS_REDIS_MAX_CONNECTIONS, MAAS_REDIS_POOL_TIMEOUT_SECONDS); retry shortly"
        )


class BoundedWaitConnectionPool(redis.BlockingConnectionPool):
    """At most `max_connections`; a caller beyond them waits up to `timeout` s for one to come free (redis-py's
    plain pool refuses at once), then gets `RedisPoolExhaustedError`."""

    def get_connection(self, *args, **kwargs):
        try:
            return super().get_connection(*args, **kwargs)
        except redis.ConnectionError as exc:
            if str(exc) == "No connection available.":
                raise RedisPoolExhaustedError(self.max_connections, self.timeout) from None
            raise


def api_redis_client(url: str, max_connections: int = 100, pool_timeout: float = 2.0) -> redis.Redis:
    """One immediate retry (a connection gone stale across a Redis restart), no backoff: redis-py's default
    retries for ~3 s, which every request would pay while Redis is down. A bounded pool, waited on briefly."""
    pool = BoundedWaitConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout,
        socket_timeout=5,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 1),
        health_check_interval=30,
    )
    return redis.Redis(connection_pool=pool)
