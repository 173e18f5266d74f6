"""Each model family's rules, from the catalog's pipeline class: what the catalog accepts, the defaults it fills in,
and the 422 the API answers for a request the family cannot honour (naming the field)."""

from __future__ import annotations

import pytest
import yaml

from api_server.core.errors import ApiError
from api_server.predict.schemas import parse_body, resolve_parameters
from contract.catalog import ModelCatalog, load_catalog
from contract.families import PIPELINES
from contract.model_spec import ModelSpec

CATALOG = load_catalog()
SD15, SDXL, SCHNELL = CATALOG.get("sd15-txt2img"), CATALOG.get("sdxl-txt2img"), CATALOG.get("flux-schnell")
DEV = SCHNELL.model_copy(update={"name": "flux-dev", "guidance": "embedded"})


def entry(**changes) -> dict:
    base = {
        "name": "m", "version": "1", "task": "text-to-image", "pipeline": "FluxPipeline", "weights_path": "m/1",
        "hardware": "a100", "gpu_sharing": False, "max_batch_size": 4, "max_instances_per_request": 4,
        "request_timeout_seconds": 120, "ack_deadline_seconds": 30, "max_delivery_attempts": 5, "drain_seconds": 60,
        "replicas": {"min": 1, "max": 2}, "limits": {"max_inference_steps": 50, "max_width": 1536, "max_height": 1536},
    }  # fmt: skip
    return {**base, **changes}


def refusal(payload: dict, spec: ModelSpec) -> ApiError:
    with pytest.raises(ApiError) as caught:
        resolve_parameters(parse_body(payload), spec)
    assert caught.value.status == 422
    return caught.value


def test_an_unknown_pipeline_class_is_refused_naming_the_accepted_ones(tmp_path):
    catalog = tmp_path / "models.yaml"
    catalog.write_text(yaml.safe_dump({"schema_version": 1, "models": {"m": entry(pipeline="KandinskyPipeline")}}))
    with pytest.raises(ValueError) as caught:
        ModelCatalog.from_yaml(catalog)
    message = str(caught.value)
    assert "KandinskyPipeline" in message and all(pipeline in message for pipeline in PIPELINES)


def test_each_family_gets_its_own_defaults_for_what_the_entry_leaves_out():
    flux = ModelSpec.model_validate(entry())
    assert (flux.defaults.width, flux.defaults.height, flux.defaults.guidance_scale) == (1024, 1024, 3.5)
    schnell = ModelSpec.model_validate(entry(guidance="none"))
    assert (schnell.defaults.num_inference_steps, schnell.defaults.guidance_scale) == (4, 0.0)
    sdxl = ModelSpec.model_validate(entry(pipeline="StableDiffusionXLPipeline", defaults={"width": 768}))
    assert (sdxl.defaults.width, sdxl.defaults.height, sdxl.family.name) == (768, 1024, "sdxl")
    assert SD15.defaults.width == 512 and SD15.family.name == "sd15"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"task": "image-to-image"}, "serves text-to-image"),
        ({"guidance": "cfg"}, "does not fit"),
        ({"defaults": {"width": 1000}}, "multiple of 16"),
    ],
)
def test_a_catalog_entry_that_contradicts_its_family_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.model_validate(entry(**changes))


def test_every_family_takes_adapters():
    for pipeline in ("FluxPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline"):
        assert ModelSpec.model_validate(entry(pipeline=pipeline, adapters={})).adapters is not None


def test_a_flux_size_not_a_multiple_of_16_is_a_422_naming_the_field():
    error = refusal({"instances": [{"prompt": "x"}], "parameters": {"width": 1000}}, SCHNELL)
    assert error.field == "parameters.width" and "multiple of 16" in error.message
    assert refusal({"instances": [{"prompt": "x"}], "parameters": {"height": 520}}, DEV).field == "parameters.height"
    # 8 is enough for the UNet families.
    assert resolve_parameters(parse_body({"instances": [{"prompt": "x"}], "parameters": {"width": 1000}}), SDXL)


def test_a_negative_prompt_on_a_model_that_would_ignore_it_is_a_422():
    for spec in (SCHNELL, DEV):
        error = refusal({"instances": [{"prompt": "x"}], "parameters": {"negative_prompt": "blur"}}, spec)
        assert error.field == "parameters.negative_prompt"
    for spec in (SD15, SDXL):
        payload = {"instances": [{"prompt": "x"}], "parameters": {"negative_prompt": "blur"}}
        assert resolve_parameters(parse_body(payload), spec).negative_prompt == "blur"


def test_guidance_is_embedded_guidance_for_flux_dev_and_refused_for_schnell():
    payload = {"instances": [{"prompt": "x"}], "parameters": {"guidance_scale": 4.0}}
    assert resolve_parameters(parse_body(payload), DEV).guidance_scale == 4.0
    assert refusal(payload, SCHNELL).field == "parameters.guidance_scale"
    assert resolve_parameters(parse_body({"instances": [{"prompt": "x"}]}), SCHNELL).guidance_scale == 0.0


def test_sd35_takes_negative_prompts_and_sizes_a_multiple_of_16_and_may_leave_t5_out():
    sd35 = CATALOG.get("sd35-txt2img")
    assert sd35.family.name == "sd3" and sd35.guidance_mode == "cfg"
    payload = {"instances": [{"prompt": "x"}], "parameters": {"negative_prompt": "blur", "width": 512}}
    assert resolve_parameters(parse_body(payload), sd35).negative_prompt == "blur"
    assert refusal({"instances": [{"prompt": "x"}], "parameters": {"width": 520}}, sd35).field == "parameters.width"
    assert ModelSpec.model_validate(entry(pipeline="StableDiffusion3Pipeline", without=["text_encoder_3"])).without
    with pytest.raises(ValueError, match="may leave out: none"):
        ModelSpec.model_validate(entry(without=["text_encoder_2"]))


def test_image_to_image_pipelines_of_sdxl_and_flux_are_accepted_for_image_to_image_only():
    for pipeline in ("StableDiffusionXLImg2ImgPipeline", "FluxImg2ImgPipeline"):
        spec = ModelSpec.model_validate(entry(pipeline=pipeline, task="image-to-image"))
        assert spec.task == "image-to-image"
        with pytest.raises(ValueError, match="serves image-to-image"):
            ModelSpec.model_validate(entry(pipeline=pipeline))
