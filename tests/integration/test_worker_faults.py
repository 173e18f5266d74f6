"""The worker's fault paths against the real processes: kills, outages, poison, abandonment and drains."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from contract import naming
from contract.messages import Progress
from emulators.processes import ProcessRegistry, redis_ok
from emulators.stack import start_redis
from tests.conftest import open_hold, wait_for

pytestmark = pytest.mark.stack
SLEEP_TIMEOUT_SECONDS = 30  # the sleep model's request timeout in the local catalog
# The held long call's deadline: it must reach the worker within it (it expires unstarted otherwise).
LONG_DEADLINE_SECONDS = 15


def keep_sending(
    worker_client, seconds: float, concurrency: int = 8, until: threading.Event | None = None, **send
) -> list[str]:
    """Holds `concurrency` requests in flight for `seconds` (or, given `until`, until it is set), each waiting for
    its reply; returns every id sent."""
    sent: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def loop() -> None:
        while not until.is_set() if until is not None else time.monotonic() < stop_at:
            request_id = worker_client.send("sleep", "traffic", timeout=SLEEP_TIMEOUT_SECONDS, **send)
            with lock:
                sent.append(request_id)
            worker_client.wait([request_id], timeout=SLEEP_TIMEOUT_SECONDS + 10)

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(loop) for _ in range(concurrency)]:
            future.result()
    return sent


def assert_answered_in_time(worker_client, request_ids: list[str]) -> dict:
    replies = worker_client.wait(request_ids, timeout=SLEEP_TIMEOUT_SECONDS + 10)
    statuses = {reply.status for reply in replies.values()}
    assert statuses == {"ok"}, {r.request_id: (r.status, r.error) for r in replies.values() if r.status != "ok"}
    for request_id in request_ids:
        waited = worker_client.answered_at(request_id) - worker_client.published_at[request_id]
        assert waited < SLEEP_TIMEOUT_SECONDS, f"{request_id} answered after {waited:.1f}s"
    return replies


def test_worker_sigkilled_mid_batch_has_its_requests_answered_by_the_other(stack, worker_client, extra_worker):
    victim = extra_worker("synthetic")
    pid = ProcessRegistry(stack.stack_dir).pid(victim)
    stop = threading.Event()

    def kill_once_it_serves() -> None:
        # Killed once it has answered traffic, so it holds requests (a running batch, a pool) when it dies; not
        # after a fixed time, which a busy machine may spend before it pulls anything.
        deadline = time.monotonic() + 120
        try:
            while worker_client.answered_by(f"-{pid}") < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            after_kill = len(worker_client.replies) + 24  # traffic goes on until the survivor has answered more
            while len(worker_client.replies) < after_kill and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()

    killer = threading.Thread(target=kill_once_it_serves, daemon=True)
    killer.start()
    # More in flight than one worker holds (a running batch and a full pool: 16), so both have work when it dies.
    sent = keep_sending(worker_client, seconds=0, concurrency=24, until=stop)
    killer.join()
    replies = assert_answered_in_time(worker_client, sent)
    # The kill must have caught requests in the victim's hands: they came back on a later delivery attempt.
    assert any(reply.attempt >= 2 for reply in replies.values()), "the kill hit no request in flight"


def test_no_request_waits_in_one_workers_hands_while_another_idles(worker_client, extra_worker):
    extra_worker("synthetic")
    backlog = [worker_client.send("sleep", f"backlog {i}") for i in range(48)]
    replies = worker_client.wait(backlog, timeout=60)
    served = [reply.worker_id for reply in replies.values()]
    counts = sorted(served.count(worker) for worker in set(served))
    # Six full batches of eight between two workers: a worker holds at most a running batch and the next one
    # (16), so the other always finds work; the split depends on their speed, but both ran full batches.
    assert len(counts) == 2 and counts[0] >= 8, counts
    assert max(reply.batch_size for reply in replies.values()) <= 8


def test_redis_stopped_for_20s_under_traffic_dead_letters_nothing(stack, worker_client):
    registry = ProcessRegistry(stack.stack_dir)
    registry.stop("redis")
    try:
        sent = keep_sending(worker_client, seconds=20)
        restarting = time.time()
    finally:
        start_redis(stack, registry)
        registry.wait_until("redis", lambda: redis_ok(stack.redis_port), timeout=15)
    replies = assert_answered_in_time(worker_client, sent)
    for reply in replies.values():
        deadline_ms = (worker_client.published_at[reply.request_id] + SLEEP_TIMEOUT_SECONDS) * 1000
        assert reply.worker_started_ms < deadline_ms, "a request ran after its deadline"
    # Real traffic went through the outage, not a handful: every sender had requests answered, one after another,
    # before Redis came back (counted by order against the restart, not as a rate).
    answered_during = [r for r in sent if worker_client.answered_at(r) < restarting]
    assert len(answered_during) >= 3 * 8, f"{len(answered_during)} of {len(sent)} answered while Redis was down"


def test_poison_request_ends_on_the_dead_letter_topic_with_the_client_told(worker_client):
    poison = worker_client.send("sleep", "!crash every time", timeout=60)
    good = [worker_client.send("sleep", f"good {i}") for i in range(6)]
    replies = worker_client.wait([*good, poison], timeout=60)
    assert {replies[request_id].status for request_id in good} == {"ok"}
    assert replies[poison].status == "error" and replies[poison].error_kind == "dead_lettered"
    # The cause is the worker's own message for the last run.
    assert replies[poison].error == (
        "failed after 5 delivery attempts; the last: RuntimeError: synthetic pipeline crash (poison prompt)"
    )


def test_long_request_abandoned_at_its_deadline_frees_the_worker(stack, worker_client, settings):
    """A 50-step call held after its first step (a `!hold` prompt) until its deadline has passed: it is running
    when its deadline passes by order, however slowly a busy machine brought it to the worker, and it stops at
    its next step; the request sent behind it is answered."""
    gate = f"long-{uuid.uuid4().hex}"
    long = worker_client.send("sleep", f"!hold {gate}", steps=50, timeout=LONG_DEADLINE_SECONDS)
    progress = redis.Redis.from_url(settings.redis_url)
    try:
        wait_for(lambda: progress.exists(naming.progress_key(long)) or long in worker_client.replies, "the long call")
        assert long not in worker_client.replies, worker_client.replies[long][0].reply.error
        short = worker_client.send("sleep", "small", timeout=60)  # behind it: the call under way holds the device
        while time.time() <= worker_client.published_at[long] + LONG_DEADLINE_SECONDS:  # its deadline is before
            time.sleep(0.05)
    finally:
        open_hold(stack, gate)
    replies = worker_client.wait([long, short], timeout=60)
    assert replies[long].status == "expired" and "while it ran" in replies[long].error
    assert replies[short].status == "ok"  # within its own 60 s deadline, once the long call stopped
    # Freed by order, not by a clock: the long call stopped at a step before its last (its last step reached is
    # always written), so the device never spent the rest of it.
    last = Progress.model_validate_json(progress.get(naming.progress_key(long)))
    assert last.total == 50 and last.step < last.total, f"the abandoned call ran to step {last.step} of {last.total}"


def test_sigterm_drains_the_worker_and_loses_nothing(stack, worker_client, extra_worker):
    name = extra_worker("synthetic")
    registry = ProcessRegistry(stack.stack_dir)
    pid = registry.pid(name)
    backlog = [worker_client.send("sleep", f"drain {i}") for i in range(40)]
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)
    started = time.monotonic()
    while registry.is_running(name) and time.monotonic() - started < 25:
        time.sleep(0.1)
    assert not registry.is_running(name), "the worker did not exit within its drain time"
    replies = worker_client.wait(backlog, timeout=SLEEP_TIMEOUT_SECONDS)
    assert {reply.status for reply in replies.values()} == {"ok"}
    assert "drained in" in registry.log_path(name).read_text()


def test_worker_readiness_reports_a_missing_subscription(stack):
    index = list(stack.catalog().deployments()).index("synthetic")
    response = requests.get(f"http://127.0.0.1:{stack.worker_health_port(index)}/readyz", timeout=5)
    assert response.status_code == 200 and response.text == "ready"
