"""DeepCache per image over SD 1.5's UNet (model_worker/model/families/deep_cache.py): interval 1 is exactly no cache,
an image's answer is the same alone and beside images that reuse their deep features, that do not, and that join,
and an image that reuses them does not run the deep path."""

from __future__ import annotations

import numpy as np
import pytest

from contract.model_spec import ModelSpec
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import SD15, differences
from tests.unit.test_step_cache_rows import ROUNDING, items, params, serve

STEPS = 6
CALLS = STEPS + 1  # SD 1.5's PNDM calls the model once more than its steps


def with_cache(interval: int) -> ModelSpec:
    return ModelSpec.model_validate({**SD15.model_dump(), "step_cache": {"kind": "deepcache", "interval": interval}})


EVERY_STEP, EVERY_THIRD = with_cache(1), with_cache(3)


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    from model_worker.model.pipeline import DiffusionRunner

    directory = tiny_pipelines(tmp_path_factory.mktemp("deep-cache"), {"sd15": SD15})["sd15"][0]
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
