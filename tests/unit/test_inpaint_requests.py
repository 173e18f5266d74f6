"""An inpaint request's inputs as the API takes them: masks checked, outpainting made into inpainting, masks in the
message and the cache key; every bad input a 422 naming its field before anything is published."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.predict.cache import cache_key
from api_server.predict.inference import InferenceService
from api_server.predict.masks import Outpaint, outpainted, repaint_fraction
from emulators.stack import local_catalog

CATALOG = local_catalog(test_fixtures=True)
INPAINT = CATALOG.get("sd15-inpaint")
IMG2IMG = CATALOG.get("sd15-img2img")
EDIT = CATALOG.get("flux-kontext")
CALLER = Caller("key-1", "digest-1")


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


IMAGE = png(Image.new("RGB", (64, 48), (200, 80, 40)))


def mask(size=(64, 48), box=(8, 8, 24, 24), fill=255) -> bytes:
    image = Image.new("L", size, 0)
    image.paste(fill, box)
    return png(image)


def prepare(spec, instance: dict, **parameters):
    service = InferenceService(None, None, 900)  # type: ignore[arg-type]
    body = {"instances": [instance], "parameters": {"seed": 1, **parameters}}
    return service.prepare(spec, body, "req-1", CALLER)


def refused(spec, instance: dict, **parameters) -> ApiError:
    with pytest.raises(ApiError) as error:
        prepare(spec, instance, **parameters)
    assert error.value.status == 422
    return error.value


def test_an_inpaint_request_carries_its_mask_and_the_cache_key_tells_masks_apart():
    one = prepare(INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask())})
    other = prepare(INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask(box=(0, 0, 8, 8)))})
    assert one.masks == [mask()] and one.params.strength == 1.0
    assert cache_key(INPAINT, one.params, one.prompts, one.images, one.masks) != cache_key(
        INPAINT, other.params, other.prompts, other.images, other.masks
    )
    plain = prepare(IMG2IMG, {"prompt": "p", "image": b64(IMAGE)}, strength=0.5)
    assert plain.masks == [None]  # and its key is the one it had before masks existed
    assert cache_key(IMG2IMG, plain.params, plain.prompts, plain.images, plain.masks) == cache_key(
        IMG2IMG, plain.params, plain.prompts, plain.images
    )


@pytest.mark.parametrize(
    ("spec", "instance", "parameters", "field", "words"),
    [
        (INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask(size=(32, 32), box=(0, 0, 8, 8)))}, {},
         "instances.0.mask", "not the image's size"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(b"not a png")}, {}, "instances.0.mask",
         "not a PNG"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask(fill=0))}, {}, "instances.0.mask",
         "nothing to repaint"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask(fill=100))}, {}, "instances.0.mask",
         "nothing to repaint"),  # grey below one half: binarized to keep
        (INPAINT, {"prompt": "p", "image": b64(IMAGE)}, {}, "instances.0.mask", "required by inpaint"),
        (INPAINT, {"prompt": "p", "mask": b64(mask())}, {}, "instances.0.image", "required by inpaint"),
        (IMG2IMG, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask())}, {}, "instances.0.mask",
         "image-to-image model"),
        (CATALOG.get("sd15-txt2img"), {"prompt": "p", "mask": b64(mask())}, {}, "instances.0.mask",
         "text-to-image model"),
        (IMG2IMG, {"prompt": "p", "image": b64(IMAGE)}, {"outpaint": {"left": 8}}, "parameters.outpaint",
         "image-to-image model"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE)}, {"outpaint": {}}, "parameters.outpaint", "nothing"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE)}, {"outpaint": {"left": 2000}}, "parameters.outpaint",
         "past the model's"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE)}, {"outpaint": {"left": 4}}, "parameters.outpaint",
         "multiple of 8"),
        (INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask())}, {"outpaint": {"left": 8}},
         "instances.0.mask", "makes the mask"),
        (EDIT, {"prompt": "make it night"}, {}, "instances.0.image", "required by edit model flux-kontext"),
        (EDIT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask())}, {}, "instances.0.mask",
         "flux-kontext is an edit model and takes no mask"),
        (EDIT, {"prompt": "p", "image": b64(IMAGE)}, {"strength": 0.5}, "parameters.strength",
         "not edit model flux-kontext"),
        (EDIT, {"prompt": "p", "image": b64(IMAGE)}, {"outpaint": {"left": 16}}, "parameters.outpaint",
         "flux-kontext is an edit model"),
    ],
)  # fmt: skip
def test_a_bad_inpaint_input_is_a_422_naming_its_field(spec, instance, parameters, field, words):
    error = refused(spec, instance, **parameters)
    assert error.field == field and words in error.message, error.message


def test_outpainting_pads_the_image_and_masks_the_padding_and_the_answer_is_the_larger_image():
    prepared = prepare(INPAINT, {"prompt": "p", "image": b64(IMAGE)}, outpaint={"left": 8, "right": 8, "bottom": 16})
    assert (prepared.params.width, prepared.params.height) == (80, 64)
    padded = np.asarray(Image.open(io.BytesIO(prepared.images[0])))
    made = np.asarray(Image.open(io.BytesIO(prepared.masks[0])))
    assert padded.shape == (64, 80, 3) and made.shape == (64, 80)
    assert (padded[:48, 8:72] == (200, 80, 40)).all()  # the image, where it was
    assert (padded[:, :8] == (200, 80, 40)).all()  # its edge repeated outwards
    assert (made[:48, 8:72] == 0).all() and (made[:, :8] == 255).all() and (made[48:] == 255).all()
    assert repaint_fraction(prepared.masks[0]) == pytest.approx(1 - 64 * 48 / (80 * 64))


def test_outpainted_is_a_pure_function_of_image_and_sides():
    assert outpainted(IMAGE, Outpaint(top=8)) == outpainted(IMAGE, Outpaint(top=8))


def test_an_edit_request_carries_its_image_and_no_strength_and_openais_edit_without_a_mask_reaches_it():
    from api_server.predict.openai_images import edit_call

    prepared = prepare(EDIT, {"prompt": "make it night", "image": b64(IMAGE)})
    assert prepared.images == [IMAGE] and prepared.masks == [None] and prepared.params.strength is None
    assert (prepared.params.num_inference_steps, prepared.params.guidance_scale) == (8, 2.5)  # the local defaults
    call = edit_call({"model": "flux-kontext", "prompt": "make it night", "size": "256x256"}, {"image": [IMAGE]})
    assert call.model == "flux-kontext"
    via_openai = prepare(EDIT, call.payload["instances"][0], **call.payload["parameters"])
    assert via_openai.images == [IMAGE] and (via_openai.params.width, via_openai.params.height) == (256, 256)


def test_a_batch_lines_row_has_its_masks_repainted_share_as_a_predicts_row_has():
    from types import SimpleNamespace

    from api_server.batches.runner import BatchRunner
    from api_server.inference_log.writer import InferenceLogRow

    made = BatchRunner(SimpleNamespace(instance_id="api-1"), *[None] * 9)  # type: ignore[arg-type]
    batch = SimpleNamespace(batch_id="b1", owner="k")
    # A 16x16 box of a 64x48 mask: a twelfth of its pixels repainted.
    inpaint = prepare(INPAINT, {"prompt": "p", "image": b64(IMAGE), "mask": b64(mask())})
    row = InferenceLogRow.from_json(made._row(batch, inpaint, "c1"))  # type: ignore[arg-type]
    assert (row.task, row.endpoint, row.mask_fraction) == ("inpaint", "batch", round(256 / (64 * 48), 4))
    edit = prepare(EDIT, {"prompt": "make it night", "image": b64(IMAGE)})
    assert InferenceLogRow.from_json(made._row(batch, edit, "c2")).mask_fraction is None  # type: ignore[arg-type]
