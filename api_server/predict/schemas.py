"""The predict body (Vertex AI / KServe v1: `instances` and `parameters`), validated and resolved against the catalog."""

from __future__ import annotations

import base64
import binascii
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_server.core.errors import ApiError
from api_server.predict.masks import Outpaint
from contract.generation import MAX_SEED, ROLES, GenerationParameters, ImagePromptIn, optional_parameters_model
from contract.images import InputImageError
from contract.images import decode_input_image as decode_image
from contract.model_spec import ModelSpec

__all__ = ["MAX_SEED", "ParametersIn", "PredictBody", "decode_input_image", "parse_body", "resolve_parameters"]


# Strict: `"4"` or `true` for a number is refused, not coerced; NaN and infinities are refused by name.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class InstanceIn(BaseModel):
    model_config = STRICT
    prompt: str = Field(min_length=1, max_length=2000)
    image: str | None = Field(default=None, description="base64 PNG or JPEG, image-to-image, inpaint and edit only")
    mask: str | None = Field(
        default=None,
        description="inpaint models and flows with an inpaint stage: base64 PNG the image's size (a flow that drafts "
        "first: its width x height); white repaints, black keeps, grey in between",
    )


# Every generation parameter, optional (contract/generation.py), and one that is not: `priority` picks the
# queue (only for API keys configured for it), not the image.
ParametersIn = optional_parameters_model(
    "ParametersIn",
    STRICT,
    priority=(
        Literal["high", "normal"] | None,
        Field(default=None, description="high: the high-priority queue (API keys configured for it)"),
    ),
    # IP-Adapters: resolved into the parameters' `controls` (kind ip_adapter) by api_server/predict/controls.py.
    image_prompts=(
        list[ImagePromptIn] | None,
        Field(
            default=None,
            description="image prompts: IP-Adapters registered for the model, each with its "
            "reference image (base64) and scale",
        ),
    ),
    # Inpaint models only: the API pads each image and makes its mask (api_server/predict/masks.py).
    outpaint=(
        Outpaint | None,
        Field(default=None, description="inpaint only: pixels to add on each side; the answer is the larger image"),
    ),
)


class PredictBody(BaseModel):
    model_config = STRICT
    instances: list[InstanceIn] = Field(min_length=1)
    parameters: ParametersIn = Field(default_factory=ParametersIn)
    webhook_url: str | None = Field(
        default=None,
        max_length=2048,
        description="https URL called once when the request ends as a job (signed: X-MaaS-Signature)",
    )
    allow_fallback: bool = Field(
        default=False,
        description="when the model is overloaded (its predicted wait would miss this request's deadline) and its "
        "catalog entry names a fallback model, be answered by that model instead of a 503 (sync predict only; the "
        "response's `model`, `model_version` and `fallback_from` say which answered, and it is billed as that one)",
    )


def parse_body(payload: object) -> PredictBody:
    try:
        return PredictBody.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(422, f"{field}: {_message(first)}", field=field) from exc


def _message(error: dict) -> str:
    """pydantic's message, without the internal class names its type errors carry."""
    if error["type"] in ("model_type", "dict_type", "model_attributes_type"):
        return "must be a JSON object"
    if error["type"] == "finite_number":
        return "must be a finite number"
    return error["msg"]


def resolve_parameters(body: PredictBody, spec: ModelSpec) -> GenerationParameters:
    """Applies the catalog's defaults and enforces its limits; a seed is chosen when none is given."""
    given, defaults, limits = body.parameters, spec.defaults, spec.limits
    if len(body.instances) > spec.max_instances_per_request:
        raise ApiError(
            422, f"instances: at most {spec.max_instances_per_request} per request for {spec.name}", "instances"
        )
    values = {}
    for name, role in ROLES.items():
        if role.sent_as is not None:
            continue  # resolved by its own stage (adapters: api_server/predict/adapters.py)
        value = getattr(given, name)
        values[name] = value if value is not None else getattr(defaults, name, None)
    if values["seed"] is None:
        values["seed"] = secrets.randbelow(MAX_SEED - 64)
    values["step_cache"] = _step_cache(given.step_cache, spec)
    params = GenerationParameters(**values)
    checks = [
        ("parameters.num_inference_steps", params.num_inference_steps, limits.max_inference_steps),
        ("parameters.width", params.width, limits.max_width),
        ("parameters.height", params.height, limits.max_height),
    ]
    for field, value, limit in checks:
        if value > limit:
            raise ApiError(422, f"{field}: at most {limit} for {spec.name}", field)
    _check_family_rules(given, params, spec)
    if params.seed + len(body.instances) - 1 > MAX_SEED:
        raise ApiError(422, f"parameters.seed: seed + instances must stay below {MAX_SEED}", "parameters.seed")
    if spec.takes_strength:
        if params.strength is None or params.strength * params.num_inference_steps < 1:
            raise ApiError(
                422, "parameters.strength: strength x num_inference_steps must be at least 1", "parameters.strength"
            )
    elif given.strength is not None:
        raise ApiError(
            422,
            f"parameters.strength: only for image-to-image and inpaint models, not {spec.task} model {spec.name}",
            "parameters.strength",
        )
    _check_outpaint(given.outpaint, spec)
    for index, instance in enumerate(body.instances):
        if instance.mask is not None and not spec.takes_mask:
            raise ApiError(
                422,
                f"instances.{index}.mask: {spec.name} is {a_task(spec)} model and takes no mask (inpaint models do)",
                f"instances.{index}.mask",
            )
        if spec.needs_image and not instance.image:
            raise ApiError(
                422,
                f"instances.{index}.image: required by {spec.task} model {spec.name}",
                f"instances.{index}.image",
            )
        if spec.takes_mask and given.outpaint is None and instance.mask is None:
            raise ApiError(422, f"instances.{index}.mask: required by {_mask_taker(spec)}", f"instances.{index}.mask")
        if given.outpaint is not None and instance.mask is not None:
            raise ApiError(
                422,
                f"instances.{index}.mask: not with parameters.outpaint, which makes the mask itself",
                f"instances.{index}.mask",
            )
        if spec.task == "text-to-image" and instance.image:
            raise ApiError(
                422,
                f"instances.{index}.image: not accepted by text-to-image model {spec.name}",
                f"instances.{index}.image",
            )
    return params


def _mask_taker(spec: ModelSpec) -> str:
    """What asks for a mask: an inpaint model (or outpainting, which makes one), or a flow's inpaint stages."""
    stages = getattr(spec, "mask_stages", ())  # a flow's (api_server/flows/serving.py FlowModel)
    if stages:
        return f"flow {spec.name}, whose stage {', '.join(stages)} repaints under it"
    return f"inpaint model {spec.name} (or parameters.outpaint)"


def a_task(spec: ModelSpec) -> str:
    """The model's task with its article: "a text-to-image", "an edit"."""
    return ("an " if spec.task[0] in "aeiou" else "a ") + spec.task


def _check_outpaint(outpaint: Outpaint | None, spec: ModelSpec) -> None:
    if outpaint is None:
        return
    if not spec.takes_mask:
        raise ApiError(
            422,
            f"parameters.outpaint: {spec.name} is {a_task(spec)} model; outpainting takes an inpaint model",
            "parameters.outpaint",
        )
    if not (outpaint.left or outpaint.right or outpaint.top or outpaint.bottom):
        raise ApiError(422, "parameters.outpaint: every side is 0, nothing to outpaint", "parameters.outpaint")


def _step_cache(asked: bool | None, spec: ModelSpec) -> bool | None:
    """A request's `step_cache`: False turns the catalog's step cache off for it; True is refused where there is none
    (a request never turns one on). Kept only when it changes something (None otherwise), so a request that asks for
    what it would get anyway has the same cache key."""
    if asked is True and spec.step_cache is None:
        raise ApiError(
            422, f"parameters.step_cache: {spec.name} has no step cache; a request may only turn one off (false)",
            "parameters.step_cache",
        )  # fmt: skip
    return False if asked is False and spec.step_cache is not None else None


def _check_family_rules(given, params: GenerationParameters, spec: ModelSpec) -> None:
    """The model family's own rules (contract/families.py): sizes, and guidance or negative prompts it would ignore."""
    family = spec.family
    if family is None:
        return
    for field, value in (("parameters.width", params.width), ("parameters.height", params.height)):
        if value % family.size_multiple:
            raise ApiError(422, f"{field}: must be a multiple of {family.size_multiple} for {spec.name}", field)
    mode = spec.guidance_mode
    if mode == "none" and given.guidance_scale is not None:
        raise ApiError(
            422,
            f"parameters.guidance_scale: {spec.name} takes no guidance (a distilled model)",
            "parameters.guidance_scale",
        )
    if mode != "cfg" and given.negative_prompt is not None:
        raise ApiError(
            422,
            f"parameters.negative_prompt: {spec.name} has no classifier-free guidance, so it would ignore a negative prompt",
            "parameters.negative_prompt",
        )


def decode_input_image(data: str, field: str, max_pixels: int | None = None) -> bytes:
    """Base64 PNG/JPEG/WebP to bytes, decoded once here so an image any decoder refuses is a 422 naming
    `field`, never a 500 or a worker error (`contract.images`: header size first, so a bomb costs nothing)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(422, f"{field}: not valid base64", field) from exc
    try:
        decode_image(raw, max_pixels)
    except InputImageError as exc:
        raise ApiError(422, f"{field}: {exc}", field) from exc
    return raw
