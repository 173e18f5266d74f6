"""The OpenAI Images API (`POST /v1/images/generations`, `POST /v1/images/edits`) in this API's own terms: an OpenAI
body becomes the predict body the serving stage takes, and the serving stage's answer becomes OpenAI's response.

Nothing runs differently: the translated body goes through the same validation, admission, cache, idempotency,
queue and log row as `:predict`. What OpenAI's parameters cannot mean here is refused by name: a `quality` or
`style` other than the default, a transparent background, an output format other than PNG. This service's own
parameters (`seed`, `num_inference_steps`, `guidance_scale`, `negative_prompt`, `strength`) are accepted beside
OpenAI's (the openai client sends them with `extra_body`), so a seeded request is cached as on `:predict`.
Errors take OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the same HTTP statuses.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_server.core.errors import ApiError
from contract.images import InputImageError, decode_input_image

ResponseFormat = Literal["b64_json", "url"]
# OpenAI's own names for what the predict body calls otherwise; a field of the translated body is reported as its
# OpenAI parameter (`parameters.width` -> `size`).
OPENAI_PARAM = {"width": "size", "height": "size", "instances": "n", "prompt": "prompt", "image": "image",
                "mask": "mask"}  # fmt: skip
# The service's own generation parameters an OpenAI body may carry (as `extra_body` fields).
EXTENSIONS = ("seed", "num_inference_steps", "guidance_scale", "negative_prompt", "strength")
SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}
# Every multipart part `/v1/images/edits` takes; a file part is `image` (or `image[]`, as the openai client names
# several) and `mask`.
EDIT_FILE_PARTS = ("image", "image[]", "mask")


class OpenAIImagesParams(BaseModel):
    """The parameters both routes share: OpenAI's, and the service's own extensions."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=128, description="a model of `GET /v1/models`")
    prompt: str = Field(min_length=1, max_length=2000)
    n: int = Field(default=1, ge=1, le=16, description="images to make (at most the model's instances per request)")
    size: str | None = Field(
        default=None,
        description="`WIDTHxHEIGHT` in pixels, or `auto`: the model's default (generations) or the input image's size "
        "(edits)",
    )
    response_format: ResponseFormat = Field(
        default="b64_json", description="`b64_json`: the PNG inline; `url`: a signed URL of the PNG, valid for an hour"
    )
    quality: Literal["auto", "standard"] | None = Field(
        default=None, description="only `auto`/`standard`: the model's own steps decide quality here"
    )
    style: None = Field(default=None, description="not taken: describe the style in the prompt")
    background: Literal["auto", "opaque"] | None = Field(default=None, description="PNGs here are opaque")
    output_format: Literal["png"] | None = Field(default=None, description="PNG only")
    moderation: Literal["auto"] | None = None
    user: str | None = Field(default=None, max_length=256, description="accepted, not used")
    seed: int | None = Field(default=None, description="this service's: the first image's seed (cacheable)")
    num_inference_steps: int | None = Field(default=None, description="this service's: denoising steps")
    guidance_scale: float | None = Field(default=None, description="this service's: guidance")
    negative_prompt: str | None = Field(default=None, description="this service's: what the image should not show")
    strength: float | None = Field(default=None, description="this service's: image-to-image only")


class ImageGenerationBody(OpenAIImagesParams):
    """`POST /v1/images/generations`: a prompt to images, on a text-to-image model."""


class ImageEditForm(OpenAIImagesParams):
    """`POST /v1/images/edits` (multipart/form-data): `image` (a PNG, JPEG or WebP file), an optional `mask` (a PNG
    whose fully transparent pixels mark what to repaint; for an inpaint model) and these fields."""

    image: bytes = Field(description="the input image, a file part")
    mask: bytes | None = Field(default=None, description="a PNG the input image's size; transparent = repaint")


class OpenAIImage(BaseModel):
    b64_json: str | None = Field(default=None, description="the PNG, base64 (`response_format: b64_json`)")
    url: str | None = Field(default=None, description="a signed URL of the PNG (`response_format: url`)")


class OpenAIImagesResponse(BaseModel):
    created: int = Field(description="when it was answered, epoch seconds")
    data: list[OpenAIImage]
    output_format: Literal["png"]
    size: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="`invalid_request_error`, `authentication_error`, `rate_limit_error`, ...")
    param: str | None = Field(description="the parameter at fault, when one is")
    code: str | None = Field(description="a short machine-readable reason, when there is one")


class OpenAIErrorResponse(BaseModel):
    """Every error of the OpenAI-compatible routes: OpenAI's shape, the same HTTP statuses as the rest of the API."""

    error: OpenAIErrorDetail


@dataclass(frozen=True)
class ImagesCall:
    """An OpenAI request translated: the model it names, the predict body to serve and how to answer."""

    model: str
    payload: dict
    response_format: ResponseFormat


def generation_call(payload: object) -> ImagesCall:
    if not isinstance(payload, dict):
        raise ApiError(400, "body must be a JSON object (Content-Type: application/json)")
    body = _validated(ImageGenerationBody, payload, strict=True)
    parameters = _parameters(body)
    if body.size not in (None, "auto"):
        parameters.update(_size(body.size))
    instances = [{"prompt": body.prompt} for _ in range(body.n)]
    return ImagesCall(body.model, {"instances": instances, "parameters": parameters}, body.response_format)


def edit_call(form: dict[str, str], files: dict[str, list[bytes]]) -> ImagesCall:
    """The multipart body's fields (`form`) and file parts (`files`, by part name) as a predict body: without a mask
    the image is an image-to-image or edit model's input; with one, an inpaint model's image and mask."""
    repeated = [name for name, parts in files.items() if len(parts) > 1 and name != "image[]"]
    if repeated:
        raise ApiError(422, f"{repeated[0]}: sent {len(files[repeated[0]])} times; send one", repeated[0])
    images = files.get("image", []) + files.get("image[]", [])
    if not images:
        raise ApiError(422, "image: required (a PNG, JPEG or WebP file part)", "image")
    if len(images) > 1:
        raise ApiError(422, f"image: {len(images)} images sent; the models served here take one", "image")
    image = images[0]
    mask = files["mask"][0] if "mask" in files else None
    values: dict[str, object] = dict(form)
    values.update(image=image, mask=mask)
    body = _validated(ImageEditForm, values, strict=False)
    parameters = _parameters(body)
    if body.size not in (None, "auto"):
        parameters.update(_size(body.size))
    else:  # OpenAI's `auto`: the input image's own size
        width, height = _image_size(image, "image")
        parameters.update(width=width, height=height)
    instance: dict[str, str] = {"prompt": body.prompt, "image": base64.b64encode(image).decode("ascii")}
    if body.mask is not None:
        instance["mask"] = base64.b64encode(repaint_mask(body.mask)).decode("ascii")
    return ImagesCall(body.model, {"instances": [dict(instance) for _ in range(body.n)], "parameters": parameters},
                      body.response_format)  # fmt: skip


def form_values(fields: dict[str, list[str]]) -> dict[str, str]:
    """A multipart body's text fields, each once (a repeated one is refused by name)."""
    for name, values in fields.items():
        if len(values) > 1:
            raise ApiError(422, f"{name}: sent {len(values)} times; send one", name)
    return {name: values[0] for name, values in fields.items()}


def repaint_mask(data: bytes) -> bytes:
    """OpenAI's mask (a PNG whose fully transparent pixels mark what to edit) as this service's: white repaints,
    black keeps. A mask without an alpha channel is taken as this service's own already (white repaints)."""
    from PIL import Image

    try:
        decode_input_image(data)
        with Image.open(io.BytesIO(data)) as opened:
            has_alpha = opened.mode in ("RGBA", "LA", "PA") or (opened.mode == "P" and "transparency" in opened.info)
            if not has_alpha:
                return data
            alpha = opened.convert("RGBA").getchannel("A")
    except InputImageError as exc:
        raise ApiError(422, f"mask: {exc}", "mask") from exc
    white_where_clear = alpha.point(lambda value: 255 if value == 0 else 0).convert("RGB")
    buffer = io.BytesIO()
    white_where_clear.save(buffer, format="PNG")
    return buffer.getvalue()


def images_response(answer_body: bytes, links: list[str] | None) -> dict:
    """A 200 predict answer as OpenAI's images response: each image inline, or by `links` (one per image)."""
    predictions = json.loads(answer_body)["predictions"]
    data = [
        {"url": links[index]} if links is not None else {"b64_json": prediction["image_b64"]}
        for index, prediction in enumerate(predictions)
    ]
    first = predictions[0]
    return {"created": int(time.time()), "data": data, "output_format": "png",
            "size": f"{first['width']}x{first['height']}"}  # fmt: skip


def openai_error(status: int, message: str, field: str | None) -> dict:
    """An error in OpenAI's shape; `field` (the predict body's, or an OpenAI parameter) becomes `param`."""
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = {401: "invalid_api_key", 404: "model_not_found" if "model" in message else "not_found",
            429: "rate_limit_exceeded", 503: "overloaded"}.get(status)  # fmt: skip
    return {"error": {"message": message, "type": error_type, "param": openai_param(field), "code": code}}


def openai_param(field: str | None) -> str | None:
    """`instances.0.image` -> `image`, `parameters.width` -> `size`, `parameters.seed` -> `seed`."""
    if not field:
        return None
    parts = field.split(".")
    if parts[0] == "instances" and len(parts) >= 3:
        name = parts[2]
    elif parts[0] == "parameters" and len(parts) >= 2:
        name = parts[1]
    else:
        name = parts[0]
    return OPENAI_PARAM.get(name, name)


def _validated(model: type[OpenAIImagesParams], values: dict, strict: bool) -> OpenAIImagesParams:
    """`strict` for a JSON body (`"4"` for a number is refused, as on `:predict`); a form's fields are all text."""
    try:
        return model.model_validate(values, strict=strict)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        message = first["msg"] if first["type"] != "extra_forbidden" else "not a parameter these routes take"
        if field == "style":
            message = "not taken here: describe the style in the prompt"
        raise ApiError(422, f"{field}: {message}", field) from exc


def _parameters(body: OpenAIImagesParams) -> dict:
    return {name: getattr(body, name) for name in EXTENSIONS if getattr(body, name) is not None}


def _size(size: str) -> dict[str, int]:
    match = SIZE.match(size)
    if match is None:
        raise ApiError(422, f"size: expected WIDTHxHEIGHT in pixels (e.g. 512x512) or auto, not {size[:40]!r}", "size")
    return {"width": int(match[1]), "height": int(match[2])}


def _image_size(data: bytes, field: str) -> tuple[int, int]:
    try:
        return decode_input_image(data).size
    except InputImageError as exc:
        raise ApiError(422, f"{field}: {exc}", field) from exc
