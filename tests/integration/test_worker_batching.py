"""The worker batches across requests without changing anyone's image, and keeps its hands empty of backlog."""

from __future__ import annotations

import base64
import io
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import redis
import requests

from contract import naming
from contract.stores.results import ResultStore
from tests.conftest import open_hold, wait_for

pytestmark = pytest.mark.stack
TXT2IMG = "sd15-txt2img"
# Pixel values may move by one or two inside a different batch composition (float rounding), no more.
PIXEL_TOLERANCE = 3


def pixels(reply, index: int = 0) -> np.ndarray:
    from PIL import Image

    data = base64.b64decode(reply.predictions[index].image.b64)
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


@contextmanager
def backlog(worker_client, settings, model: str, **blocker) -> Iterator[None]:
    """Requests sent inside wait, as a backlog, behind a long call of `model`'s worker that is cancelled (stopped at
    its next step) once they are all published: a backlog by order, not by publishing faster than the worker
    runs, which a busy machine may not do."""
    results = ResultStore(redis.Redis.from_url(settings.redis_url), ttl_seconds=60)
    blocking = worker_client.send(model, "blocker", timeout=600, **blocker)
    deadline = time.monotonic() + 120
    while results.get_progress(blocking) is None:  # running: the device is busy until it is cancelled
        assert time.monotonic() < deadline and blocking not in worker_client.replies, "the blocker never ran"
        time.sleep(0.05)
    try:
        yield
    finally:
        results.cancel(blocking)
    assert worker_client.wait([blocking], timeout=120)[blocking].status == "cancelled"


def test_concurrent_compatible_requests_share_pipeline_calls_and_keep_their_images(worker_client, settings):
    prompts = [f"a lighthouse number {i}" for i in range(6)]
    alone = {}
    for seed, prompt in enumerate(prompts):
        request_id = worker_client.send(TXT2IMG, prompt, seed=seed)
        alone[seed] = worker_client.wait([request_id], timeout=60)[request_id]
    with backlog(worker_client, settings, TXT2IMG, width=512, height=512, steps=500):  # another size: no joining
        together = {
            seed: worker_client.send(TXT2IMG, prompt, seed=seed, timeout=120) for seed, prompt in enumerate(prompts)
        }
    replies = worker_client.wait(list(together.values()), timeout=120)
    assert {reply.status for reply in replies.values()} == {"ok"}
    batches = {reply.batch_id for reply in replies.values()}
    assert len(batches) < len(prompts), "concurrent compatible requests were not batched"
    assert max(reply.batch_size for reply in replies.values()) > 1
    for seed, request_id in together.items():
        difference = np.abs(pixels(replies[request_id]) - pixels(alone[seed]))
        assert difference.max() <= PIXEL_TOLERANCE, f"seed {seed}: batched image differs from the lone one"
        assert replies[request_id].predictions[0].seed == seed


def test_incompatible_requests_are_not_batched_together(worker_client, settings):
    shapes = [(64, 2), (128, 2), (64, 3), (64, 2), (128, 2), (64, 3)] * 2
    with backlog(worker_client, settings, "sleep-steps", steps=3000):  # 0.1 s a step: up to 300 s, cancelled
        sent = {
            worker_client.send("sleep", "p", width=width, steps=steps, timeout=120): (width, steps)
            for width, steps in shapes
        }
    replies = worker_client.wait(list(sent), timeout=120)
    members = defaultdict(set)
    for request_id, reply in replies.items():
        assert reply.status == "ok"
        members[reply.batch_id].add(sent[request_id])
    assert all(len(shapes_in_batch) == 1 for shapes_in_batch in members.values()), members
    assert len(members) < len(sent), "nothing was batched"


def test_lone_request_starts_at_once_without_a_batch_window(worker_client):
    worker_client.wait([worker_client.send("noop", "wake up")], timeout=30)  # an idle worker, nothing queued
    request_id = worker_client.send("sleep", "alone")
    reply = worker_client.wait([request_id], timeout=30)[request_id]
    assert reply.status == "ok" and reply.batch_size == 1
    # That the pool hands a lone request over at once, waiting for no batch to fill, is checked by order in
    # tests/unit/test_batch_priority.py; how long the pull round trip takes is measured by the bench (`breakdown`).


def test_high_priority_is_taken_first_from_a_backlog(worker_client, settings):
    with backlog(worker_client, settings, "sleep-steps", steps=3000):
        normal = [worker_client.send("sleep", f"normal {i}", timeout=120) for i in range(32)]
        high = [worker_client.send("sleep", f"high {i}", priority="high", timeout=120) for i in range(4)]
    replies = worker_client.wait(normal + high, timeout=120)
    # Compared by batch, not by request timestamps: requests of one batch share a start (equal milliseconds), and
    # the sleep runner runs one batch at a time, so the batches' order is the order they ran in.
    batches = sorted(
        {reply.batch_id: reply.worker_started_ms for reply in replies.values()}.items(), key=lambda b: b[1]
    )
    position = {batch_id: index for index, (batch_id, _) in enumerate(batches)}
    normal_positions = sorted(position[replies[request_id].batch_id] for request_id in normal)
    # 32 normal requests are four full batches; the high ones, published last, run no later than the batch that
    # runs the middle normal one (the first or second a backlog of them reaches).
    assert max(position[replies[request_id].batch_id] for request_id in high) <= normal_positions[len(normal) // 2]


def test_one_worker_process_serves_two_models(worker_client):
    noop = [worker_client.send("noop", "n") for _ in range(3)]
    sleep = [worker_client.send("sleep", "s") for _ in range(3)]
    replies = worker_client.wait(noop + sleep, timeout=30)
    assert {reply.model for reply in replies.values()} == {"noop", "sleep"}
    assert {reply.status for reply in replies.values()} == {"ok"}
    served_noop = {replies[request_id].worker_id for request_id in noop}
    served_sleep = {replies[request_id].worker_id for request_id in sleep}
    assert served_noop & served_sleep, "the synthetic deployment's one process should serve both models"


@pytest.mark.parametrize("model", ["noop", "sleep"])
def test_synthetic_runners_answer_through_the_api(stack, auth_headers, model):
    response = requests.post(
        f"{stack.api_url}/v1/models/{model}:predict",
        json={"instances": [{"prompt": "a"}, {"prompt": "b"}], "parameters": {"seed": 5}},
        headers=auth_headers,
        timeout=30,
    )
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert [p["seed"] for p in predictions] == [5, 6]
    assert all(base64.b64decode(p["image_b64"]).startswith(b"\x89PNG") for p in predictions)


def test_worker_metrics_count_requests_and_batches(stack):
    index = list(stack.catalog().deployments()).index("synthetic")
    body = requests.get(f"http://127.0.0.1:{stack.worker_health_port(index)}/metrics", timeout=5).text
    assert 'maas_worker_requests_total{model="sleep",status="ok"}' in body
    assert 'maas_worker_batch_images_count{model="sleep"}' in body
    assert "maas_worker_device_idle_seconds_total" in body


def test_a_worker_with_a_batch_backlog_serves_an_interactive_request_first(stack, worker_client, settings):
    """Issue 35: batch lines run on what interactive traffic leaves; an interactive request overtakes their backlog."""
    # `sleep-calls`: request-level, 1 s calls of 10 steps; 24 lines are three full calls (8 lines each, issue 42). The
    # call with line 0 stops after its first step until the gate opens: the interactive request arrives during it.
    gate = f"backlog-{uuid.uuid4().hex}"
    prompts = [f"!hold {gate}", *(f"line {i}" for i in range(1, 24))]
    lines = [worker_client.send("sleep-calls", prompt, priority="batch", timeout=120) for prompt in prompts]
    client = redis.Redis.from_url(settings.redis_url)
    try:
        wait_for(lambda: client.exists(naming.progress_key(lines[0])), "the held batch call's first step")
        interactive = worker_client.send("sleep-calls", "interactive")
        wait_for(lambda: client.exists(naming.holder_key(interactive)), "the worker to take the interactive request")
    finally:
        open_hold(stack, gate)
    replies = worker_client.wait([*lines, interactive], timeout=120)
    assert {reply.status for reply in replies.values()} == {"ok"}
    for request_id in lines:  # run once: a redelivery may publish the stored reply again, never a second run
        runs = {(r.reply.batch_id, r.reply.worker_started_ms) for r in worker_client.replies[request_id]}
        assert len(runs) == 1, f"batch line {request_id} ran {len(runs)} times"
    reply = replies[interactive]
    # Pulled at once (held batch lines take no interactive room) and started at the batch call's next step, not
    # after the backlog: checked by order (most lines ran after it), not by how long it queued.
    assert reply.batch_size == 1, "an interactive request never shares a call with batch lines"
    later = [request_id for request_id in lines if replies[request_id].worker_started_ms >= reply.worker_finished_ms]
    assert len(later) >= 8, f"only {len(later)} of 24 batch lines were left to run after the interactive request"


def test_an_idle_worker_runs_batch_lines_in_full_running_sets_that_give_way_at_the_next_step(worker_client):
    """Issue 42: batch lines fill an idle worker's running set to `max_batch_size` (8), and an interactive request
    sent while they run is answered before them: it takes the device at the next step, never sharing one."""
    # Two running sets of 8 lines, 50 steps of 0.1 s each: the second runs for 5 s after the first is answered.
    lines = [worker_client.send("sleep-steps", f"line {i}", steps=50, priority="batch", timeout=120) for i in range(16)]
    first = worker_client.wait(lines[:1], timeout=90)[lines[0]]
    assert first.status == "ok"
    interactive = worker_client.send("sleep-steps", "interactive", steps=2, timeout=60)
    replies = worker_client.wait([*lines, interactive], timeout=120)
    assert {reply.status for reply in replies.values()} == {"ok"}
    assert max(replies[request_id].batch_size for request_id in lines) == 8, "batch lines ran below max_batch_size"
    reply = replies[interactive]
    assert reply.batch_size == 1, "an interactive request never shares a step with batch lines"
    # The lines running when it came were paused, not finished first: they end after it.
    paused = [
        r for r in lines if replies[r].worker_started_ms < reply.worker_started_ms < replies[r].worker_finished_ms
    ]
    assert paused, "no batch line was running when the interactive request started"
    assert all(replies[r].worker_finished_ms >= reply.worker_finished_ms for r in paused)
    for request_id in lines:  # each run once
        runs = {(r.reply.batch_id, r.reply.worker_started_ms) for r in worker_client.replies[request_id]}
        assert len(runs) == 1, f"batch line {request_id} ran {len(runs)} times"
