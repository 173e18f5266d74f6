"""The watchdog's re-dispatch never leaves a request out of the held index while nobody answers it (issue 44).

The sweep reads a request as lapsed (no holder), publishes it again and drops it from the held index. Two ways
that lost requests: a worker taking it in between (a redelivered copy, or a stalled holder's heartbeat) lost its
index entry while holding it, and a leader killed between dropping the entry and publishing left no copy at all.
Either way, once the copies still in the broker were dropped as duplicates of a live hold, no sweep would ever
find the request again: nobody answered it before the job's deadline. The interleavings are forced here, on a
real Redis (the check runs in a script).
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

from contract import naming
from contract.messages import Attr
from contract.stores.inflight import InflightStore
from contract.stores.results import ResultStore
from emulators.stack import local_catalog
from model_worker.serving.watchdog import Watchdog

REQUEST = "r-race"
# Leases that never run out during a test on their own: the test ends each one itself (`lapse`), by order, where a
# short lease could run out before a check that needs it live on a loaded machine.
LEASE_SECONDS = 600.0


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


class Killed(BaseException):
    """The watchdog's process dying mid-sweep (a SIGKILL): nothing after this point of the sweep runs."""


class Publisher:
    def __init__(self, dies: bool = False) -> None:
        self.copies: list[dict] = []
        self.dies = dies

    def publish(self, topic: str, data: bytes, **attributes) -> Future:
        if self.dies:
            self.dies = False
            raise Killed
        self.copies.append(attributes)
        done: Future = Future()
        done.set_result("id")
        return done


def lapse(client: redis.Redis, request_id: str) -> None:
    """What Redis's clock does to a holder that stopped its heartbeats: its lease ends now (index score, holder key)."""
    assert client.zadd(naming.INFLIGHT_HELD_KEY, {request_id: 1}, xx=True, ch=True) == 1
    client.delete(naming.holder_key(request_id))


def lapsed_ids(store: InflightStore) -> list[str]:
    return [state.request_id for state in store.lapsed()]


def watchdog_over(store: InflightStore, client: redis.Redis, publisher: Publisher) -> Watchdog:
    metrics = SimpleNamespace(watchdog=SimpleNamespace(labels=lambda **_: SimpleNamespace(inc=lambda: None)))
    catalog = local_catalog(test_fixtures=True)
    return Watchdog(store, ResultStore(client, 600), publisher, None, catalog, "w-dog", 6.0, metrics)  # type: ignore[arg-type]


def held_then_lapsed(store: InflightStore) -> None:
    """A request published by the API, taken by worker-a-1, whose lease then lapsed (it died)."""
    deadline_ms = int(time.time() * 1000) + 600_000
    attributes = {Attr.REQUEST_ID: REQUEST, Attr.MODEL: "sleep", Attr.DEADLINE_MS: str(deadline_ms)}
    store.keep(REQUEST, "projects/p/topics/maas-requests-sleep", b"{}", attributes, deadline_ms)
    assert store.take(REQUEST, "worker-a-1", LEASE_SECONDS) is None
    assert REQUEST not in lapsed_ids(store)
    lapse(store._redis, REQUEST)  # it died
    assert REQUEST in lapsed_ids(store)


def test_a_request_taken_while_the_watchdog_sweeps_it_stays_findable_when_its_new_holder_dies(client):
    store = TakenDuringTheSweep(client)
    publisher = Publisher()
    watchdog = watchdog_over(store, client, publisher)
    held_then_lapsed(store)

    # The sweep publishes a copy, but worker-b-2 took the request meanwhile: it stays indexed under b (the copy
    # is dropped as a duplicate of b's live hold).
    assert watchdog.sweep() == (1, 0)
    assert store.holders() == {REQUEST: "worker-b-2"}

    # worker-b-2 dies before any heartbeat: the next sweeps find the request and publish it again.
    lapse(client, REQUEST)
    assert REQUEST in lapsed_ids(store), "worker-b-2's lease lapsed: the request must be found"
    assert watchdog.sweep() == (1, 0)
    assert [copy[Attr.REDISPATCHES] for copy in publisher.copies] == ["1", "2"]
    assert REQUEST not in store.holders()  # out of the index until a worker takes the new copy


def test_a_watchdog_killed_before_its_copy_is_out_leaves_the_request_to_the_next_leader(client):
    store = InflightStore(client)
    held_then_lapsed(store)
    with pytest.raises(Killed):
        watchdog_over(store, client, Publisher(dies=True)).sweep()
    # The next leader finds it still lapsed, and publishes it.
    assert REQUEST in lapsed_ids(store)
    publisher = Publisher()
    assert watchdog_over(store, client, publisher).sweep() == (1, 0)
    assert [copy[Attr.REDISPATCHES] for copy in publisher.copies] == ["1"]
    assert lapsed_ids(store) == []


def test_a_lapsed_holders_request_is_published_again_only_once_its_open_pulls_have_ended(client):
    """A stalled holder may still have a pull open, and a copy published then goes to that pull, unread until its ack
    deadline: a lease that just ran out is left alone for a pull's wait (`LAPSE_GRACE_SECONDS`), then copied."""
    from model_worker.serving.watchdog import LAPSE_GRACE_SECONDS

    store = InflightStore(client)
    publisher = Publisher()
    watchdog = watchdog_over(store, client, publisher)
    held_then_lapsed(store)
    grace_ms = int(LAPSE_GRACE_SECONDS * 1000)
    client.zadd(naming.INFLIGHT_HELD_KEY, {REQUEST: store.now_ms() - grace_ms + 2_000}, xx=True)  # lapsed 3 s ago
    assert watchdog.sweep() == (0, 0) and publisher.copies == []
    client.zadd(naming.INFLIGHT_HELD_KEY, {REQUEST: store.now_ms() - grace_ms - 1}, xx=True)  # a pull's wait ago
    assert watchdog.sweep() == (1, 0) and len(publisher.copies) == 1
