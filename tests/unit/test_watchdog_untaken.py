"""The watchdog's sweep for requests no worker took (issue 44), against a real Redis (the store is Lua scripts):
a kept request whose message was lost before any worker held it is published again; a taken or answered one is
not, and a request that stays untaken is copied again only after a doubled wait. Issue 55: a request only queued
behind live, busy workers is not copied at all."""

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
from contract.stores.pullers import PUBLISH_VISIBLE_MS, PullerStore, TopicPullers
from emulators.stack import local_catalog
from model_worker.serving.presence import PullerPresence
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


def due_ms(store: InflightStore, request_id: str) -> float | None:
    return store._redis.zscore(naming.INFLIGHT_UNCLAIMED_KEY, request_id)


def published_ms(store: InflightStore, request_id: str) -> int:
    return int(store._redis.hget(naming.inflight_key(request_id), "published_ms"))


TOPIC = "maas-requests-sleep"  # `keep`'s topic above, by its short name
LEASE_SECONDS = 3.0


def watchdog_with_pullers(store: InflightStore, publisher: RecordingPublisher) -> tuple[Watchdog, PullerStore]:
    pullers = PullerStore(store._redis)
    watchdog = Watchdog(
        store, None, publisher, None, local_catalog(), "worker-1", LEASE_SECONDS, Counters(), pullers=pullers
    )
    return watchdog, pullers


def keep_on_topic(store: InflightStore, request_id: str) -> int:
    """Keeps a request published on TOPIC, already due for a copy; returns when it was published (epoch ms)."""
    deadline_ms = int(time.time() * 1000) + 900_000
    attributes = {"request_id": request_id, "model": "sleep", "deadline_ms": str(deadline_ms)}
    store.keep(request_id, f"projects/p/topics/{TOPIC}", b"{}", attributes, deadline_ms, unclaimed_after_ms=0)
    return published_ms(store, request_id)


def test_a_request_queued_behind_busy_live_workers_is_not_copied_until_a_pull_finds_its_queue_empty(store):
    """Issue 55: under overload every worker is busy, so nobody pulls; the request waits in its queue, and a copy
    would only lengthen it. Once a live worker's pull finds the queue empty, the request was lost: copied."""
    publisher = RecordingPublisher()
    watchdog, pullers = watchdog_with_pullers(store, publisher)
    published = keep_on_topic(store, "queued")
    now_ms = int(time.time() * 1000)
    # Two live workers, each busy since before the publish: their last empty pulls began before it.
    pullers.beat("worker-a", [TOPIC], now_ms, {TOPIC: published - 5_000})
    pullers.beat("worker-b", [TOPIC], now_ms, {})

    assert watchdog.sweep() == (0, 0)
    assert publisher.published == []
    # Looked at again later (half the first wait), not dropped from the watch and not counted as a copy.
    assert due_ms(store, "queued") > time.time() * 1000
    assert store.unclaimed_republishes("queued") == 0

    store._redis.zadd(naming.INFLIGHT_UNCLAIMED_KEY, {"queued": 0})  # due again
    pullers.beat("worker-b", [TOPIC], int(time.time() * 1000), {TOPIC: published + 2_000})
    assert watchdog.sweep() == (1, 0)
    assert publisher.published == ["queued"]
    # The copy's own publish is what later pulls are measured from.
    assert published_ms(store, "queued") > published


def test_a_request_whose_puller_died_since_it_was_published_is_copied_and_an_older_death_does_not_count(store):
    """A worker that pulled the request and died before taking its holder lease left no trace on the request:
    a puller whose beats lapsed after the publish is that suspect, so the request is copied as before. A worker
    that died long before the publish, or left cleanly (it handed back what it held), could not have lost it."""
    publisher = RecordingPublisher()
    watchdog, pullers = watchdog_with_pullers(store, publisher)
    keep_on_topic(store, "orphaned")
    now_ms = int(time.time() * 1000)
    published = now_ms - 60_000  # a minute in its queue
    store._redis.hset(naming.inflight_key("orphaned"), "published_ms", published)
    pullers.beat("live", [TOPIC], now_ms, {})
    pullers.beat("dead-long-ago", [TOPIC], published - 600_000, {})
    pullers.beat("drained", [TOPIC], now_ms, {})
    pullers.leave("drained", [TOPIC])
    assert watchdog.sweep() == (0, 0) and publisher.published == []

    store._redis.zadd(naming.INFLIGHT_UNCLAIMED_KEY, {"orphaned": 0})
    pullers.beat("died-after-publish", [TOPIC], published + 500, {})  # silent since: lapsed long ago
    assert watchdog.sweep() == (1, 0)
    assert publisher.published == ["orphaned"]


def test_a_request_on_a_topic_nobody_pulls_is_copied_as_before(store):
    """No live puller to explain the wait (none started yet, or a fleet without these records): copied."""
    publisher = RecordingPublisher()
    watchdog, _ = watchdog_with_pullers(store, publisher)
    keep_on_topic(store, "nobody")
    assert watchdog.sweep() == (1, 0) and publisher.published == ["nobody"]


@pytest.mark.parametrize(
    ("beats", "empty_pulls", "queued"),
    [
        ({"a": 100_000}, {}, True),  # alive, never idle: busy
        ({"a": 100_000}, {"a": 60_000 + PUBLISH_VISIBLE_MS}, False),  # found the queue empty after the publish
        ({"a": 100_000}, {"a": 60_000 + PUBLISH_VISIBLE_MS - 1}, True),  # too soon to have seen the message
        ({"a": 100_000, "b": 90_000}, {}, False),  # b died after the publish
        ({"a": 100_000, "b": 60_000 - 3_000}, {}, False),  # b alive within a lapse of the publish: may have had it
        ({"a": 100_000, "b": 60_000 - 3_001}, {}, True),  # b dead before the publish
        ({"b": 90_000}, {}, False),  # nobody alive
        ({}, {}, False),
    ],
)
def test_what_explains_a_wait(beats, empty_pulls, queued):
    """A request published at 60 s, looked at at 100 s, holder lease 3 s."""
    pullers = TopicPullers(beats=beats, empty_pulls=empty_pulls)
    assert pullers.queued_behind_busy(published_ms=60_000, now_ms=100_000, lapse_ms=3_000) is queued


def test_a_worker_beats_for_its_topics_carries_its_empty_pulls_and_leaves_when_it_stops(store):
    """The worker's side (model_worker/serving/presence.py): what the watchdog reads above."""
    pullers = PullerStore(store._redis)
    presence = PullerPresence(pullers, "worker-a", [TOPIC, "maas-requests-sleep-high"], LEASE_SECONDS)
    presence.beat()
    seen = pullers.pullers(TOPIC)
    assert set(seen.beats) == {"worker-a"} and seen.empty_pulls == {}
    presence.pulled_empty(TOPIC, 1_000)
    presence.pulled_empty(TOPIC, 900)  # an earlier pull that ended later: the latest start stands
    presence.beat()
    assert pullers.pullers(TOPIC).empty_pulls == {"worker-a": 1_000}
    assert pullers.pullers("maas-requests-sleep-high").empty_pulls == {}
    presence.stop()  # never started: only leaves
    assert pullers.pullers(TOPIC) == TopicPullers(beats={}, empty_pulls={})
