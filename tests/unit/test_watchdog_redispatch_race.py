"""The watchdog's re-dispatch against a worker taking the same request at that moment (issue 44).

The sweep reads a request as lapsed (no holder), then counts its re-dispatch and drops it from the held index. A
worker may take it in between: a redelivered copy, or a stalled holder's heartbeat. Dropping it from the index
then would leave a held request no sweep can find: if that worker dies before its next heartbeat re-adds it, and
the other copies were dropped as duplicates of its live hold, nobody answers it until the job's deadline. The
interleaving is forced here (the worker takes it inside the count), on a real Redis: the check runs in a script.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import redis

from contract.messages import Attr
from contract.stores.inflight import InflightStore
from contract.stores.results import ResultStore
from emulators.stack import local_catalog
from model_worker.serving.watchdog import Watchdog

REQUEST = "r-race"
LEASE_SECONDS = 0.3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.02)


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (the local stack needs it too)")
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    connection = redis.Redis(port=port, socket_timeout=5)
    try:
        wait_until(lambda: _pings(connection), "redis-server to answer")
        yield connection
    finally:
        connection.close()
        process.terminate()
        process.wait(timeout=10)


def _pings(connection: redis.Redis) -> bool:
    try:
        return bool(connection.ping())
    except redis.ConnectionError:
        return False


class TakenDuringTheSweep(InflightStore):
    """A worker takes the request after the sweep read it as lapsed and before the re-dispatch is counted."""

    def __init__(self, connection: redis.Redis) -> None:
        super().__init__(connection)
        self.interleave = True

    def count_redispatch(self, request_id: str) -> int | None:
        if self.interleave:
            self.interleave = False
            assert self.take(request_id, "worker-b-2", LEASE_SECONDS) is None
        return super().count_redispatch(request_id)


class Publisher:
    def __init__(self) -> None:
        self.copies: list[dict] = []

    def publish(self, topic: str, data: bytes, **attributes) -> Future:
        self.copies.append(attributes)
        done: Future = Future()
        done.set_result("id")
        return done


def lapsed_ids(store: InflightStore) -> list[str]:
    return [state.request_id for state in store.lapsed()]


def test_a_request_taken_while_the_watchdog_sweeps_it_stays_findable_when_its_new_holder_dies(client):
    store = TakenDuringTheSweep(client)
    catalog = local_catalog(test_fixtures=True)
    publisher = Publisher()
    metrics = SimpleNamespace(watchdog=SimpleNamespace(labels=lambda **_: SimpleNamespace(inc=lambda: None)))
    watchdog = Watchdog(store, ResultStore(client, 600), publisher, None, catalog, "w-dog", 6.0, metrics)  # type: ignore[arg-type]
    attributes = {
        Attr.REQUEST_ID: REQUEST,
        Attr.MODEL: "sleep",
        Attr.DEADLINE_MS: str(int(time.time() * 1000) + 600_000),
    }
    store.keep(REQUEST, "projects/p/topics/maas-requests-sleep", b"{}", attributes, int(attributes[Attr.DEADLINE_MS]))
    assert store.take(REQUEST, "worker-a-1", LEASE_SECONDS) is None
    wait_until(lambda: REQUEST in lapsed_ids(store), "worker-a-1's lease to lapse (it died)")

    # The sweep finds it lapsed, but worker-b-2 takes it first: no copy goes out, and it stays indexed under b.
    assert watchdog.sweep() == (0, 0)
    assert publisher.copies == []
    assert store.holders() == {REQUEST: "worker-b-2"}

    # worker-b-2 dies before any heartbeat: the next sweeps find the request and publish it again.
    wait_until(lambda: REQUEST in lapsed_ids(store), "worker-b-2's lease to lapse: the request must be found")
    assert watchdog.sweep() == (1, 0)
    assert [copy[Attr.REDISPATCHES] for copy in publisher.copies] == ["1"]
    assert REQUEST not in store.holders()  # dropped from the index until the new copy's taker takes it
