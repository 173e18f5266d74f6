"""The admission ledger's backlog script against a real redis-server: what it counts as waiting ahead."""

from __future__ import annotations

import time

from api_server.predict.admission import AdmissionLedger
from contract import naming
from tests.unit import batch_harness

QUEUE = "sleep-admitted"
redis_server = batch_harness.redis_server  # one redis-server for the module


def _waiting(client, count: int, priority: str = "normal") -> None:
    """`count` requests kept with their published messages, none taken by a worker yet."""
    deadline_ms = int(time.time() * 1000) + 600_000
    for index in range(count):
        request_id = f"waiting-{priority}-{index}"
        client.zadd(naming.backlog_key(QUEUE, priority), {request_id: deadline_ms})
        client.hset(naming.inflight_key(request_id), mapping={"queue": QUEUE})


def test_a_backlog_longer_than_the_scan_counts_whole(redis_server):
    redis_server.flushall()
    _waiting(redis_server, 30)
    ledger = AdmissionLedger(redis_server, window_seconds=60, scan_limit=10)
    assert ledger.backlog(QUEUE, "normal").ahead == 30


def test_taken_and_finished_requests_within_the_scan_are_not_counted_as_waiting(redis_server):
    redis_server.flushall()
    _waiting(redis_server, 12)
    redis_server.set(naming.holder_key("waiting-normal-0"), "worker-a")  # running
    redis_server.delete(naming.inflight_key("waiting-normal-1"))  # answered: dropped from the backlog
    backlog = AdmissionLedger(redis_server, window_seconds=60, scan_limit=5).backlog(QUEUE, "normal")
    assert (backlog.ahead, backlog.held) == (10, 1)


def test_cancelled_requests_still_queued_are_neither_waiting_nor_answered_and_a_running_one_still_runs(redis_server):
    redis_server.flushall()
    _waiting(redis_server, 12)
    redis_server.set(naming.holder_key("waiting-normal-0"), "worker-a")
    for index in (0, 3, 4, 5):  # 0 is running: a cancel does not stop its call, it still holds the worker
        redis_server.set(naming.cancel_key(f"waiting-normal-{index}"), "1")
    ledger = AdmissionLedger(redis_server, window_seconds=60)
    backlog = ledger.backlog(QUEUE, "normal")
    assert (backlog.ahead, backlog.held, backlog.answered) == (8, 1, 0)
    # Dropped for good: once its worker answers it `cancelled`, it is not counted as an answer either.
    redis_server.delete(naming.inflight_key("waiting-normal-3"))
    redis_server.set(naming.result_key("waiting-normal-3"), "cancelled")
    assert ledger.backlog(QUEUE, "normal").answered == 0


def _kept_and_taken(client, request_id: str) -> None:
    """What the API and a worker record: the request kept with its message, then held by the worker."""
    client.zadd(naming.backlog_key(QUEUE, "normal"), {request_id: int(time.time() * 1000) + 600_000})
    client.hset(naming.inflight_key(request_id), mapping={"queue": QUEUE})
    client.set(naming.holder_key(request_id), "worker-a")


def test_a_sequential_clients_answered_requests_are_absent_from_the_backlog_at_once(redis_server):
    # Each request is judged (a reservation), kept, taken and answered before the next one is judged: no estimate
    # looks in between. Nothing is ever queued, so each must see nothing ahead and nothing held.
    redis_server.flushall()
    ledger = AdmissionLedger(redis_server, window_seconds=60)
    assert ledger.backlog(QUEUE, "normal", reserve="first").ahead == 0
    _kept_and_taken(redis_server, "first")
    # Answered: its result stored; its worker has not let go yet (its ack and lease end follow the reply).
    redis_server.set(naming.result_key("first"), "ok")
    backlog = ledger.backlog(QUEUE, "normal", reserve="second")
    assert (backlog.ahead, backlog.held, backlog.answered) == (0, 0, 1)
    _kept_and_taken(redis_server, "second")
    # Answered, and let go (its in-flight record ended) before the next estimate.
    redis_server.set(naming.result_key("second"), "ok")
    redis_server.delete(naming.inflight_key("second"), naming.holder_key("second"))
    backlog = ledger.backlog(QUEUE, "normal", reserve="third")
    assert (backlog.ahead, backlog.held, backlog.answered) == (0, 0, 2)


def test_the_ready_workers_are_the_capacity_before_any_request(redis_server):
    from contract.stores.ready_workers import ReadyWorkers

    redis_server.flushall()
    ReadyWorkers(redis_server, "worker-a", {QUEUE: 1, "other": 8}).announce()
    ReadyWorkers(redis_server, "worker-b", {QUEUE: 4}).announce()
    ReadyWorkers(redis_server, "worker-gone", {QUEUE: 16}).announce(seconds=0.001)
    time.sleep(0.01)  # worker-gone's word lapses (a worker that died stops renewing it)
    ledger = AdmissionLedger(redis_server, window_seconds=60)
    backlog = ledger.backlog(QUEUE, "normal", per_worker=1)
    assert (backlog.workers, backlog.capacity, backlog.held, backlog.answered) == (2, 5, 0, 0)
    ReadyWorkers(redis_server, "worker-b", {QUEUE: 4}).leave()  # draining: not counted from now on
    assert ledger.backlog(QUEUE, "normal").capacity == 1


def test_the_call_time_keeps_its_spread_and_the_answers_trip(redis_server):
    redis_server.flushall()
    ledger = AdmissionLedger(redis_server, window_seconds=60)
    ledger.ran(QUEUE, 2000, trip_ms=400)
    first = ledger.backlog(QUEUE, "normal")
    # One call says nothing of the spread yet: it is learnt from the next ones.
    assert (first.run_seconds, first.spread_seconds, first.trip_seconds) == (2.0, 0.0, 0.4)
    ledger.ran(QUEUE, 3000)  # a slow call widens the spread at once: a quarter of its distance from the mean
    assert ledger.backlog(QUEUE, "normal").spread_seconds == 0.25
    for _ in range(30):
        ledger.ran(QUEUE, 2000)
    settled = ledger.backlog(QUEUE, "normal")
    assert round(settled.run_seconds, 2) == 2.0 and settled.spread_seconds < 0.01 and settled.trip_seconds == 0.4


def test_a_worker_says_it_is_ready_while_its_probe_does_and_leaves_when_it_stops(redis_server):
    from contract.stores.ready_workers import ReadinessBeacon, ReadyWorkers

    redis_server.flushall()
    ledger = AdmissionLedger(redis_server, window_seconds=60)
    ready = [True]
    beacon = ReadinessBeacon(ReadyWorkers(redis_server, "worker-a", {QUEUE: 2}), lambda: ready[0])
    beacon.start()
    try:
        assert ledger.backlog(QUEUE, "normal").capacity == 2  # counted from its start, before any request
        ready[0] = False  # e.g. its weights failed a reload: /readyz says 503
        beacon.beat()
        assert ledger.backlog(QUEUE, "normal").workers == 0
        ready[0] = True
        beacon.beat()
        assert ledger.backlog(QUEUE, "normal").workers == 1
    finally:
        beacon.stop()
    assert ledger.backlog(QUEUE, "normal").workers == 0  # drained: gone at once, not when its word lapses
