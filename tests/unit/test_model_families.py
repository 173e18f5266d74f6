"""Every model family against its own reference, the diffusers pipeline: the worker's images equal the pipeline's.

For SD 1.5, SDXL, FLUX.1 [schnell] and FLUX.1 [dev] (tiny random-weight pipelines built from configuration,
as the local stack serves them), a request's images made by the worker's device loop, alone and in a running
set beside requests with other step counts and guidance, in both schedulings, equal what the pipeline itself
returns for the same prompt, seed and parameters, within the README's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_step_scheduler import Hooked, Worker, request

CATALOG = local_catalog(test_fixtures=True)
SDXL = CATALOG.get("sdxl-txt2img")
SCHNELL = CATALOG.get("flux-schnell")
DEV = SCHNELL.model_copy(update={"name": "flux-dev", "guidance": "embedded"})
SD15 = CATALOG.get("sd15-txt2img")
SD35 = CATALOG.get("sd35-txt2img")
SD35_NO_T5 = SD35.model_copy(update={"name": "sd35-no-t5", "without": ["text_encoder_3"]})
SDXL_IMG2IMG = SDXL.model_copy(update={"name": "sdxl-img2img", "task": "image-to-image",
                                       "pipeline": "StableDiffusionXLImg2ImgPipeline"})  # fmt: skip
FLUX_IMG2IMG = DEV.model_copy(update={"name": "flux-img2img", "task": "image-to-image",
                                      "pipeline": "FluxImg2ImgPipeline"})  # fmt: skip
SD15_IMG2IMG = CATALOG.get("sd15-img2img")
FAMILIES = {
    "sd15": SD15, "sdxl": SDXL, "flux-schnell": SCHNELL, "flux-dev": DEV, "sd35": SD35, "sd35-no-t5": SD35_NO_T5,
    "sd15-img2img": SD15_IMG2IMG, "sdxl-img2img": SDXL_IMG2IMG, "flux-img2img": FLUX_IMG2IMG,
}  # fmt: skip
# Pixel values may move by one or two inside a different batch composition (float rounding), no more.
PIXEL_TOLERANCE = 3
SIZE = 64  # a multiple of 16, so every family takes it


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """Per family: the directory of its tiny pipeline and the diffusers pipeline loaded from it (the reference)."""
    return tiny_pipelines(tmp_path_factory.mktemp("families"), FAMILIES)


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
        if item.negative_prompt is not None:
            kwargs["negative_prompt"] = item.negative_prompt
        if spec.task == "image-to-image":
            kwargs["image"], kwargs["strength"] = item.image, params.strength
            if spec.family.name != "flux":  # the UNet img2img pipelines take the image's size
                del kwargs["width"], kwargs["height"]
        images.append(pipelines[name][1](**kwargs).images[0])
    return images


def assert_close(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        difference = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max() * 255
        assert difference <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {difference:.1f}/255"


def input_image(seed: int):
    """A small input image of smooth colors (an image-to-image request's `image`)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 255, (2, 2, 3)).astype(np.float64)
    ys, xs = np.mgrid[0:SIZE, 0:SIZE] / (SIZE - 1)
    top = corners[0, 0] * (1 - xs[..., None]) + corners[0, 1] * xs[..., None]
    bottom = corners[1, 0] * (1 - xs[..., None]) + corners[1, 1] * xs[..., None]
    return Image.fromarray((top * (1 - ys[..., None]) + bottom * ys[..., None]).astype(np.uint8))


def make_request(name: str, request_id: str, spec, **kwargs):
    """`request` with what the family needs: an input image and a strength for image-to-image."""
    if spec.task == "image-to-image":
        kwargs.setdefault("image", input_image(kwargs.get("seed", 1)))
        kwargs.setdefault("strength", 0.6)
    return request(request_id, spec, **kwargs)


def guidance_of(name: str, value: float) -> float:
    """A guidance scale the family takes: [schnell] takes none (the API refuses one), the others any."""
    return 0.0 if FAMILIES[name].guidance_mode == "none" else value


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_request_alone_equals_the_pipeline_in_both_schedulings(pipelines, name):
    for scheduling in ("step", "request"):
        spec, runner = runner_for(pipelines, name, scheduling)
        pending = make_request(name, f"alone-{scheduling}", spec, steps=4, guidance=guidance_of(name, 3.5), seed=7,
                               images=2)  # fmt: skip
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
    first = make_request(name, "first", spec, steps=5, guidance=guidance_of(name, 6.0), seed=3)
    joiner = make_request(name, "joiner", spec, steps=3, guidance=guidance_of(name, 1.0), seed=9, images=2)
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


@pytest.mark.parametrize("name", ["sd15", "sdxl", "sd35", "sd35-no-t5"])
def test_a_negative_prompt_shares_steps_with_a_request_without_one_and_both_equal_the_pipeline(pipelines, name):
    from dataclasses import replace

    spec, runner = runner_for(pipelines, name, "step")
    hooked = Hooked(runner)
    plain = make_request(name, "plain", spec, steps=4, guidance=5.0, seed=4)
    negative = make_request(name, "negative", spec, steps=4, guidance=5.0, seed=4)
    # The same prompt and seed: only the negative prompt differs.
    negative.items[0] = replace(plain.items[0], negative_prompt="fog and blur")
    with Worker({spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(negative)
        worker.pool.add(plain)
        worker.outcomes.wait(2)
    assert max(hooked.sizes) == 2
    images = worker.outcomes.images
    for pending in (plain, negative):
        assert_close(images[pending.request_id], reference_images(pipelines, name, pending))
    difference = np.abs(np.asarray(images["plain"][0]) - np.asarray(images["negative"][0])).max() * 255
    assert difference > PIXEL_TOLERANCE, "the negative prompt changed nothing"
