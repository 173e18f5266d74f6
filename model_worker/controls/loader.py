"""Control models on the worker: loaded from the model bucket on a background thread into a host-memory LRU sized
in bytes, beside the adapter cache (`model_worker/adapters/loader.py`), by the same loader
(`model_worker/host_cache.py`).

A request naming control models gets a `ControlSet` at intake; it is ready when every model is loaded or one
failed, so the device loop never waits for a download. Each version's files are checked again here before torch
reads a tensor: their digest against the registration (the files the API checked), and the same checks against the
local base UNet (`contract/control_files.py`: the safetensors check, shapes, NaN). A ControlNet is built as
diffusers' `ControlNetModel` from its config and tensors; an IP-Adapter keeps its state dict (as `load_ip_adapter`
takes it) and its CLIP image encoder. The cache is keyed by the serving unit and the version's registered digest,
and bounded by `host_cache_bytes` (MAAS_CONTROL_HOST_CACHE_BYTES) for the whole worker, the least recently used
dropped first; a version larger than the whole cache serves its request and is not kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from contract import naming
from contract.control_files import (
    CONTROLNET_CLASSES,
    FILES,
    ControlFileError,
    base_denoiser_files,
    check_control,
    digest,
)
from contract.lora_files import read_header
from contract.model_spec import ModelSpec
from contract.settings import CONTROL_HOST_CACHE_BYTES
from model_worker.host_cache import HostCacheLoader, LoadingSet

log = logging.getLogger(__name__)


class ControlVersion(Protocol):
    """What names a control version: the registry's record, or a request's resolved control."""

    name: str
    kind: str
    version: str
    sha256: str


@dataclass(eq=False)
class ControlWeights:
    """One control version in host memory: a ControlNet (`model`: diffusers' ControlNetModel, on the CPU) or an
    IP-Adapter (`state_dict`: `{"image_proj": ..., "ip_adapter": ...}` as `load_ip_adapter` takes it, and `model`:
    its CLIPVisionModelWithProjection)."""

    name: str
    kind: str
    version: str
    sha256: str
    nbytes: int
    model: Any
    state_dict: dict | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return self.name, self.version, self.sha256


@dataclass(eq=False)
class ControlSet(LoadingSet):
    """One request's control models, each its `ControlWeights`: ready when all are loaded or one failed (`error`)."""

    what: ClassVar[str] = "control model"


class ControlLoader(HostCacheLoader):
    """One background thread downloading, checking and building control models into one LRU bounded in bytes
    (`model_worker/host_cache.py`)."""

    label = "control"
    set_type = ControlSet

    def __init__(
        self,
        bucket,
        weights_dirs: dict[str, Path],
        on_ready: Callable[[], None],
        host_cache_bytes: int = CONTROL_HOST_CACHE_BYTES,
    ) -> None:
        super().__init__(bucket, weights_dirs, on_ready, host_cache_bytes)
        self._base: dict[str, tuple[dict, dict]] = {}

    def load(self, spec: ModelSpec, ref: ControlVersion) -> ControlWeights:
        policy = spec.controls
        if policy is None:
            raise ControlFileError(f"{spec.name} takes no control models")
        if ref.kind not in FILES:
            raise ControlFileError(f"{ref.name}@{ref.version}: unknown kind {ref.kind!r}")
        prefix = naming.control_prefix(spec.name, ref.name, ref.version)
        files = {}
        for name in FILES[ref.kind]:
            blob = self._bucket.get_blob(prefix + name)
            if blob is None:
                raise ControlFileError(f"{ref.name}@{ref.version}: no {name} in the bucket")
            if blob.size is not None and blob.size > policy.max_bytes:
                raise ControlFileError(f"{ref.name}@{ref.version}: {name} exceeds {policy.max_bytes} bytes")
            files[name] = blob.download_as_bytes()
        if digest(files) != ref.sha256:
            raise ControlFileError(f"{ref.name}@{ref.version}: the files changed since they were registered")
        try:
            summary = check_control(ref.kind, files, *self._base_unet(spec))
        except ControlFileError as exc:
            raise ControlFileError(f"{ref.name}@{ref.version}: {exc}") from exc
        self.make_room(spec, summary.bytes)  # before its tensors exist
        model, state_dict = _build(ref.kind, files)
        return ControlWeights(ref.name, ref.kind, ref.version, ref.sha256, summary.bytes, model, state_dict)

    def _base_unet(self, spec: ModelSpec) -> tuple[dict, dict]:
        """The base denoiser's config and safetensors header (a FLUX.1 transformer's config alone: an empty header)."""
        if spec.queue not in self._base:
            root = self._weights_dirs[spec.queue]
            config_file, weights_file = base_denoiser_files(spec.family.name if spec.family else "")
            config = json.loads((root / config_file).read_text())
            header: dict = {}
            if weights_file is not None:
                path = root / weights_file
                with path.open("rb") as handle:

                    def read(start: int, end: int) -> bytes:
                        handle.seek(start)
                        return handle.read(end - start + 1)

                    header = read_header(read, path.stat().st_size)
            self._base[spec.queue] = (config, header)
        return self._base[spec.queue]


def _build(kind: str, files: dict[str, bytes]) -> tuple[Any, dict | None]:
    """The torch objects of a checked version, on the CPU in the file's dtype (the device thread moves them)."""
    from safetensors.torch import load as load_safetensors

    if kind == "controlnet":
        import diffusers

        config = json.loads(files["config.json"])
        # ControlNetModel (SD 1.5, SDXL), ControlNetUnionModel (SDXL) or FluxControlNetModel: the class the checked
        # config names.
        model = getattr(diffusers, CONTROLNET_CLASSES[config["_class_name"]]).from_config(config)
        model.load_state_dict(load_safetensors(files["diffusion_pytorch_model.safetensors"]), strict=True)
        return model.eval(), None
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig.from_dict(json.loads(files["image_encoder/config.json"])))
    encoder.load_state_dict(load_safetensors(files["image_encoder/model.safetensors"]), strict=True)
    tensors = load_safetensors(files["ip_adapter.safetensors"])
    state_dict: dict[str, dict] = {"image_proj": {}, "ip_adapter": {}}
    for name, tensor in tensors.items():
        part, _, rest = name.partition(".")
        state_dict[part][rest] = tensor
    return encoder.eval(), state_dict
