"""The step scheduler: requests join a running set between denoising steps, leave on their own, keep their images.

The worker's own device loop, pool and running set around the tiny random-weight pipeline (64x64, a few
steps), in one process; only the finisher and the lease keeper are recorders. Arrivals are placed at exact
steps by a hook on the runner, so nothing here depends on timing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from contract.messages import GenerationParameters, InferenceRequest, RequestInstance
from emulators.stack import local_catalog
from model_worker.held.pool import HeldMessage, PendingRequest, RequestPool
from model_worker.model.runners import GenerationItem, SyntheticRunner
from model_worker.serving.device import DeviceLoop
from model_worker.serving.health import WorkerHealth
from model_worker.serving.intake import ReplyFactory
from model_worker.serving.metrics import WorkerMetrics

CATALOG = local_catalog(test_fixtures=True)
TXT2IMG = CATALOG.get("sd15-txt2img").model_copy(update={"scheduling": "step"})
IMG2IMG = CATALOG.get("sd15-img2img").model_copy(update={"scheduling": "step"})
SLEEP_STEP = CATALOG.get("sleep").model_copy(update={"scheduling": "step", "name": "sleep"})
# Pixel values may move by one or two inside a different batch composition (float rounding), no more: the
# tolerance of the request-level batching tests.
PIXEL_TOLERANCE = 3


@pytest.fixture(scope="module")
def runners(tmp_path_factory) -> dict:
    import torch

    from emulators.tiny_pipeline import build_pipeline
    from model_worker.model.pipeline import DiffusionRunner

    torch.set_num_threads(1)
    root: Path = tmp_path_factory.mktemp("tiny")
    built = {}
    for spec in (TXT2IMG, IMG2IMG):
        directory = build_pipeline(root / spec.name, spec.pipeline)
        built[spec.name] = DiffusionRunner(spec, directory, torch_threads=1)
    return built


class Hooked:
    """A runner that records the images of each denoising call and runs `after[n]` once call n is done."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.sizes: list[int] = []
        self.after: dict[int, callable] = {}

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def denoise_step(self, running) -> None:
        self.runner.denoise_step(running)
        self.sizes.append(len(running))
        if hook := self.after.pop(len(self.sizes), None):
            hook()


class Outcomes:
    """The finisher and the lease keeper: records images and reply fields, answers and hand-backs."""

    def __init__(self) -> None:
        self.images: dict[str, list] = {}
        self.fields: dict[str, dict] = {}
        self.answered: dict[str, tuple[str, str | None, str | None]] = {}
        self.released: list[str] = []
        self.redis_trouble = SimpleNamespace(warn=lambda *args: None)
        self._changed = threading.Condition()

    def finish(self, pending, images, fields) -> None:
        with self._changed:
            self.images[pending.request_id], self.fields[pending.request_id] = images, fields
            self._changed.notify_all()

    def note_failure(self, request_id: str, cause: str) -> int:
        return 1

    def answer(self, message, reply, store: bool = True) -> None:
        with self._changed:
            self.answered[reply.request_id] = (reply.status, reply.error_kind, reply.error)
            self._changed.notify_all()

    def release(self, message) -> None:
        with self._changed:
            self.released.append(message.ack_id)
            self._changed.notify_all()

    def wait(self, count: int, timeout: float = 120) -> None:
        with self._changed:
            done = self._changed.wait_for(
                lambda: len(self.images) + len(self.answered) + len(self.released) >= count, timeout
            )
        assert done, f"only {self.images.keys() | self.answered.keys()} of {count} answered"


class Progress:
    """Records each request's (step, total): per step of a running set, per pipeline callback of a request-level
    batch."""

    def __init__(self) -> None:
        self.seen: dict[str, set[tuple[int, int]]] = {}
        self._batch: list = []

    def begin(self, batch, started=None) -> None:
        self._batch = list(batch)

    def update(self, step, total) -> None:
        for pending in self._batch:
            self.seen.setdefault(pending.request_id, set()).add((step, total))

    def end(self) -> None:
        self._batch = []

    def running(self, entries) -> None:
        for pending, step, total, _images in entries:
            self.seen.setdefault(pending.request_id, set()).add((step, total))


class Worker:
    """One device loop on its own thread over `runners`, fed through its pool."""

    def __init__(self, runners: dict, capacity: int = 8) -> None:
        self.pool = RequestPool(capacity)
        self.outcomes = Outcomes()
        self.progress = Progress()
        self.loop = DeviceLoop(
            runners, self.pool, self.outcomes, self.outcomes, ReplyFactory("w1", {}), self.progress,
            WorkerMetrics(), WorkerHealth(600),
        )  # fmt: skip
        self._thread = threading.Thread(target=self.loop.run, daemon=True)

    def __enter__(self) -> Worker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.loop.stopping.set()
        self.pool.close()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()


def request(
    request_id: str,
    spec,
    steps: int = 4,
    guidance: float = 7.5,
    seed: int = 1,
    images: int = 1,
    strength: float = 0.75,
    image=None,
    priority: str = "normal",
    deadline_in: float | None = 120,
) -> PendingRequest:
    params = GenerationParameters(
        seed=seed, num_inference_steps=steps, guidance_scale=guidance, width=64, height=64, strength=strength
    )
    body = InferenceRequest(
        request_id=request_id, model=spec.name, model_version="1",
        instances=[RequestInstance(prompt=f"{request_id} prompt") for _ in range(images)], parameters=params,
    )  # fmt: skip
    message = HeldMessage("sub", f"ack-{request_id}", {}, b"", 1, time.time())
    items = [GenerationItem(prompt=f"{request_id} prompt", seed=seed + i, image=image) for i in range(images)]
    deadline_ms = None if deadline_in is None else int((time.time() + deadline_in) * 1000)
    return PendingRequest(message, spec, body, items, priority, deadline_ms)


def solo(runner, pending: PendingRequest) -> list:
    """The request's images run alone at request level: one pipeline call of its own."""
    return runner.generate(pending.items, pending.request.parameters, lambda step, total: None)


def assert_same_images(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() * 255 <= PIXEL_TOLERANCE


def test_a_request_arriving_while_another_runs_joins_at_the_next_step_with_its_own_steps_and_guidance(runners):
    runner = Hooked(runners[TXT2IMG.name])
    first = request("first", TXT2IMG, steps=8, guidance=7.5, seed=3)
    joiner = request("joiner", TXT2IMG, steps=3, guidance=2.0, seed=9, images=2)
    with Worker({TXT2IMG.name: runner}) as worker:
        runner.after[2] = lambda: worker.pool.add(joiner)
        worker.pool.add(first)
        worker.outcomes.wait(2)
    # PNDM runs one call more than the steps asked for: 9 calls for the first, 4 for the joiner from call 3.
    assert runner.sizes == [1, 1, 3, 3, 3, 3, 1, 1, 1]
    fields = worker.outcomes.fields
    assert fields["first"]["batch_id"] == fields["joiner"]["batch_id"]
    assert fields["first"]["batch_size"] == fields["joiner"]["batch_size"] == 3
    assert (
        worker.outcomes.images["joiner"]
        and fields["joiner"]["worker_finished_ms"] <= fields["first"]["worker_finished_ms"]
    )
    assert_same_images(worker.outcomes.images["first"], solo(runner, first))
    assert_same_images(worker.outcomes.images["joiner"], solo(runner, joiner))
    # Progress is step i of the N asked for, whatever the scheduler's own count of calls.
    assert max(worker.progress.seen["first"]) == (8, 8) and max(worker.progress.seen["joiner"]) == (3, 3)
    assert {total for _, total in worker.progress.seen["first"]} == {8}


def test_an_image_to_image_request_joins_mid_run_at_its_own_start_timestep(runners):
    from PIL import Image

    runner = Hooked(runners[IMG2IMG.name])
    picture = Image.new("RGB", (64, 64), (200, 80, 40))
    first = request("first", IMG2IMG, steps=10, strength=0.8, image=picture, seed=2)
    joiner = request("joiner", IMG2IMG, steps=10, strength=0.4, image=picture, seed=5)
    with Worker({IMG2IMG.name: runner}) as worker:
        runner.after[1] = lambda: worker.pool.add(joiner)
        worker.pool.add(first)
        worker.outcomes.wait(2)
    # strength 0.8 of 10 steps: 8 steps (PNDM: 9 calls); strength 0.4: 4 steps, 5 calls, joining at call 2.
    assert runner.sizes == [1, 2, 2, 2, 2, 2, 1, 1, 1]
    assert_same_images(worker.outcomes.images["first"], solo(runner, first))
    assert_same_images(worker.outcomes.images["joiner"], solo(runner, joiner))


@pytest.mark.parametrize("how", ["cancelled", "expired"])
def test_an_abandoned_item_leaves_at_the_next_step_and_the_others_finish_unchanged(runners, how):
    runner = Hooked(runners[TXT2IMG.name])
    stays = request("stays", TXT2IMG, steps=6, seed=4)
    leaves = request("leaves", TXT2IMG, steps=6, seed=7)

    def abandon() -> None:
        if how == "cancelled":
            leaves.cancelled = True
        else:
            leaves.deadline_ms = int(time.time() * 1000) - 1

    worker = Worker({TXT2IMG.name: runner})
    runner.after[2] = abandon
    worker.pool.add(stays)
    worker.pool.add(leaves)
    with worker:
        worker.outcomes.wait(2)
    assert runner.sizes == [2, 2, 1, 1, 1, 1, 1]
    status, kind, error = worker.outcomes.answered["leaves"]
    assert status == kind == how and error.endswith("while it ran")
    assert_same_images(worker.outcomes.images["stays"], solo(runner, stays))


def test_a_poison_request_in_a_running_set_fails_alone():
    runner = Hooked(SyntheticRunner(SLEEP_STEP))
    good = [request(f"good-{i}", SLEEP_STEP, steps=5) for i in range(3)]
    poison = request("poison", SLEEP_STEP, steps=5)
    poison.items[0] = GenerationItem(prompt="!crash now", seed=1)
    with Worker({SLEEP_STEP.name: runner}) as worker:
        runner.after[1] = lambda: [worker.pool.add(p) for p in (poison, *good[1:])]
        worker.pool.add(good[0])
        worker.outcomes.wait(4)
    # The poison fails the shared call; stepped one by one, it fails alone and goes back for a retry.
    assert worker.outcomes.released == ["ack-poison"] and worker.outcomes.answered == {}
    assert set(worker.outcomes.images) == {"good-0", "good-1", "good-2"}
    assert runner.sizes[1:4] == [1, 1, 1] and max(runner.sizes) == 3  # split once, then shared again


def test_drain_finishes_the_running_set_and_lets_nobody_join(runners):
    runner = Hooked(runners[TXT2IMG.name])
    running = request("running", TXT2IMG, steps=5, seed=11)
    waiting = request("waiting", TXT2IMG, steps=2, seed=12)
    worker = Worker({TXT2IMG.name: runner})

    def sigterm() -> None:  # what the worker's SIGTERM handler does: stop; a request is held meanwhile
        worker.pool.add(waiting)
        worker.loop.stopping.set()

    runner.after[2] = sigterm
    worker.pool.add(running)
    thread = threading.Thread(target=worker.loop.run)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the device loop did not return after finishing its running set"
    assert runner.sizes == [1] * 6 and set(worker.outcomes.images) == {"running"}
    # What was held and never joined goes back to Pub/Sub (the service's drain hands it back).
    assert [p.request_id for p in worker.pool.close()] == ["waiting"]
    assert_same_images(worker.outcomes.images["running"], solo(runner, running))


def test_a_two_model_worker_steps_one_model_and_batches_the_other_by_request(runners):
    stepped = Hooked(runners[TXT2IMG.name])
    by_request = SyntheticRunner(CATALOG.get("sleep"), call_seconds=0.05)
    first = request("stepped-1", TXT2IMG, steps=4, seed=1)
    batched = [request(f"batched-{i}", CATALOG.get("sleep"), steps=2) for i in range(3)]
    later = request("stepped-2", TXT2IMG, steps=4, seed=2)
    with Worker({TXT2IMG.name: stepped, "sleep": by_request}) as worker:
        # The synthetic model's requests arrive mid-run: they wait for the running set to drain, then run
        # together in one call; the stepped request behind them is not let in ahead of them.
        stepped.after[1] = lambda: [worker.pool.add(p) for p in (*batched, later)]
        worker.pool.add(first)
        worker.outcomes.wait(5)
    fields = worker.outcomes.fields
    assert {fields[p.request_id]["batch_id"] for p in batched} == {fields["batched-0"]["batch_id"]}
    assert fields["batched-0"]["batch_size"] == 3
    assert fields["stepped-1"]["worker_finished_ms"] <= fields["batched-0"]["worker_started_ms"]
    assert fields["batched-0"]["worker_finished_ms"] <= fields["stepped-2"]["worker_started_ms"]
    assert stepped.sizes == [1] * 10
    assert_same_images(worker.outcomes.images["stepped-2"], solo(stepped, later))


def test_priority_decides_who_joins_a_full_running_set_first():
    pool = RequestPool(capacity=8)
    key = request("x", SLEEP_STEP).batch_key
    pool.add(request("normal-old", SLEEP_STEP, steps=2))
    pool.add(request("high-new", SLEEP_STEP, steps=9, priority="high"))
    pool.add(request("normal-new", SLEEP_STEP, steps=3))
    joiners, _ = pool.take_joiners(key, room=2)
    assert [p.request_id for p in joiners] == ["high-new", "normal-old"]
    pool.add(request("other-size", SLEEP_STEP.model_copy(update={"name": "noop"})))
    assert pool.take_joiners(key, room=0) == ([], [])
    joiners, _ = pool.take_joiners(key, room=8)
    assert [p.request_id for p in joiners] == ["normal-new"]


def test_a_lone_request_is_handed_to_the_device_at_once_without_waiting_for_a_batch_to_fill():
    """No batch window: `take_batch` returns the one ready request however long it may wait for more, and a
    device waiting on an empty pool is woken by an arrival, not by the end of its wait. Checked by order (each
    call returns while its batch is far from full and no second request exists), not by how long it took: the
    join's bound only ends a hang, and an hour's wait would outlast it."""
    sleep = CATALOG.get("sleep")  # request-scheduled, max_batch_size 8
    pool = RequestPool(capacity=8)
    taken: list[list[str]] = []

    def take() -> threading.Thread:
        thread = threading.Thread(
            target=lambda: taken.append([p.request_id for p in pool.take_batch(timeout=3600)[0]]), daemon=True
        )
        thread.start()
        return thread

    pool.add(request("held", sleep))
    waiting = take()
    waiting.join(timeout=60)
    assert not waiting.is_alive() and taken == [["held"]], "a lone held request waited for others to join it"
    waiting = take()  # an empty pool: the device waits for the next arrival
    pool.add(request("arriving", sleep))
    waiting.join(timeout=60)
    assert not waiting.is_alive() and taken[1:] == [["arriving"]], "an arrival did not wake the waiting device"


def test_a_pipeline_whose_scheduler_cannot_step_per_item_is_refused_at_load(runners):
    from model_worker.model.pipeline import DiffusionRunner

    # Allowed by the catalog with `request`; a step-scheduled model with such a scheduler never serves.
    heun = TXT2IMG.model_copy(update={"scheduling": "request", "scheduler": "HeunDiscreteScheduler"})
    directory = runners[TXT2IMG.name].weights_dir
    assert DiffusionRunner(heun, directory).spec.scheduler == "HeunDiscreteScheduler"
    with pytest.raises(ValueError, match="HeunDiscreteScheduler cannot"):
        DiffusionRunner(heun.model_copy(update={"scheduling": "step"}), directory)


def test_a_versioned_model_steps_on_its_own_version_runner(runners):
    # Runners are keyed by the unit's queue (`{model}--{version}`), never by the model's name alone.
    v2 = TXT2IMG.model_copy(update={"version": "2", "versioned": True})
    assert v2.queue != v2.name
    runner = Hooked(runners[TXT2IMG.name])
    pinned = request("pinned-v2", v2, steps=3, seed=5)
    with Worker({v2.queue: runner}) as worker:
        worker.pool.add(pinned)
        worker.outcomes.wait(1)
    assert set(worker.outcomes.images) == {"pinned-v2"} and worker.outcomes.fields["pinned-v2"]["model_version"] == "2"
    assert_same_images(worker.outcomes.images["pinned-v2"], solo(runner, pinned))


def test_an_error_escaping_the_device_loop_answers_its_requests_and_the_loop_goes_on(runners, monkeypatch):
    runner = runners[TXT2IMG.name]
    first, second = request("first", TXT2IMG, steps=3, seed=1), request("second", TXT2IMG, steps=3, seed=2)
    later = request("later", TXT2IMG, steps=3, seed=3)
    worker = Worker({TXT2IMG.name: runner})
    calls = {"n": 0}
    step = worker.loop.running.step

    def step_once_broken() -> None:  # a bug outside the runner's own failure handling, once
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("sd15-txt2img")
        step()

    monkeypatch.setattr(worker.loop.running, "step", step_once_broken)
    worker.pool.add(first)
    worker.pool.add(second)  # both held before the loop starts: they form one running set
    with worker:
        worker.outcomes.wait(2)
        worker.pool.add(later)  # the loop is still alive: the next request runs
        worker.outcomes.wait(3)
    answered = worker.outcomes.answered
    assert set(answered) == {"first", "second"}
    assert all(status == "error" and kind == "worker_error" and "KeyError" in error
               for status, kind, error in answered.values())  # fmt: skip
    assert set(worker.outcomes.images) == {"later"}


def test_rows_padded_to_a_compiled_bucket_leave_the_real_images_those_of_an_unpadded_run(runners, monkeypatch):
    """A compiled model runs static shapes: the running set's rows are padded to its bucket (copies of the last row,
    dropped after the call) so that CUDA graphs can be captured per bucket. The real images must not see them: a
    guided and an unguided request (three rows, other step counts) padded to eight rows give the unpadded run's
    images."""
    runner = runners[TXT2IMG.name]
    denoiser = runner._denoiser
    rows: list[int] = []
    call_model = denoiser.call_model

    def counted(sample, timestep, condition, **controls):  # a compiled model with ControlNets: zero residuals
        rows.append(sample.shape[0])
        return call_model(sample, timestep, condition, **controls)

    monkeypatch.setattr(denoiser, "call_model", counted)

    def run(buckets: list[int] | None) -> list:
        monkeypatch.setattr(denoiser, "_compiled_buckets", buckets)
        running = []
        for pending in (request("guided", TXT2IMG, steps=4, seed=5), request("plain", TXT2IMG, steps=3, guidance=1.0)):
            running += runner.start_items(pending.items, pending.request.parameters)
        images = []
        while unfinished := [r for r in running if not r.finished]:
            runner.denoise_step(unfinished)
            images += runner.decode([r for r in unfinished if r.finished])
        return images

    unpadded = run(None)
    assert rows == [3, 3, 3, 3, 2] and len(unpadded) == 2  # PNDM: one model call more than its steps
    rows.clear()
    padded = run([4])
    assert rows == [8] * 5
    for alone, beside in zip(unpadded, padded, strict=True):
        assert np.abs(alone - beside).max() <= 1e-5, np.abs(alone - beside).max()
