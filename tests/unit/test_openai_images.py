"""The OpenAI Images API's bodies translated to predict bodies, and answers and errors back to OpenAI's shapes."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from api_server.core.errors import ApiError
from api_server.predict.openai_images import (
    edit_call,
    form_values,
    generation_call,
    images_response,
    openai_error,
    openai_param,
    repaint_mask,
)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_generation_becomes_n_instances_with_the_size_and_the_services_own_parameters():
    call = generation_call({"model": "m", "prompt": "fox", "n": 3, "size": "64x96", "seed": 7,
                            "num_inference_steps": 2, "response_format": "url"})  # fmt: skip
    assert call.model == "m" and call.response_format == "url"
    assert call.payload == {
        "instances": [{"prompt": "fox"}] * 3,
        "parameters": {"seed": 7, "num_inference_steps": 2, "width": 64, "height": 96},
    }
    assert generation_call({"model": "m", "prompt": "fox", "size": "auto"}).payload["parameters"] == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "size": "big"}, "size"),
        ({"model": "m", "prompt": "x", "style": "vivid"}, "style"),
        ({"model": "m", "prompt": "x", "quality": "hd"}, "quality"),
        ({"model": "m", "prompt": "x", "n": "2"}, "n"),  # a JSON body is strict, as :predict is
        ({"model": "m", "prompt": "x", "output_format": "webp"}, "output_format"),
        ({"model": "m", "prompt": "x", "surprise": 1}, "surprise"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_what_does_not_map_is_refused_by_name(body, param):
    with pytest.raises(ApiError) as refused:
        generation_call(body)
    assert refused.value.status == 422 and openai_param(refused.value.field) == param


def test_an_edit_takes_the_input_images_size_when_none_is_asked_and_form_text_as_numbers():
    image = png(Image.new("RGB", (64, 80), (10, 20, 30)))
    call = edit_call(
        form_values({"model": ["m"], "prompt": ["p"], "n": ["2"], "strength": ["0.5"]}), {"image": [image]}
    )
    assert call.payload["parameters"] == {"strength": 0.5, "width": 64, "height": 80}
    assert [instance["image"] for instance in call.payload["instances"]] == [base64.b64encode(image).decode()] * 2
    assert "mask" not in call.payload["instances"][0]


def test_openais_mask_marks_its_transparent_pixels_for_repainting():
    mask = Image.new("RGBA", (4, 2), (0, 0, 0, 255))
    mask.putpixel((1, 0), (0, 0, 0, 0))  # fully transparent: edit
    mask.putpixel((2, 0), (0, 0, 0, 128))  # half transparent: OpenAI keeps it
    converted = Image.open(io.BytesIO(repaint_mask(png(mask)))).convert("L")
    assert converted.tobytes() == bytes([0, 255, 0, 0, 0, 0, 0, 0])
    plain = png(Image.new("L", (4, 2), 255))
    assert repaint_mask(plain) == plain  # no alpha: already white = repaint


@pytest.mark.parametrize(
    ("files", "param"),
    [
        ({}, "image"),
        ({"image": [b"x", b"y"]}, "image"),
        ({"image": [b"x"], "mask": [b"m", b"n"]}, "mask"),
        ({"image": [b"not an image"]}, "image"),
    ],
)
def test_an_edit_without_one_readable_image_and_at_most_one_mask_is_refused(files, param):
    with pytest.raises(ApiError) as refused:
        edit_call({"model": "m", "prompt": "p"}, files)
    assert refused.value.status == 422 and refused.value.field == param


def test_a_field_sent_twice_is_refused():
    with pytest.raises(ApiError) as refused:
        form_values({"prompt": ["a", "b"]})
    assert refused.value.field == "prompt"


def test_answers_and_errors_take_openais_shapes():
    predictions = [{"image_b64": "QUJD", "width": 64, "height": 96, "seed": 1, "mime_type": "image/png"}]
    answer = json.dumps({"predictions": predictions}).encode()
    inline = images_response(answer, None)
    assert inline["data"] == [{"b64_json": "QUJD"}] and inline["size"] == "64x96" and inline["created"] > 0
    assert images_response(answer, ["https://signed"])["data"] == [{"url": "https://signed"}]
    assert openai_error(422, "parameters.width: at most 512", "parameters.width") == {
        "error": {"message": "parameters.width: at most 512", "type": "invalid_request_error", "param": "size",
                  "code": None},
    }  # fmt: skip
    assert openai_error(401, "invalid API key", None)["error"]["type"] == "authentication_error"
    assert openai_error(429, "slow down", None)["error"]["code"] == "rate_limit_exceeded"
    assert openai_error(503, "overloaded", None)["error"]["type"] == "server_error"
    assert openai_param("instances.0.mask") == "mask" and openai_param("instances") == "n"
