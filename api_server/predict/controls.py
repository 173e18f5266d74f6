"""Control models (ControlNets, IP-Adapters) on the API side: the admin registration and the listing behind the
routes, checked as adapters are (`api_server/predict/adapters.py`)."""

from __future__ import annotations

import re

from google.api_core import exceptions

from api_server.core.errors import ApiError
from contract.control_files import CONTROL_KINDS
from contract.generation import (
    ADAPTER_NAME_LENGTH,
    ADAPTER_NAME_PATTERN,
    ADAPTER_VERSION_LENGTH,
    ADAPTER_VERSION_PATTERN,
)
from contract.lora_files import AdapterFileError
from contract.model_spec import ModelSpec
from contract.stores.control_registry import ControlNotFoundError, ControlRecord, ControlRegistry


class ControlService:
    def __init__(self, registry: ControlRegistry) -> None:
        self._registry = registry

    def register(self, spec: ModelSpec, name: str, kind: object, version: object) -> ControlRecord:
        """Checks the version's files against the model's base UNet, then makes it current (or a 422 naming why)."""
        if spec.controls is None:
            raise ApiError(422, f"name: {spec.name} takes no control models", "name")
        # A control's name and version are bucket path segments, spelled as adapters' are.
        if re.fullmatch(ADAPTER_NAME_PATTERN, name) is None or len(name) > ADAPTER_NAME_LENGTH:
            raise ApiError(422, f"name: {name!r} must match {ADAPTER_NAME_PATTERN} (no '..'), at most "
                           f"{ADAPTER_NAME_LENGTH} characters", "name")  # fmt: skip
        if kind not in CONTROL_KINDS:
            raise ApiError(422, f"kind: one of {', '.join(CONTROL_KINDS)}", "kind")
        if (
            not isinstance(version, str)
            or re.fullmatch(ADAPTER_VERSION_PATTERN, version) is None
            or len(version) > ADAPTER_VERSION_LENGTH
        ):
            raise ApiError(422, "version: letters, digits, '_', '-' and single dots between them, at most "
                           f"{ADAPTER_VERSION_LENGTH} characters (no '..')", "version")  # fmt: skip
        try:
            return self._registry.register(spec, name, str(kind), version)
        except ControlNotFoundError as exc:
            raise ApiError(422, f"version: {exc}", "version") from exc
        except AdapterFileError as exc:
            raise ApiError(422, f"control files of {name}@{version}: {exc}", "file") from exc
        except exceptions.GoogleAPICallError as exc:
            raise ApiError(503, f"control registry unavailable: {type(exc).__name__}") from exc

    def listing(self, spec: ModelSpec) -> list[ControlRecord]:
        return self._registry.list(spec) if spec.controls is not None else []
