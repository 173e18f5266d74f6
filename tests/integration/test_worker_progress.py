"""Progress and cancellation through Redis: what the API's job status reads and writes."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from contract.stores.results import ResultStore

pytestmark = pytest.mark.stack
TXT2IMG = "sd15-txt2img"


@pytest.fixture
def results(settings) -> ResultStore:
    return ResultStore(redis.Redis.from_url(settings.redis_url), ttl_seconds=60)


def test_a_running_request_reports_its_denoising_steps(worker_client, results):
    request_id = worker_client.send(TXT2IMG, "slow enough to watch", width=256, height=256, steps=12, timeout=60)
    seen: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 60
    while request_id not in worker_client.replies and time.monotonic() < deadline:
        if (progress := results.get_progress(request_id)) is not None:
            seen.add((progress.step, progress.total))
        time.sleep(0.05)
    assert worker_client.wait([request_id], timeout=1)[request_id].status == "ok"
    assert seen, "no progress was recorded while the request ran"
    # The 12 steps asked for, though PNDM runs 13: the client's scale, not the scheduler's.
    assert {total for _, total in seen} == {12}, seen
    assert all(1 <= step <= 12 for step, _ in seen)
    # The last step is written even when the call ends between two progress ticks.
    while (last := results.get_progress(request_id)) is not None and last.step < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert last is not None and (last.step, last.total) == (12, 12)


def test_a_request_cancelled_before_pickup_never_runs(worker_client, results):
    request_id = uuid.uuid4().hex
    results.cancel(request_id)
    worker_client.send("sleep", "never", request_id=request_id)
    reply = worker_client.wait([request_id], timeout=30)[request_id]
    assert reply.status == "cancelled" and reply.inference_ms == 0 and reply.batch_id is None


def test_a_running_request_cancelled_stops_at_the_next_step(worker_client, results):
    request_id = worker_client.send(TXT2IMG, "cancel me", width=512, height=512, steps=50, timeout=60)
    deadline = time.monotonic() + 60
    while results.get_progress(request_id) is None and time.monotonic() < deadline:
        assert request_id not in worker_client.replies, "answered before it was seen running"
        time.sleep(0.05)
    assert results.get_progress(request_id) is not None, "it never started"
    results.cancel(request_id)
    reply = worker_client.wait([request_id], timeout=60)[request_id]
    assert reply.status == "cancelled" and "while it ran" in reply.error
    # Stopped at a step, not at the end of its call: checked by the step it reached (its last is always written),
    # not by how soon the answer came, which a busy machine decides.
    last = results.get_progress(request_id)
    assert last is not None and last.total == 50
    assert last.step < last.total, f"the cancelled call ran to step {last.step} of {last.total}"
