"""The OpenAI Images API, called with the real `openai` package against the local stack: generations and edits
are answered by the catalog's models on the same path as :predict, and errors come back in OpenAI's shape."""

from __future__ import annotations

import base64
import io
import random

import openai
import pytest
import requests
from PIL import Image

from tests.conftest import TEST_API_KEYS, png_b64, query_rows

pytestmark = pytest.mark.stack
# Small and few steps: the tiny SD 1.5 pipelines on CPU answer in well under a second.
FAST = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key=TEST_API_KEYS[0], max_retries=0, timeout=120)


def decoded(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image


def png_file(width: int, height: int, name: str = "input.png") -> tuple[str, bytes, str]:
    return (name, base64.b64decode(png_b64(width, height, noise=True)), "image/png")


def test_a_generation_answers_n_images_of_the_asked_size_and_a_seeded_repeat_is_cached(client):
    seed = random.randrange(10**6)
    asked = {"model": "sd15-txt2img", "prompt": "a red fox", "n": 2, "size": "64x96",
             "extra_body": {"seed": seed, **FAST}}  # fmt: skip
    raw = client.images.with_raw_response.generate(**asked)
    result = raw.parse()
    assert raw.headers["X-Cache"] == "miss" and result.created > 0
    assert [decoded(item.b64_json).size for item in result.data] == [(64, 96), (64, 96)]
    assert result.data[0].b64_json != result.data[1].b64_json  # image i takes seed + i
    again = client.images.with_raw_response.generate(**asked)
    assert again.headers["X-Cache"] == "hit"
    assert [item.b64_json for item in again.parse().data] == [item.b64_json for item in result.data]


def test_response_format_url_is_a_signed_link_to_the_png(client):
    result = client.images.generate(model="sd15-txt2img", prompt="a lighthouse", size="64x64", response_format="url",
                                    extra_body=FAST)  # fmt: skip
    (image,) = result.data
    assert image.b64_json is None and "X-Goog-Signature=" in image.url and "X-Goog-Expires=3600" in image.url
    fetched = requests.get(image.url, timeout=30)
    assert fetched.status_code == 200
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)


def test_an_edit_without_a_mask_is_image_to_image_at_the_input_size(client):
    result = client.images.edit(model="sd15-img2img", image=png_file(64, 80), prompt="as a watercolour", n=1,
                                extra_body={**FAST, "strength": 0.5})  # fmt: skip
    assert [decoded(item.b64_json).size for item in result.data] == [(64, 80)]


def test_errors_come_back_in_openais_shape_with_the_same_statuses(client, stack, bigquery, settings):
    with pytest.raises(openai.NotFoundError) as missing:
        client.images.generate(model="no-such-model", prompt="x")
    assert missing.value.body == {
        "message": missing.value.body["message"], "type": "invalid_request_error", "param": None,
        "code": "model_not_found",
    }  # fmt: skip
    with pytest.raises(openai.UnprocessableEntityError) as too_big:
        client.images.generate(model="sd15-txt2img", prompt="x", size="4096x4096")
    assert too_big.value.body["param"] == "size" and too_big.value.body["type"] == "invalid_request_error"
    assert "at most" in too_big.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as styled:
        client.images.generate(model="sd15-txt2img", prompt="x", style="vivid")
    assert styled.value.body["param"] == "style"
    with pytest.raises(openai.UnprocessableEntityError) as masked:
        client.images.edit(model="sd15-img2img", image=png_file(64, 64), mask=png_file(64, 64, "mask.png"),
                           prompt="x")  # fmt: skip
    assert masked.value.body["param"] == "mask" and "image-to-image" in masked.value.body["message"]
    stranger = openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        stranger.images.generate(model="sd15-txt2img", prompt="x")
    assert unauthenticated.value.body["type"] == "authentication_error"
    # Each refusal is logged, and none was published: the mask's refusal has no publish time.
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    request_id = masked.value.response.headers["X-Request-Id"]
    (row,) = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=60)
    assert row["http_status"] == 422 and row["model"] == "sd15-img2img" and row["published_at"] is None


def test_an_edits_body_with_two_masks_or_an_unknown_part_is_refused(stack):
    headers = {"Authorization": f"Bearer {TEST_API_KEYS[0]}"}
    image = png_file(64, 64)
    fields = {"model": "sd15-img2img", "prompt": "x"}
    two_masks = [("image", image), ("mask", png_file(64, 64, "m1.png")), ("mask", png_file(64, 64, "m2.png"))]
    unknown = [("image", image), ("sketch", png_file(64, 64, "s.png"))]
    for files, param in ((two_masks, "mask"), (unknown, "sketch")):
        answer = requests.post(
            f"{stack.api_url}/v1/images/edits", data=fields, files=files, headers=headers, timeout=30
        )
        assert answer.status_code == 422 and answer.json()["error"]["param"] == param


def transparent_box_mask(width: int, height: int) -> tuple[str, bytes, str]:
    """OpenAI's mask: opaque, with a fully transparent box (what to edit)."""
    mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (8, 8, 40, 40))
    buffer = io.BytesIO()
    mask.save(buffer, format="PNG")
    return ("mask.png", buffer.getvalue(), "image/png")


def test_an_edit_with_a_mask_is_answered_by_an_inpaint_model_and_logged_with_its_mask_area(client, bigquery, settings):
    raw = client.images.with_raw_response.edit(model="sd15-inpaint", image=png_file(64, 64),
                                               mask=transparent_box_mask(64, 64), prompt="a window", n=2,
                                               extra_body=FAST)  # fmt: skip
    assert [decoded(item.b64_json).size for item in raw.parse().data] == [(64, 64), (64, 64)]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    request_id = raw.headers["X-Request-Id"]
    (row,) = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=60)
    # The transparent 32x32 box of a 64x64 mask: a quarter repainted.
    assert row["task"] == "inpaint" and row["num_images"] == 2 and row["mask_fraction"] == 0.25


def test_an_all_black_mask_and_a_mask_of_another_size_are_refused_naming_mask(client):
    black = Image.new("RGBA", (64, 64), (0, 0, 0, 255))  # nothing transparent: nothing to edit
    buffer = io.BytesIO()
    black.save(buffer, format="PNG")
    for mask in (("mask.png", buffer.getvalue(), "image/png"), transparent_box_mask(48, 48)):
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            client.images.edit(model="sd15-inpaint", image=png_file(64, 64), mask=mask, prompt="x")
        assert refused.value.body["param"] == "mask"


def test_outpainting_on_predict_answers_the_larger_image(stack, auth_headers):
    response = requests.post(
        f"{stack.api_url}/v1/models/sd15-inpaint:predict",
        json={"instances": [{"prompt": "more sky", "image": png_b64(48, 32)}],
              "parameters": {"outpaint": {"left": 8, "right": 8, "top": 16}, **FAST}},
        headers=auth_headers, timeout=120,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    (prediction,) = response.json()["predictions"]
    assert decoded(prediction["image_b64"]).size == (64, 48)


def test_an_instruction_edit_is_answered_by_the_edit_model_at_the_input_size_and_logged_as_edit(
    client, bigquery, settings
):
    """`images.edit` without a mask to FLUX.1 Kontext (the tiny one, in flux-schnell's worker): the instruction and
    the image, answered at the image's size; its row says task `edit` and no mask area."""
    raw = client.images.with_raw_response.edit(model="flux-kontext", image=png_file(80, 64), prompt="make it night",
                                               extra_body=FAST)  # fmt: skip
    assert [decoded(item.b64_json).size for item in raw.parse().data] == [(80, 64)]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    request_id = raw.headers["X-Request-Id"]
    (row,) = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=60)
    assert row["task"] == "edit" and row["model"] == "flux-kontext" and row["http_status"] == 200
    assert row["mask_fraction"] is None
