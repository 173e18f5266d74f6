"""The watchdog's sweep for requests no worker took (issue 44), against a real Redis (the store is Lua scripts):
a kept request whose message was lost before any worker held it is published again; a taken or answered one is
not, and a request that stays untaken is copied again only after a doubled wait."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from concurrent.futures import Future

import pytest
import redis

from contract import naming
from contract.stores.inflight import InflightStore, claim_wait_ms
from emulators.stack import local_catalog
from model_worker.serving.watchdog import Watchdog


@pytest.fixture
def store():
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make system-deps)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    client = redis.Redis(port=port, socket_timeout=5)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield InflightStore(client)
    finally:
        server.terminate()
        server.wait(10)


class RecordingPublisher:
    def __init__(self) -> None:
        self.published: list[str] = []

    def publish(self, topic: str, data: bytes, **attributes) -> Future:
        self.published.append(attributes["request_id"])
        done: Future = Future()
        done.set_result("1")
        return done


class Counters:
    class _Counter:
        def labels(self, **_labels):
            return self

        def inc(self) -> None:
            pass

    watchdog = _Counter()


def keep(store: InflightStore, request_id: str, untaken_for_ms: int = 0) -> None:
    deadline_ms = int(time.time() * 1000) + 900_000
    attributes = {"request_id": request_id, "model": "sleep", "deadline_ms": str(deadline_ms)}
    store.keep(request_id, "projects/p/topics/t", b"{}", attributes, deadline_ms, unclaimed_after_ms=untaken_for_ms)


def test_a_request_no_worker_took_is_published_again_and_a_taken_or_answered_one_is_not(store):
    publisher = RecordingPublisher()
    watchdog = Watchdog(store, None, publisher, None, local_catalog(), "worker-1", 3.0, Counters())
    for request_id in ("lost", "taken", "answered", "not-due"):
        keep(store, request_id, untaken_for_ms=60_000 if request_id == "not-due" else 0)
    assert store.take("taken", "worker-2", 3.0) is None
    assert store.take("answered", "worker-2", 3.0) is None
    store.let_go(["answered"], "worker-2", answered=True)

    assert watchdog.sweep() == (1, 0)
    assert publisher.published == ["lost"]
    # Untaken again: due after twice the first wait (a request waiting in a backlog is copied rarely).
    due_ms = store._redis.zscore(naming.INFLIGHT_UNCLAIMED_KEY, "lost")
    assert due_ms - time.time() * 1000 > 1.5 * claim_wait_ms(local_catalog().get("sleep").ack_deadline_seconds)
    assert watchdog.sweep() == (0, 0) and publisher.published == ["lost"]
    # Taken at last: no longer watched.
    assert store.take("lost", "worker-3", 3.0) is None
    assert store._redis.zscore(naming.INFLIGHT_UNCLAIMED_KEY, "lost") is None
