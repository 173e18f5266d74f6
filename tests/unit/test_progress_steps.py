"""Progress is on the client's scale: N requested steps show `total: N`, and the last step reported is N."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from contract.catalog import load_catalog
from contract.messages import GenerationParameters
from model_worker.device import ProgressReporter
from model_worker.pipeline import _step_callback, requested_steps
from model_worker.runners import GenerationItem, SyntheticRunner

SLEEP = load_catalog(overlay="contract/models.local.yaml").get("sleep")


def params(steps: int, strength: float | None = None) -> GenerationParameters:
    return GenerationParameters(
        seed=1, num_inference_steps=steps, guidance_scale=7.5, width=64, height=64, strength=strength
    )


def run_pipeline_steps(requested: int, actual: int) -> list[tuple[int, int]]:
    """What the worker hears from a pipeline whose scheduler runs `actual` steps for `requested` asked."""
    seen: list[tuple[int, int]] = []
    callback = _step_callback(lambda step, total: seen.append((step, total)), requested)
    pipeline = SimpleNamespace(num_timesteps=actual)
    for step in range(actual):
        callback(pipeline, step, None, {})
    return seen


@pytest.mark.parametrize(("requested", "actual"), [(25, 26), (40, 41), (12, 12), (1, 2), (4, 5)])
def test_a_scheduler_that_adds_steps_still_shows_the_requested_total(requested, actual):
    seen = run_pipeline_steps(requested, actual)
    assert {total for _, total in seen} == {requested}
    steps = [step for step, _ in seen]
    assert steps[0] == 1 and steps[-1] == requested
    assert steps == sorted(steps) and set(steps) == set(range(1, requested + 1))


def test_image_to_image_counts_the_steps_its_strength_runs():
    assert requested_steps(params(25, strength=0.5), image_to_image=True) == 12
    assert requested_steps(params(25, strength=1.0), image_to_image=True) == 25
    assert requested_steps(params(25), image_to_image=False) == 25


@pytest.mark.parametrize("call_seconds", [0.0, 0.05])
def test_the_synthetic_runners_report_the_requested_steps(call_seconds):
    seen: list[tuple[int, int]] = []
    runner = SyntheticRunner(SLEEP, call_seconds=call_seconds, ticks=10)
    runner.generate([GenerationItem("x", 1)], params(25), lambda step, total: seen.append((step, total)))
    assert seen[-1] == (25, 25) and {total for _, total in seen} == {25}


class RecordingResults:
    def __init__(self) -> None:
        self.written: list[tuple[int, int]] = []
        self.changed = threading.Condition()

    def put_progress(self, progress) -> None:
        with self.changed:
            self.written.extend((item.step, item.total) for item in progress)
            self.changed.notify_all()

    def cancelled(self, request_ids):
        return []


def test_the_last_step_of_a_batch_is_written_even_when_it_ends_between_ticks():
    results = RecordingResults()
    reporter = ProgressReporter(results, finisher=None)
    reporter.start()
    try:
        reporter.begin([SimpleNamespace(request_id="r", size=1)])
        for step in range(1, 26):
            reporter.update(step, 25)
        reporter.end()  # at once: no tick in between saw step 25
        with results.changed:
            assert results.changed.wait_for(lambda: (25, 25) in results.written, timeout=5), results.written
    finally:
        reporter.stop()
