"""SDXL inpainting against its reference, diffusers' `StableDiffusionXLInpaintPipeline` over a 9-channel UNet.

SD 1.5 inpainting's per-image rows (tests/unit/test_inpaint_family.py) with SDXL's conditioning: a request's images
made by the worker, in both schedulings, equal what the pipeline returns for the same prompt, seed, image, mask and
parameters; in a running set, inpaint requests with other images, masks, step counts and guidance share every UNet
call, and each equals the pipeline alone. And the oracle can tell: a worker that gives every row the first image's
mask misses it by far.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_inpaint_family import box_mask, difference, input_image
from tests.unit.test_step_scheduler import Hooked, Worker, request

SPEC = local_catalog(test_fixtures=True).get("sdxl-inpaint")
PIXEL_TOLERANCE = 1  # within 1/255 of the pipeline's own pixels
SIZE = 32


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    return tiny_pipelines(tmp_path_factory.mktemp("sdxl-inpaint"), {"sdxl-inpaint": SPEC})


def inpaint_request(request_id: str, steps: int, guidance: float, seed: int, masks: list, strength: float = 1.0):
    """One image per mask, each its own input image."""
    pending = request(request_id, SPEC, steps=steps, guidance=guidance, seed=seed, images=len(masks),
                      strength=strength)  # fmt: skip
    pending.request.parameters.width = pending.request.parameters.height = SIZE
    pending.items = [replace(item, image=input_image(seed + 10 * i), mask=mask)
                     for i, (item, mask) in enumerate(zip(pending.items, masks, strict=True))]  # fmt: skip
    return pending


def runner_for(pipelines, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    spec = SPEC.model_copy(update={"scheduling": scheduling})
    return DiffusionRunner(spec, pipelines["sdxl-inpaint"][0], torch_threads=1)


def reference_images(pipelines, pending) -> list:
    """The pipeline's own images: one call per image, its own generator."""
    import torch

    params = pending.request.parameters
    return [
        pipelines["sdxl-inpaint"][1](
            prompt=item.prompt, image=item.image, mask_image=item.mask, num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale, strength=params.strength, width=params.width, height=params.height,
            generator=torch.Generator().manual_seed(item.seed), output_type="np",
        ).images[0]
        for item in pending.items
    ]  # fmt: skip


def serve(runner, *pending, joiner=None):
    hooked = Hooked(runner)
    with Worker({runner.spec.queue: hooked}) as worker:
        if joiner is not None:
            hooked.after[1] = lambda: worker.pool.add(joiner)
        for each in pending:
            worker.pool.add(each)
        worker.outcomes.wait(len(pending) + (joiner is not None))
    return hooked.sizes, worker.outcomes


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_an_sdxl_inpaint_request_alone_equals_the_pipeline(pipelines, scheduling):
    pending = inpaint_request(f"alone-{scheduling}", steps=3, guidance=5.0, seed=5,
                           masks=[box_mask(8, 8, 24, 20), box_mask(0, 16, 32, 32)])  # fmt: skip
    _, outcomes = serve(runner_for(pipelines, scheduling), pending)
    assert set(outcomes.images) == {pending.request_id}, outcomes.answered
    off = difference(outcomes.images[pending.request_id], reference_images(pipelines, pending))
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {off:.1f}/255"


def running_set() -> tuple:
    """A 4-step request at strength 0.75 (3 steps of its schedule), and from its second call on a 2-step one of
    two other images and masks, unguided: other timesteps, guidance and masks in every shared call."""
    first = inpaint_request("first", steps=4, guidance=5.0, seed=3, masks=[box_mask(0, 0, 16, 16)], strength=0.75)
    joiner = inpaint_request(
        "joiner", steps=2, guidance=1.0, seed=9, masks=[box_mask(8, 16, 32, 32), box_mask(0, 0, 32, 8)]
    )
    return first, joiner


def running_set_difference(pipelines, outcomes, first, joiner) -> float:
    return max(difference(outcomes.images[p.request_id], reference_images(pipelines, p)) for p in (first, joiner))


def test_sdxl_inpaint_requests_with_other_masks_and_steps_share_calls_and_each_equals_the_pipeline(pipelines):
    first, joiner = running_set()
    sizes, outcomes = serve(runner_for(pipelines, "step"), first, joiner=joiner)
    assert set(outcomes.images) == {"first", "joiner"}, outcomes.answered
    assert max(sizes) == 3, f"the joiner never shared a UNet call: {sizes}"
    assert outcomes.fields["first"]["batch_id"] == outcomes.fields["joiner"]["batch_id"]
    off = running_set_difference(pipelines, outcomes, first, joiner)
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own images by {off:.1f}/255"


def test_a_worker_giving_every_row_the_first_images_mask_fails_the_oracle(pipelines, monkeypatch):
    from model_worker.model.families.unet import SDXLInpaintDenoiser

    conditioned = SDXLInpaintDenoiser.conditioned_input
    firsts: list = []

    def first_mask(self, r, rows):
        if not firsts or firsts[0][0] is not self._current_call:
            firsts[:] = [(self._current_call, r.state)]
        first = firsts[0][1]
        state = {**r.state, "mask": first["mask"], "masked_image_latents": first["masked_image_latents"]}
        return conditioned(self, type(r)(r.item, r.total, state=state), rows)

    denoise = SDXLInpaintDenoiser.denoise

    def marked(self, running):
        self._current_call = object()
        return denoise(self, running)

    monkeypatch.setattr(SDXLInpaintDenoiser, "conditioned_input", first_mask)
    monkeypatch.setattr(SDXLInpaintDenoiser, "denoise", marked)
    first, joiner = running_set()
    _, outcomes = serve(runner_for(pipelines, "step"), first, joiner=joiner)
    off = running_set_difference(pipelines, outcomes, first, joiner)
    assert off > 3 * PIXEL_TOLERANCE, f"the oracle passed a worker that shares one mask: off by {off:.1f}/255"
