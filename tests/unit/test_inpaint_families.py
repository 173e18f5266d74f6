"""SDXL inpainting and FLUX.1 Fill against their references, diffusers' `StableDiffusionXLInpaintPipeline` (over a
9-channel UNet) and `FluxFillPipeline`.

The same mask contract as SD 1.5's inpainting (tests/unit/test_inpaint_family.py): a request's images made by the
worker, in both schedulings, equal what the pipeline returns for the same prompt, seed, image, mask and parameters;
in a running set, inpaint requests with other images, masks, step counts and guidance share every model call, and
each equals the pipeline alone. And the oracle can tell: a worker that gives every row the first image's mask (and
masked image) misses it by far.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_inpaint_family import box_mask, difference, input_image
from tests.unit.test_step_scheduler import Hooked, Worker, request

CATALOG = local_catalog(test_fixtures=True)
PIXEL_TOLERANCE = 1  # within 1/255 of the pipeline's own pixels
SIZE = 32


@dataclass(frozen=True)
class Case:
    model: str
    guidance: float  # the first request's; the joiner's is `joiner_guidance`
    joiner_guidance: float

    @property
    def spec(self):
        return CATALOG.get(self.model)


CASES = {
    "sdxl-inpaint": Case("sdxl-inpaint", guidance=5.0, joiner_guidance=1.0),  # the joiner unguided
    "flux-fill": Case("flux-fill", guidance=30.0, joiner_guidance=10.0),
}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    return tiny_pipelines(tmp_path_factory.mktemp("inpaint"), {name: case.spec for name, case in CASES.items()})


def inpaint_request(case: Case, request_id: str, steps: int, guidance: float, seed: int, masks: list,
                    strength: float = 1.0):  # fmt: skip
    """One image per mask, each its own input image."""
    pending = request(request_id, case.spec, steps=steps, guidance=guidance, seed=seed, images=len(masks),
                      strength=strength)  # fmt: skip
    pending.request.parameters.width = pending.request.parameters.height = SIZE
    pending.items = [replace(item, image=input_image(seed + 10 * i), mask=mask)
                     for i, (item, mask) in enumerate(zip(pending.items, masks, strict=True))]  # fmt: skip
    return pending


def runner_for(pipelines, case: Case, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    spec = case.spec.model_copy(update={"scheduling": scheduling})
    return DiffusionRunner(spec, pipelines[case.model][0], torch_threads=1)


def reference_images(pipelines, case: Case, pending) -> list:
    """The pipeline's own images: one call per image, its own generator."""
    import torch

    params = pending.request.parameters
    return [
        pipelines[case.model][1](
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
@pytest.mark.parametrize("model", list(CASES))
def test_an_inpaint_request_alone_equals_the_pipeline(pipelines, model, scheduling):
    case = CASES[model]
    pending = inpaint_request(case, f"alone-{scheduling}", steps=3, guidance=case.guidance, seed=5,
                              masks=[box_mask(8, 8, 24, 20), box_mask(0, 16, 32, 32)])  # fmt: skip
    _, outcomes = serve(runner_for(pipelines, case, scheduling), pending)
    assert set(outcomes.images) == {pending.request_id}, outcomes.answered
    off = difference(outcomes.images[pending.request_id], reference_images(pipelines, case, pending))
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {off:.1f}/255"


def running_set(case: Case) -> tuple:
    """A 4-step request at strength 0.75 (3 steps of its schedule), and from its second call on a 2-step one of
    two other images and masks at another guidance: other timesteps, guidance and masks in every shared call."""
    first = inpaint_request(case, "first", steps=4, guidance=case.guidance, seed=3, masks=[box_mask(0, 0, 16, 16)],
                            strength=0.75)  # fmt: skip
    joiner = inpaint_request(case, "joiner", steps=2, guidance=case.joiner_guidance, seed=9,
                             masks=[box_mask(8, 16, 32, 32), box_mask(0, 0, 32, 8)])  # fmt: skip
    return first, joiner


def running_set_difference(pipelines, case: Case, outcomes, first, joiner) -> float:
    return max(difference(outcomes.images[p.request_id], reference_images(pipelines, case, p)) for p in (first, joiner))


@pytest.mark.parametrize("model", list(CASES))
def test_inpaint_requests_with_other_masks_and_steps_share_calls_and_each_equals_the_pipeline(pipelines, model):
    case = CASES[model]
    first, joiner = running_set(case)
    sizes, outcomes = serve(runner_for(pipelines, case, "step"), first, joiner=joiner)
    assert set(outcomes.images) == {"first", "joiner"}, outcomes.answered
    assert max(sizes) == 3, f"the joiner never shared a model call: {sizes}"
    assert outcomes.fields["first"]["batch_id"] == outcomes.fields["joiner"]["batch_id"]
    off = running_set_difference(pipelines, case, outcomes, first, joiner)
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own images by {off:.1f}/255"


def first_rows_mask(model: str, monkeypatch) -> None:
    """Breaks the worker on purpose: every row of a call gets the first row's mask (and masked image)."""
    from model_worker.model.families.flow import FluxFillDenoiser
    from model_worker.model.families.unet import SDXLInpaintDenoiser

    firsts: list = []

    def first(self, state: dict) -> dict:
        if not firsts or firsts[0][0] is not self._current_call:
            firsts[:] = [(self._current_call, state)]
        return firsts[0][1]

    if model == "flux-fill":
        denoiser, tokens = FluxFillDenoiser, FluxFillDenoiser.model_tokens

        def shared(self, r):
            return tokens(self, type(r)(r.item, r.total, state={**r.state, "fill": first(self, r.state)["fill"]}))

        monkeypatch.setattr(denoiser, "model_tokens", shared)
    else:
        denoiser, conditioned = SDXLInpaintDenoiser, SDXLInpaintDenoiser.conditioned_input

        def shared(self, r, rows):
            taken = first(self, r.state)
            state = {**r.state, "mask": taken["mask"], "masked_image_latents": taken["masked_image_latents"]}
            return conditioned(self, type(r)(r.item, r.total, state=state), rows)

        monkeypatch.setattr(denoiser, "conditioned_input", shared)
    denoise = denoiser.denoise

    def marked(self, running):
        self._current_call = object()
        return denoise(self, running)

    monkeypatch.setattr(denoiser, "denoise", marked)


@pytest.mark.parametrize("model", list(CASES))
def test_a_worker_giving_every_row_the_first_images_mask_fails_the_oracle(pipelines, model, monkeypatch):
    case = CASES[model]
    first_rows_mask(model, monkeypatch)
    first, joiner = running_set(case)
    _, outcomes = serve(runner_for(pipelines, case, "step"), first, joiner=joiner)
    off = running_set_difference(pipelines, case, outcomes, first, joiner)
    assert off > 3 * PIXEL_TOLERANCE, f"the oracle passed a worker that shares one mask: off by {off:.1f}/255"


def test_a_step_cached_fill_is_exact_at_threshold_zero_and_equals_diffusers_first_block_cache(pipelines):
    """Issue 54 on FLUX.1 Fill's rows (the masked image and mask packed beside the latents), both schedulings."""
    import numpy as np
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from contract.model_spec import ModelSpec
    from model_worker.model.pipeline import DiffusionRunner

    case = CASES["flux-fill"]

    def cached(threshold: float, scheduling: str = "step"):
        step_cache = {"kind": "first_block", "threshold": threshold}
        spec = ModelSpec.model_validate({**case.spec.model_dump(), "scheduling": scheduling, "step_cache": step_cache})
        return DiffusionRunner(spec, pipelines[case.model][0], torch_threads=1)

    def served(runner, request_id: str):
        pending = inpaint_request(case, request_id, steps=4, guidance=case.guidance, seed=5,
                                  masks=[box_mask(8, 8, 24, 20)])  # fmt: skip
        pending.spec = runner.spec  # the catalog entry the worker serves (its step cache, for the reply's count)
        _, outcomes = serve(runner, pending)
        return outcomes.images[request_id], outcomes.fields[request_id], pending

    never, fields, _ = served(cached(0.0), "never")
    plain, _, _ = served(runner_for(pipelines, case, "step"), "never")
    assert fields["steps_skipped"] == 0 and np.array_equal(np.asarray(never), np.asarray(plain))
    images, fields, pending = served(cached(0.5), "cached")
    assert fields["steps_skipped"] > 0
    reference = pipelines[case.model][1].transformer
    reference.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    _set_cache_context(reference, CacheContext("cond"))  # FluxFillPipeline names none; the hooks need one
    try:
        expected = reference_images(pipelines, case, pending)
    finally:
        reference.disable_cache()
    assert difference(images, expected) <= PIXEL_TOLERANCE
    assert difference(images, plain) > PIXEL_TOLERANCE  # the skips changed the image: the comparison means something
    called, fields, _ = served(cached(0.5, "request"), "cached")  # diffusers' hook, fresh per call
    assert fields["steps_skipped"] > 0 and difference(called, expected) == 0
