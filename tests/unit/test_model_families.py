"""Every model family against its own reference, the diffusers pipeline: the worker's images equal the pipeline's.

For SD 1.5, SDXL, FLUX.1 [schnell] and FLUX.1 [dev] (tiny random-weight pipelines built from configuration,
as the local stack serves them), a request's images made by the worker's device loop, alone and in a running
set beside requests with other step counts and guidance, in both schedulings, equal what the pipeline itself
returns for the same prompt, seed and parameters, within the README's tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contract.catalog import load_catalog
from emulators.stack import LOCAL_CATALOG_OVERLAY
from tests.unit.test_step_scheduler import Hooked, Worker, request

CATALOG = load_catalog(None, str(LOCAL_CATALOG_OVERLAY))
SDXL = CATALOG.get("sdxl-txt2img")
SCHNELL = CATALOG.get("flux-schnell")
DEV = SCHNELL.model_copy(update={"name": "flux-dev", "guidance": "embedded"})
SD15 = CATALOG.get("sd15-txt2img")
FAMILIES = {"sd15": SD15, "sdxl": SDXL, "flux-schnell": SCHNELL, "flux-dev": DEV}
# Pixel values may move by one or two inside a different batch composition (float rounding), no more.
PIXEL_TOLERANCE = 3
SIZE = 64  # a multiple of 16, so every family takes it


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """Per family: the directory of its tiny pipeline and the diffusers pipeline loaded from it (the reference)."""
    import diffusers
    import torch

    from model_worker.tiny_pipeline import build_pipeline

    torch.set_num_threads(1)
    root: Path = tmp_path_factory.mktemp("families")
    built = {}
    for name, spec in FAMILIES.items():
        directory = build_pipeline(root / name, spec.pipeline, spec.guidance_mode)
        reference = getattr(diffusers, spec.pipeline).from_pretrained(directory)
        reference.set_progress_bar_config(disable=True)
        built[name] = (directory, reference)
    return built


def runner_for(pipelines, name: str, scheduling: str):
    from model_worker.pipeline import DiffusionRunner

    spec = FAMILIES[name].model_copy(update={"scheduling": scheduling})
    return spec, DiffusionRunner(spec, pipelines[name][0], torch_threads=1)


def reference_images(pipelines, name: str, pending) -> list:
    """The pipeline's own output for this request: one call per image, its own generator, as a client would."""
    import torch

    spec = FAMILIES[name]
    params = pending.request.parameters
    images = []
    for item in pending.items:
        kwargs = {
            "prompt": item.prompt, "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale, "width": params.width, "height": params.height,
            "generator": torch.Generator().manual_seed(item.seed), "output_type": "np",
        }  # fmt: skip
        if spec.family.name == "flux":
            kwargs["max_sequence_length"] = 512
        images.append(pipelines[name][1](**kwargs).images[0])
    return images


def assert_close(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        difference = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max() * 255
        assert difference <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {difference:.1f}/255"


def guidance_of(name: str, value: float) -> float:
    """A guidance scale the family takes: [schnell] takes none (the API refuses one), the others any."""
    return 0.0 if FAMILIES[name].guidance_mode == "none" else value


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_request_alone_equals_the_pipeline_in_both_schedulings(pipelines, name):
    for scheduling in ("step", "request"):
        spec, runner = runner_for(pipelines, name, scheduling)
        pending = request(f"alone-{scheduling}", spec, steps=4, guidance=guidance_of(name, 3.5), seed=7, images=2)
        pending.request.parameters.width = pending.request.parameters.height = SIZE
        with Worker({spec.queue: runner}) as worker:
            worker.pool.add(pending)
            worker.outcomes.wait(1)
        assert set(worker.outcomes.images) == {pending.request_id}, worker.outcomes.answered
        assert_close(worker.outcomes.images[pending.request_id], reference_images(pipelines, name, pending))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_requests_with_other_steps_and_guidance_share_steps_and_each_equals_the_pipeline(pipelines, name):
    spec, runner = runner_for(pipelines, name, "step")
    hooked = Hooked(runner)
    first = request("first", spec, steps=5, guidance=guidance_of(name, 6.0), seed=3)
    joiner = request("joiner", spec, steps=3, guidance=guidance_of(name, 1.0), seed=9, images=2)
    for pending in (first, joiner):
        pending.request.parameters.width = pending.request.parameters.height = SIZE
    with Worker({spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(joiner)
        worker.pool.add(first)
        worker.outcomes.wait(2)
    assert max(hooked.sizes) == 3, f"the joiner never shared a model call: {hooked.sizes}"
    assert worker.outcomes.fields["first"]["batch_id"] == worker.outcomes.fields["joiner"]["batch_id"]
    for pending in (first, joiner):
        assert_close(worker.outcomes.images[pending.request_id], reference_images(pipelines, name, pending))


def test_flux_requests_of_different_sizes_never_share_a_call_and_keep_their_own_shift(pipelines):
    spec, runner = runner_for(pipelines, "flux-schnell", "step")
    hooked = Hooked(runner)
    small = request("small", spec, steps=4, guidance=0.0, seed=1)
    large = request("large", spec, steps=4, guidance=0.0, seed=2)
    small.request.parameters.width = small.request.parameters.height = 32
    large.request.parameters.width = large.request.parameters.height = 128
    started = {}
    start_items = runner.start_items

    def recording_start(items, params):
        running = start_items(items, params)
        started[(params.width, params.height)] = running[0].state["mu"]
        return running

    runner.start_items = recording_start
    with Worker({spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(large)
        worker.pool.add(small)
        worker.outcomes.wait(2)
    assert max(hooked.sizes) == 1, f"images of two sizes shared a transformer call: {hooked.sizes}"
    assert started[(32, 32)] < started[(128, 128)], "the schedule shift must grow with the image's token count"
    assert worker.outcomes.fields["small"]["batch_id"] != worker.outcomes.fields["large"]["batch_id"]
    for pending in (small, large):
        assert_close(worker.outcomes.images[pending.request_id], reference_images(pipelines, "flux-schnell", pending))


def test_a_flux_catalog_entry_whose_guidance_contradicts_the_weights_is_refused_at_load(pipelines):
    from model_worker.pipeline import DiffusionRunner

    wrong = SCHNELL.model_copy(update={"guidance": "embedded"})
    with pytest.raises(ValueError, match="guidance 'embedded'.*'none'"):
        DiffusionRunner(wrong, pipelines["flux-schnell"][0], torch_threads=1)
