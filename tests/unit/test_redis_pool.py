"""The API's Redis pool: a caller beyond its size waits a bounded time, then gets a clear 503."""

from __future__ import annotations

import os

import pytest
from flask import Flask

from api_server.core.errors import register_error_handlers
from api_server.core.redis_state import BoundedWaitConnectionPool, RedisPoolExhaustedError
from contract.settings import Settings


class IdleConnection:
    """Stands in for a Redis connection: the pool only creates, checks and hands these out here."""

    def __init__(self, **_kwargs) -> None:
        self.pid = os.getpid()

    def connect(self) -> None:
        pass

    def can_read(self) -> bool:
        return False

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_caller_beyond_the_pool_waits_then_gets_a_busy_error_not_a_redis_error():
    pool = BoundedWaitConnectionPool(max_connections=2, timeout=0.05, connection_class=IdleConnection)
    held = [pool.get_connection(), pool.get_connection()]
    with pytest.raises(RedisPoolExhaustedError, match="all 2 of its Redis connections"):
        pool.get_connection()
    pool.release(held[0])
    assert pool.get_connection() is held[0]  # a freed connection is handed to the next caller


def test_an_exhausted_pool_is_a_503_with_its_message():
    app = Flask(__name__)
    register_error_handlers(app)

    @app.get("/busy")
    def busy():
        raise RedisPoolExhaustedError(100, 2.0)

    response = app.test_client().get("/busy")
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert "MAAS_REDIS_MAX_CONNECTIONS" in response.get_json()["error"]["message"]


def test_the_pool_is_configured_through_settings():
    settings = Settings.from_env({"MAAS_REDIS_MAX_CONNECTIONS": "400", "MAAS_REDIS_POOL_TIMEOUT_SECONDS": "0.5"})
    assert (settings.redis_max_connections, settings.redis_pool_timeout_seconds) == (400, 0.5)
    assert (Settings.from_env({}).redis_max_connections, Settings.from_env({}).redis_pool_timeout_seconds) == (100, 2.0)
