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
