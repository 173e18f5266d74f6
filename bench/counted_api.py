"""The API's own app for gunicorn, with every Pub/Sub admin operation it makes counted in Redis.

    gunicorn --config api_server/process/gunicorn_conf.py bench.counted_api:app

Pub/Sub's admin quota (6,000 a minute per project) covers get, list, create, update and delete of topics,
subscriptions and snapshots. This module wraps those methods on the Google client classes before the app
is built, so the count is of the calls the API really makes, whichever reply mode it runs in. Each call
adds one to `bench:pubsub-admin:<method>` in the stack's Redis (one INCR, well under a millisecond).
"""

from __future__ import annotations

import functools
import os
import threading

import redis
from google.pubsub_v1.services.publisher.client import PublisherClient
from google.pubsub_v1.services.subscriber.client import SubscriberClient

from bench.admin_ops import COUNTER_PREFIX

ADMIN_METHODS = {
    SubscriberClient: (
        "create_subscription", "get_subscription", "update_subscription", "list_subscriptions",
        "delete_subscription", "create_snapshot", "update_snapshot", "delete_snapshot", "list_snapshots",
        "get_snapshot",
    ),
    PublisherClient: (
        "create_topic", "get_topic", "update_topic", "list_topics", "delete_topic", "list_topic_subscriptions",
    ),
}  # fmt: skip

_redis: redis.Redis | None = None
_lock = threading.Lock()


def _counter() -> redis.Redis:
    global _redis
    with _lock:
        if _redis is None:  # after gunicorn forks, like the app's own clients
            _redis = redis.Redis.from_url(os.environ["MAAS_REDIS_URL"], socket_timeout=2)
        return _redis


def _counted(method_name: str, method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            _counter().incr(COUNTER_PREFIX + method_name)

    return wrapper


def install() -> None:
    for cls, names in ADMIN_METHODS.items():
        for name in names:
            method = getattr(cls, name)
            if not getattr(method, "_bench_counted", False):
                wrapped = _counted(name, method)
                wrapped._bench_counted = True
                setattr(cls, name, wrapped)


install()
from api_server.process.asgi import app  # noqa: E402 - the wrappers must be in place before the clients are built

__all__ = ["app"]
