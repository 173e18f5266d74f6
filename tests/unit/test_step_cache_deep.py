"""DeepCache per image over SD 1.5's and SDXL's UNets (model_worker/model/families/deep_cache.py), by interval and by
threshold: interval 1 and threshold 0 are exactly no cache, an image's answer is the same alone and beside images
that reuse their deep features, that do not, and that join, and an image that reuses them does not run the deep
path."""

from __future__ import annotations

import numpy as np
import pytest

from contract.model_spec import ModelSpec
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import SD15, SDXL, differences
from tests.unit.test_step_cache_rows import ROUNDING, items, params, serve

STEPS = 6
CALLS = STEPS + 1  # SD 1.5's PNDM calls the model once more than its steps


def with_cache(interval: int) -> ModelSpec:
    return ModelSpec.model_validate({**SD15.model_dump(), "step_cache": {"kind": "deepcache", "interval": interval}})


EVERY_STEP, EVERY_THIRD = with_cache(1), with_cache(3)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tiny_pipelines(tmp_path_factory.mktemp("deep-cache"), {"sd15": SD15})["sd15"][0]


@pytest.fixture(scope="module")
def runners(directory):
    from model_worker.model.pipeline import DiffusionRunner

    return {spec.model_dump_json(): DiffusionRunner(spec, directory, torch_threads=1)
            for spec in (SD15, EVERY_STEP, EVERY_THIRD)}  # fmt: skip


def runner(runners, spec: ModelSpec):
    return runners[spec.model_dump_json()]


def mixed(steps: int = STEPS) -> dict:
    """A guided request of two images, an unguided one joining at the second call, one without the cache."""
    return {
        "guided": (items("a red cube", 3, 2), params(steps, guidance=7.5), 0),
        "unguided": (items("a blue sphere", 9), params(4, guidance=1.0), 1),
        "off": (items("a green cone", 5), params(5, guidance=7.5, step_cache=False), 2),
    }


def test_interval_one_gives_exactly_the_images_of_no_cache(runners):
    cached, plain = runner(runners, EVERY_STEP), runner(runners, SD15)
    calls = cached._denoiser.tail_calls.calls
    got, expected = serve(cached, mixed()), serve(plain, mixed())
    assert cached._denoiser.tail_calls.calls - calls == CALLS  # the cached path ran, every image in full
    for name in expected:
        assert all(np.array_equal(a, b) for a, b in zip(got[name][0], expected[name][0], strict=True)), name
        assert not any(got[name][1])


def test_an_image_is_the_same_alone_and_beside_images_that_reuse_do_not_and_join(runners):
    cached = runner(runners, EVERY_THIRD)
    watched = {"watched": (items("a yellow torus", 11), params(STEPS, guidance=7.5), 0)}
    alone = serve(cached, watched)["watched"]
    beside = serve(cached, {**watched, **mixed(8)})
    # Full at its calls 0, 3 and 6, the deep path reused at the others (the unguided one's 5 calls: at 0 and 3).
    assert alone[1] == beside["watched"][1] == [CALLS - 3]
    assert beside["off"][1] == [0] and beside["unguided"][1] == [3]
    assert differences(beside["watched"][0], alone[0]) < ROUNDING
    plain = serve(runner(runners, SD15), watched)["watched"]
    assert differences(alone[0], plain[0]) > 1  # reusing changed the image: the comparison above means something


def test_images_that_reuse_their_deep_features_do_not_run_the_deep_path(runners):
    cached = runner(runners, EVERY_THIRD)
    before = cached._denoiser.tail_calls.rows
    served = serve(
        cached,
        {
            "guided": (items("a red cube", 3), params(STEPS, guidance=7.5), 0),
            "off": (items("a green cone", 5), params(STEPS, guidance=7.5, step_cache=False), 0),
        },
    )
    # Two rows an image (guided); `off` runs the deep path at all 7 calls, `guided` at its calls 0, 3 and 6.
    assert served["guided"][1] == [4] and served["off"][1] == [0]
    assert cached._denoiser.tail_calls.rows - before == 2 * (CALLS + 3)


# By threshold: the tiny SD 1.5's shallow features move by 0.15-1.2 (relative L1) a step; at 0.3 some steps reuse.
def with_threshold(threshold: float) -> ModelSpec:
    settings = {"kind": "deepcache", "threshold": threshold}
    return ModelSpec.model_validate({**SD15.model_dump(), "step_cache": settings})


@pytest.fixture(scope="module")
def by_threshold(directory):
    from model_worker.model.pipeline import DiffusionRunner

    return {threshold: DiffusionRunner(with_threshold(threshold), directory, torch_threads=1) for threshold in (0, 0.3)}


def test_threshold_zero_gives_exactly_the_images_of_no_cache(runners, by_threshold):
    cached = by_threshold[0]
    got, expected = serve(cached, mixed()), serve(runner(runners, SD15), mixed())
    assert cached._denoiser.tail_calls.calls > 0  # the cached path ran
    for name in expected:
        assert all(np.array_equal(a, b) for a, b in zip(got[name][0], expected[name][0], strict=True)), name
        assert not any(got[name][1])


def test_by_threshold_an_image_is_the_same_alone_and_beside_images_that_reuse_do_not_and_join(runners, by_threshold):
    cached = by_threshold[0.3]
    watched = {"watched": (items("a yellow torus", 11), params(STEPS, guidance=7.5), 0)}
    alone = serve(cached, watched)["watched"]
    beside = serve(cached, {**watched, **mixed(8)})
    assert 0 < alone[1][0] < CALLS - 1 and beside["watched"][1] == alone[1]
    assert beside["off"][1] == [0] and any(beside["guided"][1])
    assert differences(beside["watched"][0], alone[0]) < ROUNDING
    plain = serve(runner(runners, SD15), watched)["watched"]
    assert differences(alone[0], plain[0]) > 1  # reusing changed the image: the comparison above means something


def sdxl_with_cache(interval: int) -> ModelSpec:
    return ModelSpec.model_validate({**SDXL.model_dump(), "step_cache": {"kind": "deepcache", "interval": interval}})


@pytest.fixture(scope="module")
def sdxl_runners(tmp_path_factory):
    from model_worker.model.pipeline import DiffusionRunner

    directory = tiny_pipelines(tmp_path_factory.mktemp("deep-cache-sdxl"), {"sdxl": SDXL})["sdxl"][0]
    return {interval: DiffusionRunner(spec, directory, torch_threads=1)
            for interval, spec in ((None, SDXL), (1, sdxl_with_cache(1)), (3, sdxl_with_cache(3)))}  # fmt: skip


def test_sdxl_interval_one_gives_exactly_the_images_of_no_cache(sdxl_runners):
    cached = sdxl_runners[1]
    got, expected = serve(cached, mixed()), serve(sdxl_runners[None], mixed())
    assert cached._denoiser.tail_calls.calls > 0  # the cached path ran (SDXL's added conditioning through it)
    for name in expected:
        assert all(np.array_equal(a, b) for a, b in zip(got[name][0], expected[name][0], strict=True)), name
        assert not any(got[name][1])


def test_sdxl_an_image_is_the_same_alone_and_beside_images_that_reuse_do_not_and_join(sdxl_runners):
    cached = sdxl_runners[3]
    watched = {"watched": (items("a yellow torus", 11), params(STEPS, guidance=7.5), 0)}
    alone = serve(cached, watched)["watched"]
    beside = serve(cached, {**watched, **mixed(8)})
    # Euler calls the model once a step: full at 0 and 3, reused at the other 4 (the unguided one's 4 steps: 2).
    assert alone[1] == beside["watched"][1] == [STEPS - 2]
    assert beside["off"][1] == [0] and beside["unguided"][1] == [2]
    assert differences(beside["watched"][0], alone[0]) < ROUNDING
    plain = serve(sdxl_runners[None], watched)["watched"]
    assert differences(alone[0], plain[0]) > 1  # reusing changed the image: the comparison above means something


def test_a_compiled_unet_never_recompiles_as_the_count_of_images_running_the_deep_path_changes(directory, runners):
    """The shallow part, the deep path and the output compiled for the batch buckets (as FLUX.1's first-block parts
    are), the deep path's rows padded to one."""
    from model_worker.model import compiled
    from model_worker.model.pipeline import DiffusionRunner

    defaults = EVERY_STEP.defaults.model_copy(update={"width": 64, "height": 64, "guidance_scale": 7.5})
    # No adapter slots (a compiled model's LoRA layers, traced too: seconds more, nothing the cache's parts change).
    spec = EVERY_STEP.model_copy(update={"defaults": defaults, "max_batch_size": 2, "max_instances_per_request": 2,
                                         "scheduling": "step", "adapters": None})  # fmt: skip
    cached = DiffusionRunner(spec, directory, torch_threads=1, compile_unet=True, compile_backend="eager")
    cached.warm_up()  # every batch bucket, its first step full: the deep path at every bucket too
    graphs = compiled.graphs_compiled()
    _, shallow, deep, out = cached._denoiser._deep_parts
    assert all(hasattr(part, "_orig_mod") for part in (shallow, deep, out)), "the cache's parts run eager"
    counts: list[int] = []
    forward = deep.forward
    deep.forward = lambda hidden, *args: counts.append(hidden.shape[0]) or forward(hidden, *args)

    def pattern(r, step):  # images reuse at other steps: the count running the deep path moves call by call
        return (step + r.item.seed) % 3 != 0

    requests = {"pair": (items("a red cube", 1, 2), params(STEPS, guidance=7.5), 0)}
    eager = runner(runners, EVERY_STEP)
    for each in (cached, eager):
        each._denoiser.forced_skips = pattern
    try:
        got, expected = serve(cached, requests), serve(eager, requests)
    finally:
        eager._denoiser.forced_skips = None
    assert compiled.graphs_compiled() == graphs, "a changing count of images running the deep path compiled a graph"
    assert set(counts) == {2, 4}  # one guided image's two rows or both images' four, each at its own bucket
    assert got["pair"][1] == expected["pair"][1] and any(got["pair"][1])
    assert differences(got["pair"][0], expected["pair"][0]) < ROUNDING
