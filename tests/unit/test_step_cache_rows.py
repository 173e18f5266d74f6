"""Per-image step caches in a running set (model_worker/model/step_cache.py, families/first_block.py): threshold 0 is
exactly no cache, one image alone equals diffusers' own First-Block-Cache hook, an image's answer is the same alone
and beside images that skip, that do not, and that join, and a skipping image does not run the remaining blocks."""

from __future__ import annotations

import numpy as np
import pytest

from contract.messages import GenerationParameters
from contract.model_spec import ModelSpec
from model_worker.model.runners import GenerationItem
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import DEV, differences

STEPS = 6
# The tiny random FLUX.1 [dev]'s first-block residual moves by 0.2-0.4 (relative L1) a step: at 0.3 some of its steps
# skip and some do not, which is what the tests need (real weights move far less: docs/guides/step-caching.md).
THRESHOLD = 0.3
# Another batch composition moves float32 values by rounding only (DESIGN: "a few pixel values can move by 1"):
# of 255, far below one step.
ROUNDING = 0.05


def runner_maker(directory):
    """A runner of the tiny pipeline in `directory` per spec and scheduling, each made once (the step-cache modules'
    `runners` fixture)."""
    from model_worker.model.pipeline import DiffusionRunner

    made = {}

    def runner(spec: ModelSpec, scheduling: str = "step"):
        key = (spec.model_dump_json(), scheduling)
        if key not in made:
            made[key] = DiffusionRunner(spec.model_copy(update={"scheduling": scheduling}), directory, torch_threads=1)
        return made[key]

    return runner


def cached_spec(base: ModelSpec, **step_cache) -> ModelSpec:
    """`base` with the step cache `step_cache` (its kind and settings)."""
    return ModelSpec.model_validate({**base.model_dump(), "step_cache": step_cache})


def with_cache(**step_cache) -> ModelSpec:
    return cached_spec(DEV, kind="first_block", **step_cache)


CACHED, NEVER, PLAIN = with_cache(threshold=THRESHOLD), with_cache(threshold=0.0), DEV


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tiny_pipelines(tmp_path_factory.mktemp("step-cache"), {"flux-dev": PLAIN})["flux-dev"]


@pytest.fixture(scope="module")
def runners(directory):
    return runner_maker(directory[0])


def params(steps: int = STEPS, guidance: float = 3.5, step_cache: bool | None = None) -> GenerationParameters:
    return GenerationParameters(seed=0, num_inference_steps=steps, guidance_scale=guidance, width=64, height=64,
                                step_cache=step_cache)  # fmt: skip


def items(prompt: str, seed: int, count: int = 1) -> list[GenerationItem]:
    return [GenerationItem(prompt=prompt, seed=seed + i) for i in range(count)]


def serve(runner, requests: dict[str, tuple]) -> dict[str, tuple[list, list[int]]]:
    """Steps a running set as the step scheduler does: each request (its items, its parameters, the call it joins
    at) starts before that call and leaves, decoded, after its own last step. Per request: its images and the steps
    each image skipped."""
    running, results, call = {}, {}, 0
    while len(results) < len(requests):
        for name, (request_items, request_params, join) in requests.items():
            if join == call:
                running[name] = runner.start_items(request_items, request_params)
        runner.denoise_step([r for rs in running.values() for r in rs])
        call += 1
        for name, rs in list(running.items()):
            if all(r.finished for r in rs):
                skipped = [r.skipped for r in rs]
                results[name] = (runner.decode(rs), skipped)
                assert all(not r.state for r in rs)  # the image's cache state is freed with it
                del running[name]
    return results


def assert_never_skipping_is_no_cache(never, plain, requests: dict) -> None:
    """A cache set never to skip runs its cached path with every row in full, for every step, and gives exactly the
    uncached runner's images."""
    calls = never._denoiser.tail_calls.calls
    cached, uncached = serve(never, requests), serve(plain, requests)
    assert never._denoiser.tail_calls.calls - calls == STEPS  # the cached path ran, every row in full
    for name in requests:
        assert cached[name][1] == [0] * len(requests[name][0])
        assert all(np.array_equal(a, b) for a, b in zip(cached[name][0], uncached[name][0], strict=True)), name


def test_threshold_zero_gives_exactly_the_images_of_no_cache(runners):
    requests = {"first": (items("a red cube", 3, 2), params(), 0), "joiner": (items("a blue sphere", 9), params(3), 2)}
    assert_never_skipping_is_no_cache(runners(NEVER), runners(PLAIN), requests)


def diffusers_first_block_cache(directory, prompt: str, seed: int, threshold: float):
    """diffusers' own pipeline with its First-Block-Cache hook (`enable_cache`), fresh for this one image."""
    import torch
    from diffusers.hooks import FirstBlockCacheConfig

    pipeline = directory[1]
    pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        return pipeline(
            prompt, num_inference_steps=STEPS, guidance_scale=3.5, width=64, height=64, output_type="np",
            generator=torch.Generator().manual_seed(seed),
        ).images[0]  # fmt: skip
    finally:
        pipeline.transformer.disable_cache()


def test_one_image_alone_equals_diffusers_first_block_cache_hook(runners, directory):
    served = serve(runners(CACHED), {"alone": (items("a red cube", 3), params(), 0)})["alone"]
    assert 0 < served[1][0] < STEPS - 1  # some steps skipped, some not: the decisions are what is compared
    expected = diffusers_first_block_cache(directory, "a red cube", 3, THRESHOLD)
    assert differences(served[0], [expected]) <= 1, "differs from diffusers' FirstBlockCache by more than 1/255"
    plain = serve(runners(PLAIN), {"alone": (items("a red cube", 3), params(), 0)})["alone"]
    assert differences(served[0], plain[0]) > 1  # the skips changed the image: the comparison above means something


def test_an_image_is_the_same_alone_and_beside_images_that_skip_do_not_and_join(runners):
    runner = runners(CACHED)
    watched = {"watched": (items("a red cube", 3), params(), 0)}
    alone = serve(runner, watched)["watched"]
    beside = serve(runner, {
        **watched,
        "skipping": (items("a green cone", 5, 2), params(8), 0),  # other steps, its own decisions
        "full": (items("a blue sphere", 9), params(step_cache=False), 1),  # no cache: never skips
        "joiner": (items("a yellow torus", 11), params(4, guidance=1.0), 3),  # joins mid-run: its first step full
    })  # fmt: skip
    assert beside["watched"][1] == alone[1]
    assert beside["full"][1] == [0]
    assert all(beside["skipping"][1]) and any(alone[1])
    # The same decisions, so the same image: only another batch's float rounding, far below one step of 255.
    assert differences(beside["watched"][0], alone[0]) < ROUNDING
    joiner_alone = serve(runner, {"joiner": (items("a yellow torus", 11), params(4, guidance=1.0), 0)})["joiner"]
    assert beside["joiner"][1] == joiner_alone[1] and differences(beside["joiner"][0], joiner_alone[0]) < ROUNDING


def test_images_that_skip_do_not_run_the_remaining_blocks(runners):
    runner = runners(NEVER)
    runner._denoiser.forced_skips = lambda r, step: r.item.prompt == "skips" and step % 2 == 0
    try:
        before = (runner._denoiser.tail_calls.calls, runner._denoiser.tail_calls.rows)
        served = serve(runner, {"skips": (items("skips", 1, 2), params(), 0), "runs": (items("runs", 7), params(), 0)})
        calls = runner._denoiser.tail_calls.calls - before[0], runner._denoiser.tail_calls.rows - before[1]
    finally:
        runner._denoiser.forced_skips = None
    # Steps 2 and 4 skip (step 0 is full: nothing cached yet); the remaining blocks ran 6 times for `runs`, 4 for
    # each `skips` image, in one call a step.
    assert served["skips"][1] == [2, 2] and served["runs"][1] == [0]
    assert calls == (STEPS, STEPS + 2 * (STEPS - 2))


def generate(runner, prompt: str, seed: int) -> list:
    return runner.generate(items(prompt, seed), params(), lambda step, total: None)


def test_scheduling_request_runs_diffusers_hook_fresh_per_call(runners, directory):
    never, plain = runners(NEVER, "request"), runners(PLAIN, "request")
    assert np.array_equal(generate(never, "a red cube", 3)[0], generate(plain, "a red cube", 3)[0])
    assert never.steps_skipped == 0 and plain.steps_skipped is None
    cached = runners(CACHED, "request")
    first = generate(cached, "a red cube", 3)
    skipped = cached.steps_skipped
    # A second call, another prompt, then the first again: the same image, so nothing carried over between calls.
    generate(cached, "a green cone", 5)
    again = generate(cached, "a red cube", 3)
    assert np.array_equal(first[0], again[0]) and cached.steps_skipped == skipped
    stepped = serve(runners(CACHED), {"alone": (items("a red cube", 3), params(), 0)})["alone"]
    assert skipped == stepped[1][0] > 0  # the same decisions as the per-image cache alone
    assert differences(first, stepped[0]) <= 1
    assert differences(first, [diffusers_first_block_cache(directory, "a red cube", 3, THRESHOLD)]) == 0


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_the_reply_counts_the_steps_its_images_skipped(runners, scheduling):
    from tests.unit.test_step_scheduler import Worker, request

    runner = runners(CACHED, scheduling)
    pending = request("counted", runner.spec, steps=STEPS, guidance=3.5, seed=3, images=2)
    off = request("off", runner.spec, steps=STEPS, guidance=3.5, seed=3)
    off.request.parameters.step_cache = False
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.pool.add(off)
        worker.outcomes.wait(2)
    fields = worker.outcomes.fields
    assert fields["counted"]["steps_skipped"] > 0
    assert "steps_skipped" not in fields["off"]


def test_a_compiled_model_never_recompiles_as_the_count_of_full_rows_changes(directory, runners):
    from model_worker.model import compiled
    from model_worker.model.pipeline import DiffusionRunner

    defaults = NEVER.defaults.model_copy(update={"width": 64, "height": 64})
    spec = NEVER.model_copy(update={"defaults": defaults, "max_batch_size": 2, "max_instances_per_request": 2})
    runner = DiffusionRunner(spec, directory[0], torch_threads=1, compile_unet=True, compile_backend="eager")
    runner.warm_up()  # every batch bucket, its first step full: the remaining blocks at every bucket too
    graphs = compiled.graphs_compiled()
    counts: list[int] = []
    tail = runner._denoiser.cached_parts()[2]
    forward = tail.forward
    tail.forward = lambda hidden, *args: counts.append(hidden.shape[0]) or forward(hidden, *args)

    def pattern(r, step):  # images skip at other steps: the count of full rows moves call by call
        return (step + r.item.seed) % 3 != 0

    requests = {"pair": (items("a red cube", 1, 2), params(), 0)}
    for each in (runner, runners(NEVER)):
        each._denoiser.forced_skips = pattern
    try:
        got, eager = serve(runner, requests), serve(runners(NEVER), requests)
    finally:
        runners(NEVER)._denoiser.forced_skips = None
    assert compiled.graphs_compiled() == graphs, "a changing count of full rows compiled a new graph"
    assert set(counts) == {1, 2}  # the count of full rows changed (2, 1, 2, 1, ...), each run at its own bucket
    for name in requests:
        assert got[name][1] == eager[name][1] and any(got[name][1])
        assert differences(got[name][0], eager[name][0]) < ROUNDING


def test_the_full_rows_are_padded_to_a_compiled_bucket_and_the_padding_dropped():
    import torch

    from model_worker.model.families.first_block import run_tail
    from model_worker.model.step_cache import TailCalls

    seen, counted = [], TailCalls()

    def tail(hidden, encoder, temb, rotary):
        seen.append((hidden.shape[0], encoder.shape[0], temb.shape[0]))
        return hidden * 2

    hidden = torch.arange(3.0).reshape(3, 1, 1)
    out = run_tail(tail, lambda rows: 4, hidden, torch.zeros(3, 1, 1), torch.zeros(3, 1), None, counted)
    assert seen == [(4, 4, 4)] and torch.equal(out, hidden * 2)  # 3 full rows ran as the 4-row bucket
    assert (counted.calls, counted.rows) == (1, 3)


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_a_batch_line_decides_by_the_batch_threshold(runners, scheduling):
    from tests.unit.test_step_scheduler import Worker, request

    # The tiny model's residual moves 0.2-0.4 a step: between the interactive threshold and the batch lines'.
    runner = runners(with_cache(threshold=0.1, batch_threshold=0.5), scheduling)
    interactive = request("interactive", runner.spec, steps=STEPS, guidance=3.5, seed=3)
    line = request("line", runner.spec, steps=STEPS, guidance=3.5, seed=3, priority="batch")
    assert [item.batch_line for item in line.items] == [True] and not interactive.items[0].batch_line
    with Worker({runner.spec.queue: runner}) as worker:
        worker.pool.add(interactive)
        worker.pool.add(line)
        worker.outcomes.wait(2)
    fields = worker.outcomes.fields
    assert fields["line"]["steps_skipped"] > fields["interactive"]["steps_skipped"]


def test_a_cancelled_images_cache_is_freed_at_the_next_step(runners):
    import weakref

    from tests.unit.test_step_scheduler import Hooked, Worker, request

    runner = runners(CACHED)
    live: dict[str, weakref.ref] = {}

    class Watched(Hooked):
        def denoise_step(self, running) -> None:
            for r in running:  # each image's cache, by its request, as the step sees it
                live.setdefault(r.item.prompt.split()[0], weakref.ref(r.state["step_cache"]))
            super().denoise_step(running)

    watched = Watched(runner)
    stays = request("stays", runner.spec, steps=STEPS, guidance=3.5, seed=3)
    leaves = request("leaves", runner.spec, steps=STEPS, guidance=3.5, seed=5)
    counted = []

    def cancel() -> None:
        leaves.cancelled = True

    watched.after[2] = cancel
    watched.after[3] = lambda: counted.append([name for name, ref in live.items() if ref() is not None])
    with Worker({runner.spec.queue: watched}) as worker:
        worker.pool.add(stays)
        worker.pool.add(leaves)
        worker.outcomes.wait(2)
    assert watched.sizes[:3] == [2, 2, 1]  # it left at the step after its cancel
    assert counted == [["stays"]]  # by then its cache was gone (nothing else held it), the other's still there
