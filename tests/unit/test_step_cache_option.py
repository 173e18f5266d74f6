"""The catalog's `step_cache` option (contract/step_cache.py): validated when the catalog loads (its kind per
family), a request's `"step_cache": false` (never on where the catalog has none), the result cache key and the log
row's `step_cache` and `steps_skipped`."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import yaml

from api_server.core.errors import ApiError
from api_server.inference_log.writer import InferenceLogRow
from api_server.predict.cache import cache_key
from api_server.predict.schemas import parse_body, resolve_parameters
from contract.catalog import ModelCatalog
from contract.log_schema import validate_row
from contract.messages import InferenceReply
from contract.model_spec import ModelSpec
from contract.step_cache import StepCache, running_step_cache
from tests.unit.test_family_rules import entry

FIRST_BLOCK = {"kind": "first_block", "threshold": 0.08, "warmup_steps": 1, "max_consecutive_skips": 3}
CACHED = ModelSpec.model_validate(entry(step_cache=FIRST_BLOCK))
PLAIN = ModelSpec.model_validate(entry())


def catalog_error(tmp_path, **changes) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "models": {"m": entry(**changes)}}))
    with pytest.raises(ValueError) as caught:
        ModelCatalog.from_yaml(path)
    return str(caught.value)


def test_the_step_cache_is_off_unless_the_catalog_entry_has_one():
    assert PLAIN.step_cache is None
    assert CACHED.step_cache == StepCache(**FIRST_BLOCK)


@pytest.mark.parametrize(
    ("step_cache", "pipeline", "message"),
    [
        (FIRST_BLOCK, "StableDiffusionPipeline", "not served for sd15 models"),
        ({"kind": "magcache"}, "FluxPipeline", "kind"),
        ({"kind": "first_block", "threshold": -0.1}, "FluxPipeline", "threshold"),
        ({"kind": "first_block", "threshold": 0.1, "batch_threshold": 0.05}, "FluxPipeline", "below threshold"),
        ({"kind": "first_block", "max_consecutive_skips": 0}, "FluxPipeline", "max_consecutive_skips"),
        ({"kind": "first_block", "warmup": 2}, "FluxPipeline", "warmup"),
        ({"kind": "deepcache", "interval": 3}, "FluxPipeline", "not served for flux models"),
        ({"kind": "deepcache"}, "StableDiffusionPipeline", "set interval or threshold"),
        ({"kind": "deepcache", "interval": 3, "threshold": 0.1}, "StableDiffusionPipeline", "one of them"),
        (
            {"kind": "taylorseer", "interval": 3, "warmup_steps": 2, "batch_threshold": 0.5},
            "FluxPipeline",
            "not threshold",
        ),
        ({"kind": "first_block"}, "StableDiffusionXLPipeline", "not served for sdxl models"),
        ({"kind": "first_block", "interval": 3}, "FluxPipeline", "interval is deepcache's"),
        ({"kind": "deepcache", "interval": 3, "batch_threshold": 0.2}, "StableDiffusionPipeline", "no threshold"),
        ({"kind": "deepcache", "threshold": 0.2, "batch_threshold": 0.1}, "StableDiffusionPipeline", "below threshold"),
        ({"kind": "taylorseer", "interval": 3, "warmup_steps": 2}, "StableDiffusionPipeline", "not served for sd15"),
        ({"kind": "taylorseer", "warmup_steps": 2}, "FluxPipeline", "set interval"),
        ({"kind": "taylorseer", "interval": 3, "warmup_steps": 2, "threshold": 0.1}, "FluxPipeline", "set interval"),
        ({"kind": "taylorseer", "interval": 3}, "FluxPipeline", "warmup_steps must be at least 1"),
        ({"kind": "first_block", "max_order": 2}, "FluxPipeline", "max_order is taylorseer's"),
        ({"kind": "taylorseer", "interval": 3, "warmup_steps": 2, "max_order": 5}, "FluxPipeline", "max_order"),
    ],
)
def test_a_catalog_step_cache_the_family_cannot_run_is_refused_at_load(tmp_path, step_cache, pipeline, message):
    assert message in catalog_error(tmp_path, step_cache=step_cache, pipeline=pipeline)


def test_a_synthetic_runner_takes_no_step_cache(tmp_path):
    message = catalog_error(
        tmp_path,
        runner="noop",
        pipeline=None,
        weights_path="",
        step_cache=FIRST_BLOCK,
        defaults={"num_inference_steps": 4, "guidance_scale": 1.0, "width": 64, "height": 64},
    )
    assert "step_cache" in message


def params(spec: ModelSpec, **given):
    return resolve_parameters(parse_body({"instances": [{"prompt": "a"}], "parameters": {"seed": 1, **given}}), spec)


def test_a_request_may_turn_the_step_cache_off_but_never_on():
    assert params(CACHED).step_cache is None
    assert params(CACHED, step_cache=True).step_cache is None  # what it gets anyway: the same request
    assert params(CACHED, step_cache=False).step_cache is False
    assert params(PLAIN, step_cache=False).step_cache is None  # nothing to turn off: the same request
    with pytest.raises(ApiError) as caught:
        params(PLAIN, step_cache=True)
    assert caught.value.status == 422 and caught.value.field == "parameters.step_cache"
    assert running_step_cache(CACHED.step_cache, False) is None
    assert running_step_cache(CACHED.step_cache, None) is CACHED.step_cache


def key(spec: ModelSpec, **given) -> str:
    return cache_key(spec, params(spec, **given), ["a"], [None])


def test_the_step_cache_it_runs_with_is_part_of_the_result_cache_key():
    cached = key(CACHED)
    assert cached != key(CACHED, step_cache=False)
    looser = ModelSpec.model_validate(entry(step_cache={**FIRST_BLOCK, "threshold": 0.2}))
    assert cached != key(looser)
    # Off, the key is the one a model without a step cache has: nothing of the option is in it.
    assert key(CACHED, step_cache=False) == key(PLAIN)
    assert key(CACHED, step_cache=True) == cached


def logged_row() -> InferenceLogRow:
    return InferenceLogRow(request_id="r", created_at=datetime.now(UTC), model="m", status="ok", http_status=200)


def test_the_log_row_says_which_step_cache_ran_and_how_many_steps_it_skipped():
    row = logged_row()
    reply = InferenceReply(request_id="r", model="m", model_version="1", status="ok", steps_skipped=7)
    row.record_reply(reply)
    row.step_cache = "first_block"
    logged = row.to_json()
    assert validate_row(logged) and (logged["step_cache"], logged["steps_skipped"]) == ("first_block", 7)
    plain = InferenceReply(request_id="r", model="m", model_version="1", status="ok")
    row = logged_row()
    row.record_reply(plain)
    assert "steps_skipped" not in row.to_json() and "step_cache" not in row.to_json()


def test_settings_only_the_per_image_cache_honours_need_scheduling_step(tmp_path):
    message = catalog_error(tmp_path, step_cache=FIRST_BLOCK, scheduling="request")
    assert "scheduling: step" in message
    deep = {"kind": "deepcache", "interval": 3}
    assert "scheduling: step" in catalog_error(tmp_path, step_cache=deep, scheduling="request",
                                               pipeline="StableDiffusionPipeline")  # fmt: skip
    threshold_only = ModelSpec.model_validate(entry(step_cache={"kind": "first_block"}, scheduling="request"))
    assert threshold_only.step_cache.threshold == 0.08


def test_the_memory_plan_counts_each_images_cached_residuals():
    from contract.architectures import ARCHITECTURES
    from contract.memory_plan import unit_plan

    plain, cached = unit_plan(PLAIN), unit_plan(CACHED)
    flux = ARCHITECTURES["flux.1-schnell" if PLAIN.guidance_mode == "none" else "flux.1-dev"]
    tokens = 1536 * 1536 // flux.pixels_per_token
    hidden = flux.denoiser_elements_per_token // 20
    assert cached.activation_bytes - plain.activation_bytes == 4 * 2 * tokens * hidden * 2  # batch 4, bf16


def test_taylorseer_runs_in_both_schedulings_with_its_warm_up_and_its_order_in_the_key():
    taylor = {"kind": "taylorseer", "interval": 3, "warmup_steps": 2}
    request = ModelSpec.model_validate(entry(step_cache=taylor, scheduling="request"))  # diffusers' hook has both
    assert request.step_cache.max_order is None and "max_order" not in request.step_cache.cache_key_part()
    second = ModelSpec.model_validate(entry(step_cache={**taylor, "max_order": 2}))
    assert key(second) != key(ModelSpec.model_validate(entry(step_cache=taylor)))
    assert "max_order" not in CACHED.step_cache.cache_key_part()  # the other kinds' keys are as they were


def test_the_memory_plan_counts_each_images_taylor_factors():
    from contract.architectures import ARCHITECTURES
    from contract.memory_plan import unit_plan

    taylor = {"kind": "taylorseer", "interval": 3, "warmup_steps": 2, "max_order": 2}
    cached = unit_plan(ModelSpec.model_validate(entry(step_cache=taylor)))
    flux = ARCHITECTURES["flux.1-schnell" if PLAIN.guidance_mode == "none" else "flux.1-dev"]
    tokens = 1536 * 1536 // flux.pixels_per_token
    # batch 4, orders 0 to 2, 64 packed channels a token, float32
    assert cached.activation_bytes - unit_plan(PLAIN).activation_bytes == 4 * 3 * tokens * 64 * 4


def test_deepcache_decides_by_interval_or_by_threshold_on_sd15_and_sdxl():
    for pipeline in ("StableDiffusionPipeline", "StableDiffusionXLPipeline"):
        by_interval = ModelSpec.model_validate(
            entry(pipeline=pipeline, step_cache={"kind": "deepcache", "interval": 3})
        )
        assert by_interval.step_cache.interval == 3
    looser = {"kind": "deepcache", "threshold": 0.2, "batch_threshold": 0.4}
    by_threshold = ModelSpec.model_validate(entry(pipeline="StableDiffusionPipeline", step_cache=looser))
    assert by_threshold.step_cache.interval is None
    assert running_step_cache(by_threshold.step_cache, None, batch_line=True).threshold == 0.4


@pytest.mark.parametrize("pipeline", ["StableDiffusionPipeline", "StableDiffusionXLPipeline"])
def test_the_memory_plan_counts_each_images_deep_features(pipeline):
    import math

    from contract.memory_plan import unit_plan
    from contract.model_spec import architecture_of

    def plan(step_cache=None):
        return unit_plan(ModelSpec.model_validate(entry(pipeline=pipeline, step_cache=step_cache)))

    by_interval = plan({"kind": "deepcache", "interval": 3})
    by_threshold = plan({"kind": "deepcache", "threshold": 0.1})
    spec = ModelSpec.model_validate(entry(pipeline=pipeline))
    limits, multiple = spec.limits, spec.family.size_multiple
    pixels = (limits.max_width - limits.max_width % multiple) * (limits.max_height - limits.max_height % multiple)
    tokens = math.ceil(pixels / architecture_of(spec).pixels_per_token)
    rows = spec.max_batch_size * 2  # guided: two rows an image
    # the last up block's input (640 wide, full latent size), by threshold also the first down block's (320, a quarter)
    assert by_interval.activation_bytes - plan().activation_bytes == rows * 640 * tokens * 2
    assert by_threshold.activation_bytes - by_interval.activation_bytes == rows * (320 * tokens // 4) * 2


@pytest.mark.parametrize(
    ("step_cache", "pipeline"),
    [({"kind": "deepcache", "interval": 3}, "StableDiffusionPipeline"),
     ({"kind": "deepcache", "threshold": 0.2, "batch_threshold": 0.3}, "StableDiffusionXLPipeline"),
     ({"kind": "taylorseer", "interval": 4, "warmup_steps": 2, "max_order": 2}, "FluxPipeline"),
     (FIRST_BLOCK, "FluxPipeline")],
)  # fmt: skip
def test_an_entry_dumped_and_validated_again_is_the_same(step_cache, pipeline):
    # What a worker's scheduling override does (model_worker/serving/service.py): every field, defaults too.
    spec = ModelSpec.model_validate(entry(pipeline=pipeline, step_cache=step_cache))
    again = ModelSpec.model_validate({**spec.model_dump(), "scheduling": "step"})
    assert again.step_cache == spec.step_cache
    assert again.step_cache.cache_key_part() == spec.step_cache.cache_key_part()
