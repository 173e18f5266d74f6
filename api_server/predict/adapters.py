"""LoRA adapters on the API side: a request's `parameters.adapters` resolved against the registry (or a 422
naming the field), and the admin registration and listing behind the routes."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions

from api_server.core.errors import ApiError
from contract.generation import (
    ADAPTER_NAME_LENGTH,
    ADAPTER_NAME_PATTERN,
    ADAPTER_VERSION_LENGTH,
    ADAPTER_VERSION_PATTERN,
    AdapterIn,
    AdapterRef,
)
from contract.lora_files import AdapterFileError
from contract.model_spec import ModelSpec
from contract.stores.adapter_registry import AdapterNotFoundError, AdapterRecord, AdapterRegistry

log = logging.getLogger(__name__)
FIELD = "parameters.adapters"


def registered(resolve: Callable[[ModelSpec, str], Any], spec: ModelSpec, name: str, field: str, what: str,
               listing: str) -> Any:  # fmt: skip
    """`resolve(spec, name)`'s record (an adapter's or a control model's registration), or a 422 naming `field` when
    none is registered (the route `GET /v1/models/{model}/{listing}` lists them), a 503 when the registry (the
    model bucket) cannot be read: "{listing} registry", as the routes name it."""
    try:
        record = resolve(spec, name)
    except exceptions.GoogleAPICallError as exc:
        raise ApiError(503, f"{listing.removesuffix('s')} registry unavailable: {type(exc).__name__}") from exc
    if record is None:
        raise ApiError(422, f"{field}: no {what} {name!r} is registered for {spec.name}; "
                       f"GET /v1/models/{spec.name}/{listing} lists them", field)  # fmt: skip
    return record


def check_name(name: str) -> None:
    """A registration's name (an adapter's or a control model's): a bucket path segment, or a 422 naming it."""
    if re.fullmatch(ADAPTER_NAME_PATTERN, name) is None or len(name) > ADAPTER_NAME_LENGTH:
        raise ApiError(422, f"name: {name!r} must match {ADAPTER_NAME_PATTERN} (no '..'), at most "
                       f"{ADAPTER_NAME_LENGTH} characters", "name")  # fmt: skip


def check_version(version: object) -> str:
    """A registration's version (an adapter's or a control model's): a bucket path segment, or a 422 naming it."""
    if (
        not isinstance(version, str)
        or re.fullmatch(ADAPTER_VERSION_PATTERN, version) is None
        or len(version) > ADAPTER_VERSION_LENGTH
    ):
        raise ApiError(422, "version: letters, digits, '_', '-' and single dots between them, at most "
                       f"{ADAPTER_VERSION_LENGTH} characters (no '..')", "version")  # fmt: skip
    return version


class AdapterService:
    def __init__(self, registry: AdapterRegistry) -> None:
        self._registry = registry

    def resolve(self, spec: ModelSpec, requested: list[AdapterIn] | None) -> tuple[AdapterRef, ...]:
        """Each named adapter at its registered version and digest, in the order asked; checked before queueing."""
        if not requested:
            return ()
        policy = spec.adapters
        if policy is None:
            raise ApiError(422, f"{FIELD}: {spec.name} takes no adapters", FIELD)
        if len(requested) > policy.max_adapters_per_request:
            raise ApiError(422, f"{FIELD}: at most {policy.max_adapters_per_request} per request for {spec.name}",
                           FIELD)  # fmt: skip
        resolved = []
        for index, adapter in enumerate(requested):
            field = f"{FIELD}.{index}"
            if not policy.min_scale <= adapter.scale <= policy.max_scale:
                raise ApiError(422, f"{field}.scale: must be between {policy.min_scale} and {policy.max_scale}",
                               f"{field}.scale")  # fmt: skip
            if any(other.name == adapter.name for other in requested[:index]):
                raise ApiError(422, f"{field}.name: {adapter.name!r} is named twice", f"{field}.name")
            record = self._record(spec, adapter.name, field)
            resolved.append(AdapterRef(name=record.name, version=record.version, scale=adapter.scale,
                                       sha256=record.sha256))  # fmt: skip
        return tuple(resolved)

    def _record(self, spec: ModelSpec, name: str, field: str) -> AdapterRecord:
        try:
            return registered(self._registry.resolve, spec, name, f"{field}.name", "adapter", "adapters")
        except (AdapterFileError, AdapterNotFoundError) as exc:  # a catalog-listed adapter whose file is bad
            log.error("catalog-listed adapter %s of %s is unusable: %s", name, spec.name, exc)
            raise ApiError(422, f"{field}.name: adapter {name!r} is unusable: {exc}", f"{field}.name") from exc

    def register(self, spec: ModelSpec, name: str, version: object) -> AdapterRecord:
        check_name(name)
        version = check_version(version)
        try:
            return self._registry.register(spec, name, version)
        except AdapterNotFoundError as exc:
            raise ApiError(422, f"version: {exc}", "version") from exc
        except AdapterFileError as exc:
            raise ApiError(422, f"adapter file of {name}@{version}: {exc}", "file") from exc

    def listing(self, spec: ModelSpec) -> list[AdapterRecord]:
        return self._registry.list(spec)
