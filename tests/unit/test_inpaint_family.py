"""SD 1.5 inpainting against its reference, diffusers' `StableDiffusionInpaintPipeline` over a 9-channel UNet.

A request's images made by the worker, in both schedulings, equal what the pipeline returns for the same prompt,
seed, image, mask and parameters; in a running set, inpaint requests with other images, masks, step counts and
guidance share every model call, and each equals the pipeline alone. And the oracle can tell: a worker that gives
every row the first image's mask misses it by far.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_step_scheduler import Hooked, Worker, request

SPEC = local_catalog(test_fixtures=True).get("sd15-inpaint")
# Within 1/255 of the pipeline's own pixels (measured here: under 0.001/255, alone and in a running set); tighter
# than the other families' oracles (tests/unit/test_model_families.py), which allow float rounding of 3/255.
PIXEL_TOLERANCE = 1
SIZE = 32


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    return tiny_pipelines(tmp_path_factory.mktemp("inpaint"), {"sd15-inpaint": SPEC})


def input_image(seed: int, size: int = SIZE) -> Image.Image:
    """Smooth colours: corners from `seed`, blended."""
    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 255, (2, 2, 3)).astype(np.float64)
    ys, xs = np.mgrid[0:size, 0:size] / (size - 1)
    top = corners[0, 0] * (1 - xs[..., None]) + corners[0, 1] * xs[..., None]
    bottom = corners[1, 0] * (1 - xs[..., None]) + corners[1, 1] * xs[..., None]
    return Image.fromarray((top * (1 - ys[..., None]) + bottom * ys[..., None]).astype(np.uint8))


def box_mask(left: int, top: int, right: int, bottom: int, size: int = SIZE) -> Image.Image:
    """White (repaint) inside the box, black elsewhere."""
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[top:bottom, left:right] = 255
    return Image.fromarray(mask, mode="L")


def inpaint_request(request_id: str, steps: int, guidance: float, seed: int, mask: Image.Image, images: int = 1,
                    strength: float = 1.0):  # fmt: skip
    from dataclasses import replace

    pending = request(request_id, SPEC, steps=steps, guidance=guidance, seed=seed, images=images,
                      strength=strength, image=input_image(seed))  # fmt: skip
    pending.request.parameters.width = pending.request.parameters.height = SIZE
    pending.items = [replace(item, mask=mask) for item in pending.items]
    return pending


def runner_for(pipelines, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    spec = SPEC.model_copy(update={"scheduling": scheduling})
    return DiffusionRunner(spec, pipelines["sd15-inpaint"][0], torch_threads=1)


def reference_images(pipelines, pending) -> list:
    """The pipeline's own images: one call per image, its own generator."""
    import torch

    params = pending.request.parameters
    return [
        pipelines["sd15-inpaint"][1](
            prompt=item.prompt, image=item.image, mask_image=item.mask, num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale, strength=params.strength, width=params.width, height=params.height,
            generator=torch.Generator().manual_seed(item.seed), output_type="np",
        ).images[0]
        for item in pending.items
    ]  # fmt: skip


def difference(got: list, expected: list) -> float:
    assert len(got) == len(expected)
    return max(
        np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max() * 255
        for a, b in zip(got, expected, strict=True)
    )


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_an_inpaint_request_alone_equals_the_pipeline(pipelines, scheduling):
    runner = runner_for(pipelines, scheduling)
    pending = inpaint_request(f"alone-{scheduling}", steps=3, guidance=4.0, seed=5, mask=box_mask(8, 8, 24, 20),
                              images=2)  # fmt: skip
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    assert set(worker.outcomes.images) == {pending.request_id}, worker.outcomes.answered
    off = difference(worker.outcomes.images[pending.request_id], reference_images(pipelines, pending))
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {off:.1f}/255"


def test_a_partial_strength_starts_from_the_image_as_the_pipeline_does(pipelines):
    runner = runner_for(pipelines, "step")
    pending = inpaint_request("strength", steps=4, guidance=1.0, seed=8, mask=box_mask(0, 0, 16, 32), strength=0.5)
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    off = difference(worker.outcomes.images["strength"], reference_images(pipelines, pending))
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {off:.1f}/255"


def running_set() -> tuple:
    """A guided 4-step request, and from its second call on an unguided 2-step one (two images) with another
    image and another mask beside it: other timesteps, guidance and masks in every shared call."""
    first = inpaint_request("first", steps=4, guidance=5.0, seed=3, mask=box_mask(0, 0, 16, 16))
    joiner = inpaint_request("joiner", steps=2, guidance=1.0, seed=9, mask=box_mask(8, 16, 32, 32), images=2)
    return first, joiner


def serve_running_set(runner, first, joiner):
    hooked = Hooked(runner)
    with Worker({runner.spec.queue: hooked}) as worker:
        hooked.after[1] = lambda: worker.pool.add(joiner)
        worker.pool.add(first)
        worker.outcomes.wait(2)
    assert set(worker.outcomes.images) == {"first", "joiner"}, worker.outcomes.answered
    return hooked.sizes, worker.outcomes


def running_set_difference(pipelines, outcomes, first, joiner) -> float:
    return max(difference(outcomes.images[p.request_id], reference_images(pipelines, p)) for p in (first, joiner))


def test_inpaint_requests_with_other_masks_and_steps_share_calls_and_each_equals_the_pipeline(pipelines):
    runner = runner_for(pipelines, "step")
    first, joiner = running_set()
    sizes, outcomes = serve_running_set(runner, first, joiner)
    assert max(sizes) == 3, f"the joiner never shared a model call: {sizes}"
    assert outcomes.fields["first"]["batch_id"] == outcomes.fields["joiner"]["batch_id"]
    off = running_set_difference(pipelines, outcomes, first, joiner)
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own images by {off:.1f}/255"


def test_a_worker_giving_every_row_the_first_images_mask_fails_the_oracle(pipelines, monkeypatch):
    from model_worker.model.families.unet import SD15InpaintDenoiser

    conditioned = SD15InpaintDenoiser.conditioned_input
    firsts: list = []

    def first_mask(self, r, rows):
        if not firsts or firsts[0][0] is not self._current_call:
            firsts[:] = [(self._current_call, r)]
        first = firsts[0][1]
        swapped = type(r)(
            r.item,
            r.total,
            state={**r.state, "mask": first.state["mask"], "masked_image_latents": first.state["masked_image_latents"]},
        )
        return conditioned(self, swapped, rows)  # fmt: skip

    denoise = SD15InpaintDenoiser.denoise

    def marked(self, running):
        self._current_call = object()
        return denoise(self, running)

    monkeypatch.setattr(SD15InpaintDenoiser, "conditioned_input", first_mask)
    monkeypatch.setattr(SD15InpaintDenoiser, "denoise", marked)
    runner = runner_for(pipelines, "step")
    first, joiner = running_set()
    _, outcomes = serve_running_set(runner, first, joiner)
    off = running_set_difference(pipelines, outcomes, first, joiner)
    assert off > 3 * PIXEL_TOLERANCE, f"the oracle passed a worker that shares one mask: off by {off:.1f}/255"


def test_outpainting_equals_the_pipelines_inpainting_of_the_padded_image_with_the_apis_mask(pipelines):
    """The API's outpainting (api_server/predict/masks.py) pads the image and makes the mask; the worker then runs an
    ordinary inpaint request: its image equals diffusers' inpainting of that padded image with that mask."""
    import io
    from dataclasses import replace

    from api_server.predict.masks import Outpaint, outpainted

    source = io.BytesIO()
    input_image(4, size=16).save(source, format="PNG")
    padded_png, mask_png = outpainted(source.getvalue(), Outpaint(left=8, right=8, top=8, bottom=8))
    padded, mask = Image.open(io.BytesIO(padded_png)).convert("RGB"), Image.open(io.BytesIO(mask_png))
    assert padded.size == mask.size == (SIZE, SIZE)
    runner = runner_for(pipelines, "step")
    pending = inpaint_request("outpaint", steps=3, guidance=3.0, seed=4, mask=mask)
    pending.items = [replace(item, image=padded) for item in pending.items]
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    off = difference(worker.outcomes.images["outpaint"], reference_images(pipelines, pending))
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {off:.1f}/255"
