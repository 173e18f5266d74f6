"""Progress is on the client's scale: N requested steps show `total: N`, and the last step reported is N."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from contract.catalog import load_catalog
from contract.messages import GenerationParameters
from model_worker.model.pipeline import _step_callback
from model_worker.model.runners import GenerationItem, SyntheticRunner
from model_worker.serving.device import ProgressReporter

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


def requested_steps(pipeline: str, parameters: GenerationParameters) -> int:
    """The family's count for `pipeline`, over an instance of the diffusers class without weights."""
    import diffusers

    from model_worker.model.families import denoiser_class

    task = "image-to-image" if "Img2Img" in pipeline else "text-to-image"
    spec = load_catalog().get("flux-schnell" if "Flux" in pipeline else "sdxl-txt2img")
    spec = spec.model_copy(update={"pipeline": pipeline, "task": task})
    stand_in = object.__new__(getattr(diffusers, pipeline))
    return denoiser_class(spec)(spec, stand_in, "cpu").requested_steps(parameters)


@pytest.mark.parametrize(
    ("pipeline", "strength", "expected"),
    [
        ("StableDiffusionImg2ImgPipeline", 0.5, 12),  # int(25 x 0.5)
        ("StableDiffusionXLImg2ImgPipeline", 0.5, 12),
        ("FluxImg2ImgPipeline", 0.5, 13),  # 25 - int(25 - 12.5): FLUX runs the half step
        ("FluxImg2ImgPipeline", 0.3, 8),  # 25 - int(17.5)
        ("StableDiffusionImg2ImgPipeline", 1.0, 25),
        ("FluxImg2ImgPipeline", 1.0, 25),
        ("FluxPipeline", 0.5, 25),  # text-to-image: all of them
    ],
)
def test_image_to_image_counts_the_steps_its_pipeline_runs(pipeline, strength, expected):
    assert requested_steps(pipeline, params(25, strength=strength)) == expected


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
