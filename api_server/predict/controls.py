"""Control models (ControlNets, IP-Adapters) on the API side: a request's `parameters.controls` resolved against the
registry (or a 4xx naming the field, before anything is published), and the admin registration and the listing
behind the routes, checked as adapters are (`api_server/predict/adapters.py`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from google.api_core import exceptions

from api_server.core.errors import ApiError
from api_server.predict.adapters import check_name, check_version, registered
from contract.control_files import CONTROL_KINDS
from contract.generation import (
    ControlIn,
    ControlRef,
    ImagePromptIn,
)
from contract.lora_files import AdapterFileError
from contract.model_spec import ModelSpec
from contract.stores.control_registry import ControlBudgetError, ControlNotFoundError, ControlRecord, ControlRegistry

FIELD = "parameters.controls"
PROMPTS = "parameters.image_prompts"


def check_mode(control: ControlIn, record: ControlRecord, field: str) -> None:
    """A ControlNet Union's `mode`: required, and one of its modes; any other ControlNet takes none (422s naming it)."""
    if record.modes is None:
        if control.mode is not None:
            raise ApiError(422, f"{field}: {record.name!r} is not a ControlNet Union: it takes no mode", field)
        return
    if control.mode is None or control.mode >= record.modes:
        raise ApiError(422, f"{field}: {record.name!r} is a ControlNet Union: its mode must be one of 0 to "
                       f"{record.modes - 1}", field)  # fmt: skip


class ControlService:
    def __init__(
        self, registry: ControlRegistry, budget: Callable[[ModelSpec], tuple[int, str] | None] | None = None
    ) -> None:
        """`budget(spec)`: the model's control budget and where it comes from (contract/memory_plan.py
        `control_budget`), which a registration must fit; None: unchecked."""
        self._registry = registry
        self._budget = budget

    def resolve_all(
        self, spec: ModelSpec, controls: list[ControlIn] | None, image_prompts: list[ImagePromptIn] | None
    ) -> tuple[tuple[ControlRef, ...], list[bytes]]:
        """A request's ControlNets, then its image prompts' IP-Adapters (`resolve`, `resolve_image_prompts`), and
        their images in the same order: what the parameters' `controls` and the message's `control_images` hold."""
        refs, images = self.resolve(spec, controls) if controls else ((), [])
        if image_prompts:
            prompts, prompt_images = self.resolve_image_prompts(spec, image_prompts, len(refs))
            refs, images = refs + prompts, [*images, *prompt_images]
        return refs, images

    def resolve(self, spec: ModelSpec, requested: list[ControlIn]) -> tuple[tuple[ControlRef, ...], list[bytes]]:
        """Each named ControlNet at its registered version and digest, with its control image checked and decoded
        (the images travel beside the parameters); in the order asked."""
        from api_server.predict.schemas import decode_input_image

        policy = spec.controls
        if policy is None:
            family = spec.family.name if spec.family else "synthetic"
            raise ApiError(422, f"{FIELD}: {spec.name} takes no control models ({family} models here serve none)",
                           FIELD)  # fmt: skip
        if len(requested) > policy.max_controls_per_request:
            raise ApiError(422, f"{FIELD}: at most {policy.max_controls_per_request} per request for {spec.name}",
                           FIELD)  # fmt: skip
        refs, images = [], []
        for index, control in enumerate(requested):
            field = f"{FIELD}.{index}"
            if not policy.min_scale <= control.scale <= policy.max_scale:
                raise ApiError(422, f"{field}.scale: must be between {policy.min_scale} and {policy.max_scale}",
                               f"{field}.scale")  # fmt: skip
            if control.start >= control.end:
                raise ApiError(422, f"{field}.start: must be before end ({control.start} >= {control.end})",
                               f"{field}.start")  # fmt: skip
            if control.preprocess == "canny" and control.low_threshold > control.high_threshold:
                raise ApiError(422, f"{field}.low_threshold: exceeds high_threshold", f"{field}.low_threshold")
            if any(other.name == control.name for other in requested[:index]):
                raise ApiError(422, f"{field}.name: {control.name!r} is named twice", f"{field}.name")
            image = decode_input_image(control.image, f"{field}.image", spec.limits.max_input_pixels)
            record = self._record(spec, control.name, f"{field}.name")
            if record.kind != "controlnet":
                raise ApiError(422, f"{field}.name: {control.name!r} is an {record.kind}, not a ControlNet (image "
                               "prompts go in parameters.image_prompts)", f"{field}.name")  # fmt: skip
            check_mode(control, record, f"{field}.mode")
            refs.append(ControlRef(
                name=record.name, kind="controlnet", version=record.version, sha256=record.sha256, scale=control.scale,
                start=control.start, end=control.end, image_sha256=hashlib.sha256(image).hexdigest(),
                preprocess=control.preprocess, low_threshold=control.low_threshold,
                high_threshold=control.high_threshold, mode=control.mode,
            ))  # fmt: skip
            images.append(image)
        return tuple(refs), images

    def resolve_image_prompts(
        self, spec: ModelSpec, requested: list[ImagePromptIn], controls: int
    ) -> tuple[tuple[ControlRef, ...], list[bytes]]:
        """Each named IP-Adapter at its registered version and digest, with its reference image checked and decoded;
        `controls` ControlNets already count against the model's `max_controls_per_request`."""
        from api_server.predict.schemas import decode_input_image

        policy = spec.controls
        if policy is None:
            family = spec.family.name if spec.family else "synthetic"
            raise ApiError(422, f"{PROMPTS}: {spec.name} takes no control models ({family} models here serve none)",
                           PROMPTS)  # fmt: skip
        if spec.family is not None and "ip_adapter" not in spec.family.controls:
            raise ApiError(422, f"{PROMPTS}: {spec.name} takes no image prompts ({spec.family.name} models here serve "
                           f"{', '.join(spec.family.controls)} only)", PROMPTS)  # fmt: skip
        if len(requested) > policy.max_image_prompts_per_request:  # a compiled model has as many IP-Adapter slots
            raise ApiError(422, f"{PROMPTS}: at most {policy.max_image_prompts_per_request} image prompts per request "
                           f"for {spec.name}", PROMPTS)  # fmt: skip
        if controls + len(requested) > policy.max_controls_per_request:
            raise ApiError(422, f"{PROMPTS}: at most {policy.max_controls_per_request} control models per request "
                           f"for {spec.name} (ControlNets and image prompts together)", PROMPTS)  # fmt: skip
        refs, images = [], []
        for index, prompt in enumerate(requested):
            field = f"{PROMPTS}.{index}"
            if not policy.min_scale <= prompt.scale <= policy.max_scale:
                raise ApiError(422, f"{field}.scale: must be between {policy.min_scale} and {policy.max_scale}",
                               f"{field}.scale")  # fmt: skip
            if any(other.name == prompt.name for other in requested[:index]):
                raise ApiError(422, f"{field}.name: {prompt.name!r} is named twice", f"{field}.name")
            image = decode_input_image(prompt.image, f"{field}.image", spec.limits.max_input_pixels)
            record = self._record(spec, prompt.name, f"{field}.name")
            if record.kind != "ip_adapter":
                raise ApiError(422, f"{field}.name: {prompt.name!r} is a {record.kind}, not an IP-Adapter (ControlNets "
                               "go in parameters.controls)", f"{field}.name")  # fmt: skip
            refs.append(ControlRef(name=record.name, kind="ip_adapter", version=record.version, sha256=record.sha256,
                                   scale=prompt.scale, image_sha256=hashlib.sha256(image).hexdigest()))  # fmt: skip
            images.append(image)
        return tuple(refs), images

    def _record(self, spec: ModelSpec, name: str, field: str) -> ControlRecord:
        return registered(self._registry.resolve, spec, name, field, "control model", "controls")

    def register(self, spec: ModelSpec, name: str, kind: object, version: object) -> ControlRecord:
        """Checks the version's files against the model's base UNet, then makes it current (or a 422 naming why)."""
        if spec.controls is None:
            raise ApiError(422, f"name: {spec.name} takes no control models", "name")
        # A control's name and version are bucket path segments, spelled as adapters' are.
        check_name(name)
        if kind not in CONTROL_KINDS:
            raise ApiError(422, f"kind: one of {', '.join(CONTROL_KINDS)}", "kind")
        version = check_version(version)
        try:
            return self._registry.register(spec, name, str(kind), version, self._budget(spec) if self._budget else None)
        except ControlNotFoundError as exc:
            raise ApiError(422, f"version: {exc}", "version") from exc
        except ControlBudgetError as exc:
            raise ApiError(413, f"control files of {name}@{version}: {exc}", "file") from exc
        except AdapterFileError as exc:
            raise ApiError(422, f"control files of {name}@{version}: {exc}", "file") from exc
        except exceptions.GoogleAPICallError as exc:
            raise ApiError(503, f"control registry unavailable: {type(exc).__name__}") from exc

    def listing(self, spec: ModelSpec) -> list[ControlRecord]:
        if spec.controls is None:
            return []
        try:
            return self._registry.list(spec)
        except exceptions.GoogleAPICallError as exc:
            raise ApiError(503, f"control registry unavailable: {type(exc).__name__}") from exc
