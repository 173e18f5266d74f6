"""Malformed input images, generated (`chaos.malformed_images`): the API refuses each with a 422 naming the
field, and the worker's decoder refuses the same ones with a `PayloadError` (a `bad_input` reply), never
another exception."""

from __future__ import annotations

import base64
import contextlib

import pytest

from api_server.core.errors import ApiError
from api_server.predict.schemas import decode_input_image
from chaos.malformed_images import MALFORMED_IMAGES, MAY_BE_ACCEPTED
from contract.payloads import PayloadError
from model_worker.serving.intake import decode_image

FIELD = "instances.0.image"
MAX_PIXELS = 4_194_304


@pytest.mark.parametrize("name", sorted(MALFORMED_IMAGES))
def test_the_api_answers_a_malformed_image_with_a_422_naming_the_field(name):
    data = base64.b64encode(MALFORMED_IMAGES[name]()).decode()
    if name in MAY_BE_ACCEPTED:
        try:
            decode_input_image(data, FIELD, MAX_PIXELS)
        except ApiError as error:
            assert (error.status, error.field) == (422, FIELD)
        return
    with pytest.raises(ApiError) as caught:
        decode_input_image(data, FIELD, MAX_PIXELS)
    assert (caught.value.status, caught.value.field) == (422, FIELD)
    assert caught.value.message.startswith(f"{FIELD}: ")
    assert " object at " not in caught.value.message  # nothing of the decoder's internals


@pytest.mark.parametrize("name", sorted(MALFORMED_IMAGES))
def test_the_worker_refuses_the_same_images_as_bad_input(name):
    data = MALFORMED_IMAGES[name]()
    if name in MAY_BE_ACCEPTED:
        with contextlib.suppress(PayloadError):
            assert decode_image(data, MAX_PIXELS).mode == "RGB"
        return
    with pytest.raises(PayloadError, match="^input image: "):
        decode_image(data, MAX_PIXELS)


def test_a_text_chunk_inflating_past_the_limit_is_named_in_the_error():
    data = base64.b64encode(MALFORMED_IMAGES["png: zTXt inflating past the text limit, before IDAT"]()).decode()
    with pytest.raises(ApiError, match="Decompressed data too large"):
        decode_input_image(data, FIELD, MAX_PIXELS)


def test_a_still_image_is_decoded_to_rgb_on_both_sides():
    from tests.conftest import png_b64

    data = png_b64(16, 24)
    assert decode_input_image(data, FIELD, MAX_PIXELS) == base64.b64decode(data)
    assert decode_image(base64.b64decode(data), MAX_PIXELS).size == (16, 24)
