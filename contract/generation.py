"""The generation parameters, declared once: the wire type the worker reads (`GenerationParameters`) and, per
parameter, its role, from which the API's input model, the catalog's defaults, the log row's parameter
columns and the worker's batch key are derived (and checked by tests/unit/test_generation_parameters.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

MAX_SEED = 2**31 - 1
# A LoRA adapter's name: the last segment of its bucket path (`adapters/{model}/{name}/{version}/`), so never two
# dots in a row (`..` would name another path); at most ADAPTER_NAME_LENGTH characters.
ADAPTER_NAME_PATTERN = r"^[a-z0-9](?:\.?[a-z0-9_-])*$"
ADAPTER_NAME_LENGTH = 63
# An adapter version: a path segment too, the same rule with capitals.
ADAPTER_VERSION_PATTERN = r"^[A-Za-z0-9_-](?:\.?[A-Za-z0-9_-])*$"
ADAPTER_VERSION_LENGTH = 64


class AdapterIn(BaseModel):
    """One LoRA adapter as a client names it: a registered name and a scale (the catalog bounds both)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str = Field(pattern=ADAPTER_NAME_PATTERN, max_length=ADAPTER_NAME_LENGTH)
    scale: float = 1.0


class AdapterRef(BaseModel):
    """An adapter resolved by the API: the registered version and file digest the worker loads and checks.
    Frozen (hashable), so a set of adapters is part of a batch key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    version: str
    scale: float
    sha256: str


class ControlIn(BaseModel):
    """One ControlNet as a client names it: a registered name, its control image (base64, used as given, or
    preprocessed on the worker: `canny` with its thresholds, OpenCV's), its scale and its window (the share of the
    schedule it acts in, from `start` to `end`)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str = Field(pattern=ADAPTER_NAME_PATTERN, max_length=ADAPTER_NAME_LENGTH)
    image: str = Field(min_length=1)
    scale: float = 1.0
    start: float = Field(default=0.0, ge=0.0, le=1.0)
    end: float = Field(default=1.0, ge=0.0, le=1.0)
    preprocess: Literal["canny"] | None = None
    low_threshold: int = Field(default=100, ge=0, le=255)
    high_threshold: int = Field(default=200, ge=0, le=255)
    # A ControlNet Union's control mode: the index its model card numbers (xinsir's SDXL Union: 0 openpose, 1 depth,
    # 2 hed/scribble, 3 canny/lineart, 4 normal, 5 segment; InstantX's FLUX.1 Union: 0 canny, 1 tile, 2 depth, 3 blur,
    # 4 pose, 5 gray, 6 low quality). Only a Union takes one, and it needs one.
    mode: int | None = Field(default=None, ge=0)


class ImagePromptIn(BaseModel):
    """One image prompt as a client names it: a registered IP-Adapter, its reference image (base64) and its scale
    (diffusers' `set_ip_adapter_scale`)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str = Field(pattern=ADAPTER_NAME_PATTERN, max_length=ADAPTER_NAME_LENGTH)
    image: str = Field(min_length=1)
    scale: float = 1.0


class ControlRef(BaseModel):
    """A control model (ControlNet, IP-Adapter) resolved by the API for one request: the registered version and
    digest the worker loads and checks, the request's scale and, for a ControlNet, its window (`start`, `end`: the
    share of the schedule it acts in, diffusers' `control_guidance_start`/`_end`), its control image's digest and
    the preprocessing the worker does (`canny`, with its thresholds). Never part of a batch key: rows with other
    controls share the base model's call."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    kind: Literal["controlnet", "ip_adapter"]
    version: str
    sha256: str
    scale: float
    start: float = 0.0
    end: float = 1.0
    image_sha256: str = ""
    preprocess: Literal["canny"] | None = None
    low_threshold: int = 100
    high_threshold: int = 200
    # A ControlNet Union's control mode (ControlIn.mode); None, left out of the message and the cache key, otherwise.
    mode: int | None = Field(default=None, exclude_if=lambda mode: mode is None)


class GenerationParameters(BaseModel):
    """Parameters resolved by the API: every field is set, defaults already applied."""

    model_config = ConfigDict(extra="forbid")
    seed: int
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    strength: float | None = None
    negative_prompt: str | None = None
    # LoRA adapters, in the order asked; empty: the base model, left out of the message and the cache key
    # (so base requests read exactly as before adapters existed).
    adapters: tuple[AdapterRef, ...] = Field(default=(), exclude_if=lambda adapters: not adapters)
    # Control models (ControlNets, then the image prompts' IP-Adapters: `kind`), in the order asked, their images in
    # the message's `control_images`; empty: left out of the message and the cache key. Never per call: rows with
    # other controls share the base model's call.
    controls: tuple[ControlRef, ...] = Field(default=(), exclude_if=lambda controls: not controls)
    # False: every denoising step in full, where the catalog has a step cache (contract/step_cache.py); None: the
    # catalog's. Left out of the message and the cache key when None.
    step_cache: bool | None = Field(default=None, exclude_if=lambda step_cache: step_cache is None)


@dataclass(frozen=True)
class ParameterRole:
    description: str
    # What a client may send (pydantic constraints of the API's input model); every parameter is optional there.
    accepted: dict[str, Any] = field(default_factory=dict)
    # In the catalog's per-model defaults: "required", "optional", or not there (None).
    default: Literal["required", "optional"] | None = None
    # A column of the inference log row (and of the BigQuery table) of the same name.
    logged: bool = False
    # One value per pipeline call: requests that differ in it cannot share a batch.
    per_call: bool = False
    # What a client sends, when it is not the resolved type (an adapter's name and scale, not its version).
    sent_as: Any = None


ROLES: dict[str, ParameterRole] = {
    "seed": ParameterRole("seed of the first image; image i uses seed + i", {"ge": 0, "le": MAX_SEED}, logged=True),
    "num_inference_steps": ParameterRole(
        "denoising steps", {"ge": 1}, default="required", logged=True, per_call=True
    ),
    "guidance_scale": ParameterRole("classifier-free guidance", {"ge": 0.0, "le": 30.0}, "required", per_call=True),
    "width": ParameterRole("output width in pixels", {"ge": 64, "multiple_of": 8}, "required", True, True),
    "height": ParameterRole("output height in pixels", {"ge": 64, "multiple_of": 8}, "required", True, True),
    "strength": ParameterRole("image-to-image only: how far from the input", {"gt": 0.0, "le": 1.0}, "optional",
                              per_call=True),
    "negative_prompt": ParameterRole("what the image should not show", {"max_length": 2000}),
    # Requests with different adapter sets never share a UNet call (the worker's batch key).
    "adapters": ParameterRole("LoRA adapters registered for the model, each with a scale", per_call=True,
                              sent_as=list[AdapterIn]),
    # Not per call: the worker runs each ControlNet over the rows that use it (model_worker/controls/controlnets.py).
    "controls": ParameterRole("ControlNets registered for the model, each with its control image, scale and window "
                              "(several: multi-ControlNet)", sent_as=list[ControlIn]),
    # Per call: `scheduling: request` runs diffusers' hook, one decision for the whole call.
    "step_cache": ParameterRole("false: run every denoising step in full (the model's step cache off); it is never "
                                "turned on where the model has none", per_call=True),
}  # fmt: skip

LOGGED_PARAMETERS = tuple(name for name, role in ROLES.items() if role.logged)
PER_CALL_PARAMETERS = tuple(name for name, role in ROLES.items() if role.per_call)


def _annotation(name: str) -> Any:
    return GenerationParameters.model_fields[name].annotation


def optional_parameters_model(name: str, config: ConfigDict, **extra: Any) -> type[BaseModel]:
    """The parameters as a client sends them: each optional (the catalog fills in), constrained by its role."""
    fields: dict[str, Any] = {
        parameter: (
            (role.sent_as or _annotation(parameter)) | None,
            Field(default=None, description=role.description, **role.accepted),
        )
        for parameter, role in ROLES.items()
    }
    return create_model(name, __config__=config, **fields, **extra)


def defaults_model(name: str) -> type[BaseModel]:
    """The catalog's per-model defaults: the parameters whose role has a default."""
    fields: dict[str, Any] = {
        parameter: (_annotation(parameter), ... if role.default == "required" else None)
        for parameter, role in ROLES.items()
        if role.default is not None
    }
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)
