"""TaylorSeer per image over FLUX.1 (model_worker/model/families/taylorseer.py): interval 1 is exactly no cache, one
image alone equals diffusers' own `TaylorSeerCacheConfig` hook (lite mode), an image's answer is the same alone and
beside images that predict, that do not, and that join, and a predicting image does not run the transformer; both
schedulings."""

from __future__ import annotations

import numpy as np
import pytest

from contract.model_spec import ModelSpec
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import DEV, differences
from tests.unit.test_step_cache_rows import (
    ROUNDING,
    STEPS,
    assert_never_skipping_is_no_cache,
    cached_spec,
    items,
    params,
    runner_maker,
    serve,
)

WARMUP, INTERVAL = 2, 3  # of 6 steps: 0 and 1 full, 2 predicted, 3 full, 4 and 5 predicted


def with_cache(**step_cache) -> ModelSpec:
    return cached_spec(DEV, **{"kind": "taylorseer", "interval": INTERVAL, "warmup_steps": WARMUP, **step_cache})


CACHED, NEVER, PLAIN = with_cache(), with_cache(interval=1), DEV


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tiny_pipelines(tmp_path_factory.mktemp("taylorseer"), {"flux-dev": PLAIN})["flux-dev"]


@pytest.fixture(scope="module")
def runners(directory):
    return runner_maker(directory[0])


def diffusers_taylorseer(directory, prompt: str, seed: int, **config):
    """diffusers' own pipeline with its TaylorSeer hook (`enable_cache`, lite mode), fresh for this one image."""
    import torch
    from diffusers.hooks import TaylorSeerCacheConfig

    pipeline = directory[1]
    settings = {"cache_interval": INTERVAL, "disable_cache_before_step": WARMUP, **config}
    pipeline.transformer.enable_cache(
        TaylorSeerCacheConfig(**settings, taylor_factors_dtype=torch.float32, use_lite_mode=True)
    )
    try:
        return pipeline(
            prompt, num_inference_steps=STEPS, guidance_scale=3.5, width=64, height=64, output_type="np",
            generator=torch.Generator().manual_seed(seed),
        ).images[0]  # fmt: skip
    finally:
        pipeline.transformer.disable_cache()


def test_interval_one_gives_exactly_the_images_of_no_cache(runners):
    requests = {"first": (items("a red cube", 3, 2), params(), 0), "joiner": (items("a blue sphere", 9), params(3), 2)}
    assert_never_skipping_is_no_cache(runners(NEVER), runners(PLAIN), requests)
    request_never = runners(NEVER, "request").generate(items("a red cube", 3), params(), lambda step, total: None)
    request_plain = runners(PLAIN, "request").generate(items("a red cube", 3), params(), lambda step, total: None)
    assert np.array_equal(request_never[0], request_plain[0]) and runners(NEVER, "request").steps_skipped == 0


@pytest.mark.parametrize("max_order", [1, 2])
def test_one_image_alone_equals_diffusers_taylorseer_hook(runners, directory, max_order):
    spec = with_cache(max_order=max_order)
    served = serve(runners(spec), {"alone": (items("a red cube", 3), params(), 0)})["alone"]
    assert served[1] == [3]  # steps 2, 4 and 5 predicted
    expected = diffusers_taylorseer(directory, "a red cube", 3, max_order=max_order)
    assert differences(served[0], [expected]) <= 1, "differs from diffusers' TaylorSeer by more than 1/255"
    plain = serve(runners(PLAIN), {"alone": (items("a red cube", 3), params(), 0)})["alone"]
    assert differences(served[0], plain[0]) > 1  # the predictions changed the image: the comparison means something
    request = runners(spec, "request")
    called = request.generate(items("a red cube", 3), params(), lambda step, total: None)
    assert request.steps_skipped == 3 and differences(called, [expected]) == 0


def test_an_image_is_the_same_alone_and_beside_images_that_predict_do_not_and_join(runners):
    runner = runners(CACHED)
    watched = {"watched": (items("a red cube", 3), params(), 0)}
    alone = serve(runner, watched)["watched"]
    beside = serve(runner, {
        **watched,
        "predicting": (items("a green cone", 5, 2), params(8), 1),  # other steps: predicts when `watched` runs
        "full": (items("a blue sphere", 9), params(step_cache=False), 0),  # no cache: never predicts
        "joiner": (items("a yellow torus", 11), params(4, guidance=1.0), 3),  # joins mid-run: its first steps full
    })  # fmt: skip
    assert beside["watched"][1] == alone[1] == [3]
    assert beside["full"][1] == [0] and beside["predicting"][1] == [4, 4] and beside["joiner"][1] == [1]
    assert differences(beside["watched"][0], alone[0]) < ROUNDING
    joiner_alone = serve(runner, {"joiner": (items("a yellow torus", 11), params(4, guidance=1.0), 0)})["joiner"]
    assert differences(beside["joiner"][0], joiner_alone[0]) < ROUNDING


def test_images_that_predict_do_not_run_the_transformer(runners):
    runner = runners(NEVER)
    runner._denoiser.forced_skips = lambda r, step: r.item.prompt == "skips" and step % 2 == 0
    try:
        before = (runner._denoiser.tail_calls.calls, runner._denoiser.tail_calls.rows)
        served = serve(runner, {"skips": (items("skips", 1, 2), params(), 0), "runs": (items("runs", 7), params(), 0)})
        calls = runner._denoiser.tail_calls.calls - before[0], runner._denoiser.tail_calls.rows - before[1]
    finally:
        runner._denoiser.forced_skips = None
    # Steps 2 and 4 predicted (the warm-up: steps 0 and 1); the transformer ran 6 times for `runs`, 4 for each `skips`.
    assert served["skips"][1] == [2, 2] and served["runs"][1] == [0]
    assert calls == (STEPS, STEPS + 2 * (STEPS - 2))


def test_the_full_rows_are_gathered_and_padded_to_a_compiled_bucket_and_the_padding_dropped():
    from types import SimpleNamespace

    import torch

    from model_worker.model.families.flow import FluxDenoiser

    seen = []

    def transformer(return_dict, txt_ids, img_ids, **rows):
        seen.append({key: None if value is None else value.shape[0] for key, value in rows.items()})
        return (rows["hidden_states"] * 2,)

    denoiser = SimpleNamespace(
        padded_rows=lambda rows: 4, _torch=torch, pipeline=SimpleNamespace(transformer=transformer)
    )
    inputs = {"hidden_states": torch.arange(3.0).reshape(3, 1, 1), "timestep": torch.arange(3.0), "guidance": None,
              "pooled_projections": torch.zeros(3, 2), "encoder_hidden_states": torch.zeros(3, 1, 2),
              "txt_ids": torch.zeros(1, 3), "img_ids": torch.zeros(1, 3)}  # fmt: skip
    out = FluxDenoiser.gathered_call(denoiser, inputs)([0, 2])  # rows 0 and 2 run, as the 4-row bucket
    assert seen == [{"hidden_states": 4, "timestep": 4, "guidance": None, "pooled_projections": 4,
                     "encoder_hidden_states": 4}]  # fmt: skip
    assert torch.equal(out, torch.tensor([0.0, 4.0]).reshape(2, 1, 1))
