"""Few-step distilled models: the scheduler settings they need, served in both schedulings as diffusers runs them.

LCM-LoRA (LCMScheduler, guidance 1 to 2, 4 to 8 steps) and SDXL-Lightning or Hyper-SD (a scheduler with
`timestep_spacing: trailing`, guidance 0) on the tiny SD 1.5 pipeline (its UNet's timestep made to matter,
`family_references.UNET_SHARPENING`): a running set (a 4-step request, then a 2-step one of two images joining
at its second call, with other guidance) through the worker's step scheduler, and each request alone in
`scheduling: request`, equal the diffusers pipeline run with the same scheduler and config; and the settings
matter (the saved `leading` spacing gives other images). LCMScheduler keeps all its state on the instance and
draws its noise from the image's own generator, so it steps per item (catalog STEPPABLE_SCHEDULERS).
"""

from __future__ import annotations

import pytest

from contract.model_spec import SchedulerConfig
from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import PIXEL_TOLERANCE, SD15, differences, reference_images
from tests.unit.test_step_scheduler import Hooked, Worker, request

SIZE = 64
CASES = {
    "lcm": SD15.model_copy(update={
        "name": "sd15-lcm", "scheduler": "LCMScheduler",
        "scheduler_config": SchedulerConfig(original_inference_steps=50),
    }),
    "lightning": SD15.model_copy(update={
        "name": "sd15-lightning", "scheduler": "EulerDiscreteScheduler",
        "scheduler_config": SchedulerConfig(timestep_spacing="trailing"),
    }),
}  # fmt: skip
# (steps, guidance) of the running set's first request and of the joiner: unguided and guided images side by side.
GUIDANCE = {"lcm": ((4, 1.0), (2, 1.5)), "lightning": ((4, 0.0), (2, 1.0))}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """The tiny SD 1.5 pipeline and, per case, diffusers' pipeline with the case's scheduler and config."""
    import diffusers

    [(directory, base)] = tiny_pipelines(tmp_path_factory.mktemp("few-step"), {"sd15": SD15}).values()
    made = {}
    for name, spec in CASES.items():
        scheduler_class = getattr(diffusers, spec.scheduler)
        scheduler = scheduler_class.from_config(base.scheduler.config, **spec.scheduler_config.overrides())
        reference = diffusers.StableDiffusionPipeline(
            **{**base.components, "scheduler": scheduler}, requires_safety_checker=False
        )
        reference.set_progress_bar_config(disable=True)
        made[name] = (directory, reference)
    return made


def expected(pipelines, name: str, pending) -> list:
    return reference_images({"sd15": pipelines[name]}, "sd15", pending)


def requests(name: str, spec) -> tuple:
    (steps, guidance), (joiner_steps, joiner_guidance) = GUIDANCE[name]
    first = request("first", spec, steps=steps, guidance=guidance, seed=3)
    joiner = request("joiner", spec, steps=joiner_steps, guidance=joiner_guidance, seed=9, images=2)
    for pending in (first, joiner):
        pending.request.parameters.width = pending.request.parameters.height = SIZE
    return first, joiner


@pytest.mark.parametrize("name", list(CASES))
def test_a_few_step_model_equals_its_pipeline_in_both_schedulings(pipelines, name):
    from model_worker.model.pipeline import DiffusionRunner

    directory = pipelines[name][0]
    step_runner = DiffusionRunner(CASES[name].model_copy(update={"scheduling": "step"}), directory, torch_threads=1)
    scheduler = step_runner._pipeline.scheduler  # noqa: SLF001
    assert type(scheduler).__name__ == CASES[name].scheduler
    assert all(scheduler.config[key] == value for key, value in CASES[name].scheduler_config.overrides().items())
    first, joiner = requests(name, step_runner.spec)
    hooked = Hooked(step_runner)
    with Worker({step_runner.spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(joiner)
        worker.pool.add(first)
        worker.outcomes.wait(2)
    assert set(worker.outcomes.images) == {"first", "joiner"}, worker.outcomes.answered
    assert max(hooked.sizes) == 3, f"the joiner never shared a model call: {hooked.sizes}"
    for pending in (first, joiner):
        difference = differences(worker.outcomes.images[pending.request_id], expected(pipelines, name, pending))
        assert difference <= PIXEL_TOLERANCE, f"step: {pending.request_id} differs by {difference:.1f}/255"

    request_runner = DiffusionRunner(
        CASES[name].model_copy(update={"scheduling": "request"}), directory, torch_threads=1
    )
    for pending in requests(name, request_runner.spec):
        with Worker({request_runner.spec.queue: request_runner}) as worker:
            worker.pool.add(pending)
            worker.outcomes.wait(1)
        difference = differences(worker.outcomes.images[pending.request_id], expected(pipelines, name, pending))
        assert difference <= PIXEL_TOLERANCE, f"request: {pending.request_id} differs by {difference:.1f}/255"


def test_the_trailing_spacing_is_what_makes_the_images(pipelines):
    """Without the override (the saved `leading` spacing) the same requests give other images: the oracle sees it."""
    from model_worker.model.pipeline import DiffusionRunner

    spec = CASES["lightning"].model_copy(update={"scheduler_config": SchedulerConfig(), "scheduling": "request"})
    runner = DiffusionRunner(spec, pipelines["lightning"][0], torch_threads=1)
    first, _ = requests("lightning", spec)
    with Worker({spec.queue: runner}) as worker:
        worker.pool.add(first)
        worker.outcomes.wait(1)
    assert differences(worker.outcomes.images["first"], expected(pipelines, "lightning", first)) > 3 * PIXEL_TOLERANCE


def test_the_catalog_takes_few_step_settings_and_refuses_lcm_settings_elsewhere():
    from pydantic import ValidationError

    served = local_catalog().get("sd15-lcm")
    assert served is not None, "the local stack serves a few-step example"
    assert served.scheduler == "LCMScheduler" and served.scheduling == "step"
    assert served.defaults.guidance_scale <= 1.0 and served.defaults.num_inference_steps <= 8
    entry = {**SD15.model_dump(), "scheduler_config": {"timestep_spacing": "trailing"}, "defaults": {
        **SD15.defaults.model_dump(), "guidance_scale": 0.0}}  # fmt: skip
    assert type(SD15).model_validate(entry).scheduler_config.timestep_spacing == "trailing"
    with pytest.raises(ValidationError, match="original_inference_steps is LCMScheduler's"):
        type(SD15).model_validate({**entry, "scheduler_config": {"original_inference_steps": 50}})
    with pytest.raises(ValidationError, match="timestep_spacing"):
        type(SD15).model_validate({**entry, "scheduler_config": {"timestep_spacing": "sideways"}})
