"""First-Block-Cache per image over SD 3.5 (model_worker/model/families/first_block.py): threshold 0 is exactly no
cache, one image alone equals diffusers' own First-Block-Cache hooks, an image's answer is the same alone and beside
images that skip, that do not, and that join, and a skipping image does not run the remaining blocks; a guided
image's two rows decide together; both schedulings."""

from __future__ import annotations

import numpy as np
import pytest

from contract.model_spec import ModelSpec
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import SD35, differences
from tests.unit.test_step_cache_rows import (
    ROUNDING,
    assert_never_skipping_is_no_cache,
    cached_spec,
    items,
    params,
    runner_maker,
    serve,
)

STEPS = 6
# The tiny random SD 3.5's first-block residual moves by 0.2-0.6 a step (relative L1): some steps skip at it
# and some do not, which is what the tests need (real weights move far less: docs/guides/step-caching.md).
THRESHOLD = 0.4
GUIDED = 7.0


def with_cache(**step_cache) -> ModelSpec:
    return cached_spec(SD35, kind="first_block", **step_cache)


CACHED, NEVER, PLAIN = with_cache(threshold=THRESHOLD), with_cache(threshold=0.0), SD35


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    """The tiny SD 3.5 with two joint blocks (the emulator's has one: no remaining blocks to skip)."""
    import diffusers
    import torch

    directory, _ = tiny_pipelines(tmp_path_factory.mktemp("sd3-cache"), {"sd35": PLAIN})["sd35"]
    config = dict(diffusers.SD3Transformer2DModel.load_config(directory / "transformer"), num_layers=2)
    torch.manual_seed(0)
    diffusers.SD3Transformer2DModel.from_config(config).save_pretrained(directory / "transformer")
    reference = diffusers.StableDiffusion3Pipeline.from_pretrained(directory)
    reference.set_progress_bar_config(disable=True)
    return directory, reference


@pytest.fixture(scope="module")
def runners(directory):
    return runner_maker(directory[0])


def guided(steps: int = STEPS, **given):
    return params(steps, guidance=GUIDED, **given)


def test_threshold_zero_gives_exactly_the_images_of_no_cache(runners):
    requests = {
        "guided": (items("a red cube", 3, 2), guided(), 0),
        "unguided": (items("a blue sphere", 9), params(3, guidance=1.0), 2),
    }
    assert_never_skipping_is_no_cache(runners(NEVER), runners(PLAIN), requests)
    request_never = runners(NEVER, "request").generate(items("a red cube", 3), guided(), lambda step, total: None)
    request_plain = runners(PLAIN, "request").generate(items("a red cube", 3), guided(), lambda step, total: None)
    assert np.array_equal(request_never[0], request_plain[0]) and runners(NEVER, "request").steps_skipped == 0


def diffusers_first_block_cache(directory, prompt: str, seed: int, threshold: float):
    """diffusers' pipeline with its First-Block-Cache hooks on the transformer (`apply_first_block_cache`: SD 3.5's
    transformer has no `enable_cache`), fresh for this one image; the shim for the last block's missing text stream
    as the worker's request scheduling has it (first_block.diffusers_first_block_sd3)."""
    import torch

    from model_worker.model.families.first_block import diffusers_first_block_sd3

    pipeline = directory[1]
    with diffusers_first_block_sd3(pipeline.transformer, threshold):
        return pipeline(
            prompt, num_inference_steps=STEPS, guidance_scale=GUIDED, width=64, height=64, output_type="np",
            generator=torch.Generator().manual_seed(seed), max_sequence_length=256,
        ).images[0]  # fmt: skip


def test_one_image_alone_equals_diffusers_first_block_cache_hooks(runners, directory):
    served = serve(runners(CACHED), {"alone": (items("a red cube", 3), guided(), 0)})["alone"]
    assert 0 < served[1][0] < STEPS - 1  # some steps skipped, some not: the decisions are what is compared
    expected = diffusers_first_block_cache(directory, "a red cube", 3, THRESHOLD)
    assert differences(served[0], [expected]) <= 1, "differs from diffusers' FirstBlockCache by more than 1/255"
    plain = serve(runners(PLAIN), {"alone": (items("a red cube", 3), guided(), 0)})["alone"]
    assert differences(served[0], plain[0]) > 1  # the skips changed the image: the comparison above means something
    request = runners(CACHED, "request")
    called = request.generate(items("a red cube", 3), guided(), lambda step, total: None)
    assert request.steps_skipped == served[1][0] and differences(called, [expected]) == 0


def test_an_image_is_the_same_alone_and_beside_images_that_skip_do_not_and_join(runners):
    runner = runners(CACHED)
    watched = {"watched": (items("a red cube", 3), guided(), 0)}
    alone = serve(runner, watched)["watched"]
    beside = serve(runner, {
        **watched,
        "skipping": (items("a green cone", 5, 2), guided(8), 0),  # other steps, its own decisions
        "full": (items("a blue sphere", 9), guided(step_cache=False), 1),  # no cache: never skips
        "joiner": (items("a yellow torus", 11), params(4, guidance=1.0), 3),  # unguided, joins mid-run
    })  # fmt: skip
    assert beside["watched"][1] == alone[1] and any(alone[1])
    assert beside["full"][1] == [0] and any(beside["skipping"][1])
    assert differences(beside["watched"][0], alone[0]) < ROUNDING
    joiner_alone = serve(runner, {"joiner": (items("a yellow torus", 11), params(4, guidance=1.0), 0)})["joiner"]
    assert beside["joiner"][1] == joiner_alone[1] and differences(beside["joiner"][0], joiner_alone[0]) < ROUNDING


def test_images_that_skip_do_not_run_the_remaining_blocks(runners):
    runner = runners(NEVER)
    runner._denoiser.forced_skips = lambda r, step: r.item.prompt == "skips" and step % 2 == 0
    try:
        before = (runner._denoiser.tail_calls.calls, runner._denoiser.tail_calls.rows)
        served = serve(runner, {"skips": (items("skips", 1), guided(), 0), "runs": (items("runs", 7), guided(), 0)})
        calls = runner._denoiser.tail_calls.calls - before[0], runner._denoiser.tail_calls.rows - before[1]
    finally:
        runner._denoiser.forced_skips = None
    # Steps 2 and 4 skip (step 0 is full: nothing cached yet), both rows of the guided image: the remaining blocks ran
    # 6 times over `runs`' two rows, 4 over `skips`' two, in one call a step.
    assert served["skips"][1] == [2] and served["runs"][1] == [0]
    assert calls == (STEPS, 2 * STEPS + 2 * (STEPS - 2))


def test_a_guided_images_two_rows_decide_together():
    import torch

    from model_worker.model.runners import GenerationItem, RunningItem
    from model_worker.model.step_cache import RowCache, first_block_skips

    last = RowCache(CACHED.step_cache, head_residual=torch.ones(2, 4, 8), tail_residual=torch.zeros(2, 4, 8))
    r = RunningItem(GenerationItem(prompt="a", seed=0), total=STEPS, requested=STEPS, state={"step_cache": last})
    r.done = 1
    moved = torch.ones(2, 4, 8)
    moved[0] *= 2  # the negative row moved by 1 (relative), the positive one not at all: 0.5 for the pair
    assert first_block_skips([r], torch.ones(2, 4, 8), rows_per_image=[2]) == [True]
    assert first_block_skips([r], moved, rows_per_image=[2]) == [False]  # over 0.4, though its positive row is still


def test_the_memory_plan_counts_both_rows_of_each_guided_image():
    import math

    from contract.memory_plan import unit_plan
    from contract.model_spec import architecture_of

    architecture, limits = architecture_of(CACHED), CACHED.limits
    width, height = limits.max_width - limits.max_width % 16, limits.max_height - limits.max_height % 16
    tokens = math.ceil(width * height / architecture.pixels_per_token)
    hidden = architecture.denoiser_elements_per_token // 20
    added = unit_plan(CACHED).activation_bytes - unit_plan(PLAIN).activation_bytes
    # two rows an image (guided), two residuals a row, bf16
    assert added == CACHED.max_batch_size * 2 * 2 * tokens * hidden * 2


def test_a_compiled_model_never_recompiles_as_the_count_of_full_rows_changes(directory, runners):
    """The cheap and the expensive part compiled for the batch buckets (as FLUX.1's), the full rows padded to one."""
    from model_worker.model import compiled
    from model_worker.model.pipeline import DiffusionRunner

    defaults = NEVER.defaults.model_copy(update={"width": 64, "height": 64, "guidance_scale": GUIDED})
    # No adapter slots (a compiled model's LoRA layers, traced too: seconds more, nothing the cache's parts change).
    spec = NEVER.model_copy(update={"defaults": defaults, "max_batch_size": 2, "max_instances_per_request": 2,
                                    "scheduling": "step", "adapters": None})  # fmt: skip
    runner = DiffusionRunner(spec, directory[0], torch_threads=1, compile_unet=True, compile_backend="eager")
    runner.warm_up()  # every batch bucket, its first step full: the remaining blocks at every bucket too
    graphs = compiled.graphs_compiled()
    _, head, tail, _ = runner._denoiser._cached_parts
    assert hasattr(head, "_orig_mod") and hasattr(tail, "_orig_mod"), "the cache's parts run eager"
    counts: list[int] = []
    forward = tail.forward
    tail.forward = lambda hidden, *args: counts.append(hidden.shape[0]) or forward(hidden, *args)

    def pattern(r, step):  # images skip at other steps: the count of full rows moves call by call
        return (step + r.item.seed) % 3 != 0

    requests = {"pair": (items("a red cube", 1, 2), guided(), 0)}
    for each in (runner, runners(NEVER)):
        each._denoiser.forced_skips = pattern
    try:
        got, eager = serve(runner, requests), serve(runners(NEVER), requests)
    finally:
        runners(NEVER)._denoiser.forced_skips = None
    assert compiled.graphs_compiled() == graphs, "a changing count of full rows compiled a new graph"
    assert set(counts) == {2, 4}  # one guided image's two rows or both images' four, each at its own bucket
    assert got["pair"][1] == eager["pair"][1] and any(got["pair"][1])
    assert differences(got["pair"][0], eager["pair"][0]) < ROUNDING
