"""`priority: high` only for configured keys; input images refused by pixel count before decoding."""

from __future__ import annotations

import pytest

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.predict.inference import InferenceService
from api_server.predict.schemas import decode_input_image
from contract.catalog import load_catalog
from contract.settings import Settings, api_key_digest
from tests.conftest import png_b64

SPEC = load_catalog().get("sd15-txt2img")


def caller(key: str) -> Caller:
    return Caller(api_key_digest(key)[:12], api_key_digest(key))


def service(settings: Settings) -> InferenceService:
    return InferenceService(None, None, 900, settings.high_priority_key_sha256)  # type: ignore[arg-type]


def test_high_priority_keys_come_from_digests_and_plain_keys():
    settings = Settings.from_env({"MAAS_HIGH_PRIORITY_KEYS": "vip", "MAAS_HIGH_PRIORITY_KEY_SHA256": "ab" * 32})
    assert settings.high_priority_key_sha256 == {api_key_digest("vip"), "ab" * 32}


def test_high_priority_is_refused_for_other_keys_and_allowed_for_configured_ones():
    inference = service(Settings.from_env({"MAAS_HIGH_PRIORITY_KEYS": "vip"}))
    body = {"instances": [{"prompt": "x"}], "parameters": {"priority": "high"}}
    assert inference.prepare(SPEC, body, "r1", caller("vip")).priority == "high"
    with pytest.raises(ApiError) as refused:
        inference.prepare(SPEC, body, "r2", caller("someone"))
    assert refused.value.status == 403 and refused.value.field == "parameters.priority"
    assert inference.prepare(SPEC, {"instances": [{"prompt": "x"}]}, "r3", caller("x")).priority == "normal"


def test_input_image_above_the_pixel_limit_is_422_from_its_header():
    with pytest.raises(ApiError) as refused:
        decode_input_image(png_b64(128, 128), "instances.0.image", max_pixels=100 * 100)
    assert refused.value.status == 422 and "128x128" in refused.value.message
    assert decode_input_image(png_b64(64, 64), "instances.0.image", max_pixels=100 * 100)
