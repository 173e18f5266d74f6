"""FLUX.1 Kontext edits against their reference, diffusers' `FluxKontextPipeline`.

A request's images made by the worker, in both schedulings, equal what the pipeline returns for the same instruction,
seed, input image and parameters (at the request's size, as the worker calls it: `max_area` its area, no auto-resize);
in a running set, edits of other images, instructions, guidance and step counts share every transformer call (each
row with its own image's tokens), and each equals the pipeline alone. And the oracle can tell: a worker that gives
every row the first image's tokens misses it by far.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_inpaint_family import difference, input_image
from tests.unit.test_step_scheduler import Hooked, Worker, request

SPEC = local_catalog(test_fixtures=True).get("flux-kontext")
PIXEL_TOLERANCE = 1  # within 1/255 of the pipeline's own pixels
SIZE = 32


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    return tiny_pipelines(tmp_path_factory.mktemp("edit"), {"flux-kontext": SPEC})


def edit_request(request_id: str, steps: int, guidance: float, seed: int, images: int = 1):
    """`images` edits, each of its own input image and instruction."""
    pending = request(request_id, SPEC, steps=steps, guidance=guidance, seed=seed, images=images, strength=None)
    pending.request.parameters.width = pending.request.parameters.height = SIZE
    pending.items = [
        replace(item, prompt=f"{request_id}: make it night {i}", image=input_image(seed + 10 * i))
        for i, item in enumerate(pending.items)
    ]
    return pending


def runner_for(pipelines, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    spec = SPEC.model_copy(update={"scheduling": scheduling})
    return DiffusionRunner(spec, pipelines["flux-kontext"][0], torch_threads=1)


def reference_images(pipelines, pending) -> list:
    """The pipeline's own images: one call per image, its own generator, at the request's size."""
    import torch

    params = pending.request.parameters
    return [
        pipelines["flux-kontext"][1](
            prompt=item.prompt, image=item.image, num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale, width=params.width, height=params.height,
            max_area=params.width * params.height, _auto_resize=False,
            generator=torch.Generator().manual_seed(item.seed), output_type="np",
        ).images[0]
        for item in pending.items
    ]  # fmt: skip


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_an_edit_alone_equals_the_pipeline(pipelines, scheduling):
    runner = runner_for(pipelines, scheduling)
    pending = edit_request(f"alone-{scheduling}", steps=3, guidance=2.5, seed=5, images=2)
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    assert set(worker.outcomes.images) == {pending.request_id}, worker.outcomes.answered
    got = worker.outcomes.images[pending.request_id]
    assert np.asarray(got[0]).shape == (SIZE, SIZE, 3)
    off = difference(got, reference_images(pipelines, pending))
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own image by {off:.1f}/255"


def running_set() -> tuple:
    """A 4-step edit, and from its second call on a 2-step one of two other images at another guidance: other
    timesteps, guidance, instructions and input images in every shared call."""
    return edit_request("first", steps=4, guidance=3.5, seed=3), edit_request("joiner", 2, 2.0, seed=9, images=2)


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


def test_edits_of_other_images_and_steps_share_calls_and_each_equals_the_pipeline(pipelines):
    runner = runner_for(pipelines, "step")
    first, joiner = running_set()
    sizes, outcomes = serve_running_set(runner, first, joiner)
    assert max(sizes) == 3, f"the joiner never shared a transformer call: {sizes}"
    assert outcomes.fields["first"]["batch_id"] == outcomes.fields["joiner"]["batch_id"]
    off = running_set_difference(pipelines, outcomes, first, joiner)
    assert off <= PIXEL_TOLERANCE, f"differs from the pipeline's own images by {off:.1f}/255"


def test_a_worker_giving_every_row_the_first_images_tokens_fails_the_oracle(pipelines, monkeypatch):
    from model_worker.model.families.flow import FluxKontextDenoiser

    tokens = FluxKontextDenoiser.model_tokens
    firsts: list = []

    def first_reference(self, r):
        if not firsts or firsts[0][0] is not self._current_call:
            firsts[:] = [(self._current_call, r.state["reference"])]
        return tokens(self, type(r)(r.item, r.total, state={**r.state, "reference": firsts[0][1]}))

    denoise = FluxKontextDenoiser.denoise

    def marked(self, running):
        self._current_call = object()
        return denoise(self, running)

    monkeypatch.setattr(FluxKontextDenoiser, "model_tokens", first_reference)
    monkeypatch.setattr(FluxKontextDenoiser, "denoise", marked)
    first, joiner = running_set()
    _, outcomes = serve_running_set(runner_for(pipelines, "step"), first, joiner)
    off = running_set_difference(pipelines, outcomes, first, joiner)
    assert off > 3 * PIXEL_TOLERANCE, f"the oracle passed a worker that shares one image's tokens: off by {off:.1f}/255"


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_the_edit_runner_warms_up_and_counts_every_step_whatever_the_strength(pipelines, scheduling):
    """The warm-up's parameters carry a strength (1.0) for any model: an edit model's progress counts every step
    (its image is a reference, not a start) instead of asking its pipeline for an img2img schedule it has not."""
    runner = runner_for(pipelines, scheduling)
    runner.warm_up()
    assert runner._denoiser.requested_steps(request("w", SPEC, steps=5, strength=0.5).request.parameters) == 5


def served_alone(runner, pending) -> tuple[list, dict]:
    pending.spec = runner.spec  # the catalog entry the worker serves (its step cache, for the reply's count)
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    return worker.outcomes.images[pending.request_id], worker.outcomes.fields[pending.request_id]


def test_a_step_cached_edit_is_exact_at_threshold_zero_and_equals_diffusers_first_block_cache(pipelines):
    """Issue 54 on Kontext's rows (the reference image's tokens in the sequence, so in the first block's residual)."""
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from contract.model_spec import ModelSpec
    from model_worker.model.pipeline import DiffusionRunner

    def cached(threshold: float, scheduling: str = "step"):
        step_cache = {"kind": "first_block", "threshold": threshold}
        spec = ModelSpec.model_validate({**SPEC.model_dump(), "scheduling": scheduling, "step_cache": step_cache})
        return DiffusionRunner(spec, pipelines["flux-kontext"][0], torch_threads=1)

    never = served_alone(cached(0.0), edit_request("never", 4, 2.5, 5))
    plain = served_alone(runner_for(pipelines, "step"), edit_request("never", 4, 2.5, 5))
    assert never[1]["steps_skipped"] == 0 and np.array_equal(np.asarray(never[0]), np.asarray(plain[0]))
    pending = edit_request("cached", 4, 2.5, 5)
    images, fields = served_alone(cached(0.5), pending)
    assert fields["steps_skipped"] > 0
    reference = pipelines["flux-kontext"][1].transformer
    reference.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    _set_cache_context(reference, CacheContext("cond"))  # FluxKontextPipeline names none; the hooks need one
    try:
        expected = reference_images(pipelines, pending)
    finally:
        reference.disable_cache()
    assert difference(images, expected) <= PIXEL_TOLERANCE
    called, fields = served_alone(cached(0.5, "request"), edit_request("cached", 4, 2.5, 5))  # the hook, per call
    assert fields["steps_skipped"] > 0 and difference(called, expected) == 0
    assert difference(images, plain[0]) > PIXEL_TOLERANCE  # the skips changed the edit: the comparison means something
