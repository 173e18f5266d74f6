"""Predict body validation and parameter resolution against the catalog."""

from __future__ import annotations

import pytest

from api_server.core.errors import ApiError
from api_server.predict.schemas import MAX_SEED, decode_input_image, parse_body, resolve_parameters
from contract.catalog import load_catalog
from tests.conftest import png_b64

CATALOG = load_catalog()
TXT2IMG, IMG2IMG = CATALOG.get("sd15-txt2img"), CATALOG.get("sd15-img2img")


def resolve(payload: dict, spec=TXT2IMG):
    return resolve_parameters(parse_body(payload), spec)


def field_of(payload: dict, spec=TXT2IMG) -> str:
    with pytest.raises(ApiError) as caught:
        resolve(payload, spec)
    assert caught.value.status == 422
    return caught.value.field


def test_catalog_defaults_fill_unset_parameters():
    params = resolve({"instances": [{"prompt": "x"}], "parameters": {"seed": 5}})
    assert params.seed == 5
    assert params.num_inference_steps == TXT2IMG.defaults.num_inference_steps
    assert (params.width, params.height) == (TXT2IMG.defaults.width, TXT2IMG.defaults.height)
    assert params.strength is None


def test_a_seed_is_chosen_when_none_is_given():
    seeds = {resolve({"instances": [{"prompt": "x"}]}).seed for _ in range(5)}
    assert all(0 <= seed <= MAX_SEED for seed in seeds) and len(seeds) > 1


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"instances": [{"prompt": ""}]}, "instances.0.prompt"),
        ({"instances": [{"prompt": "x", "extra": 1}]}, "instances.0.extra"),
        ({"instances": [{"prompt": "x"}], "parameters": {"height": 65}}, "parameters.height"),
        ({"instances": [{"prompt": "x"}], "parameters": {"width": 2048}}, "parameters.width"),
        ({"instances": [{"prompt": "x"}], "parameters": {"seed": -1}}, "parameters.seed"),
        ({"instances": [{"prompt": "x"}] * 5}, "instances"),
        ({"instances": [{"prompt": "x"}], "parameters": {"strength": 0.5}}, "parameters.strength"),
        ({"prompt": "x"}, "instances"),
    ],
)
def test_invalid_text_to_image_bodies_name_the_field(payload, field):
    assert field_of(payload) == field


def test_image_to_image_needs_enough_steps_for_its_strength():
    payload = {
        "instances": [{"prompt": "x", "image": png_b64()}],
        "parameters": {"num_inference_steps": 2, "strength": 0.3},
    }
    assert field_of(payload, IMG2IMG) == "parameters.strength"
    payload["parameters"]["strength"] = 0.5
    assert resolve(payload, IMG2IMG).strength == 0.5


def test_input_images_must_be_real_images():
    assert decode_input_image(png_b64(8, 8), "f")[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ApiError):
        decode_input_image("####", "f")
    with pytest.raises(ApiError):
        decode_input_image("aGVsbG8=", "f")  # base64 of "hello"
