"""Control models on the worker: loaded from the model bucket on a background thread into a host-memory LRU sized
in bytes, beside the adapter cache (`model_worker/adapters/loader.py`) and in its pattern.

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
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
class ControlSet:
    """One request's control models: ready when all are loaded or one failed (`error`)."""

    refs: tuple
    loaded: list[ControlWeights] = field(default_factory=list)
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ready(self) -> bool:
        return self.done.is_set()

    def weights(self) -> list[ControlWeights]:
        """What the denoiser runs, in the request's order; raises (ValueError: the request fails alone) when a load
        failed."""
        if self.error is not None:
            raise ValueError(f"control model could not be loaded: {self.error}")
        return self.loaded


CacheKey = tuple[str, str, str, str]


def _cache_key(spec: ModelSpec, ref: ControlVersion) -> CacheKey:
    return spec.queue, ref.name, ref.version, ref.sha256


class ControlLoader:
    """One background thread downloading, checking and building control models into one LRU bounded in bytes."""

    def __init__(
        self,
        bucket,
        weights_dirs: dict[str, Path],
        on_ready: Callable[[], None],
        host_cache_bytes: int = CONTROL_HOST_CACHE_BYTES,
    ) -> None:
        self._bucket = bucket
        self._weights_dirs = weights_dirs
        self._on_ready = on_ready
        self._host_cache_bytes = host_cache_bytes
        self._cache: OrderedDict[CacheKey, ControlWeights] = OrderedDict()
        self._base: dict[str, tuple[dict, dict]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[ModelSpec, ControlSet] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="control-loader", daemon=True)
        self.loads = 0  # versions read from the bucket (cache misses)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(weights.nbytes for weights in self._cache.values())

    def cached(self, spec: ModelSpec) -> list[tuple[str, str, str]]:
        """The unit's cached control versions (name, version, digest), least recently used first."""
        with self._lock:
            return [key[1:] for key in self._cache if key[0] == spec.queue]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)

    def request(self, spec: ModelSpec, refs: tuple) -> ControlSet:
        """The request's set: ready at once when every version is cached, else loaded in the background."""
        controls = ControlSet(tuple(refs))
        keys = [_cache_key(spec, ref) for ref in refs]
        with self._lock:
            if all(key in self._cache for key in keys):
                for key in keys:
                    self._cache.move_to_end(key)
                controls.loaded = [self._cache[key] for key in keys]
                controls.done.set()
                return controls
        self._queue.put((spec, controls))
        return controls

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            spec, controls = work
            try:
                controls.loaded = [self._weights(spec, ref) for ref in controls.refs]
            except Exception as exc:  # noqa: BLE001 - the request fails alone; the loader goes on
                log.warning("control models %s for %s could not be loaded: %s", [r.name for r in controls.refs],
                            spec.queue, exc)  # fmt: skip
                controls.error = exc
            controls.done.set()
            self._on_ready()

    def _weights(self, spec: ModelSpec, ref: ControlVersion) -> ControlWeights:
        key = _cache_key(spec, ref)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.perf_counter()
        weights = self._load(spec, ref)
        log.info("control %s %s@%s for %s loaded in %.3fs (%.1f MB)", ref.kind, ref.name, ref.version, spec.queue,
                 time.perf_counter() - started, weights.nbytes / 1e6)  # fmt: skip
        with self._lock:
            self.loads += 1
            if weights.nbytes <= self._host_cache_bytes:
                self._make_room(weights.nbytes)
                self._cache[key] = weights
            else:
                log.warning("control %s@%s (%d bytes) is larger than the host cache (%d bytes): not kept", ref.name,
                            ref.version, weights.nbytes, self._host_cache_bytes)  # fmt: skip
        return weights

    def _make_room(self, nbytes: int) -> None:
        """Drops the least recently used versions until one more of `nbytes` fits (the lock held)."""
        while self._cache and sum(w.nbytes for w in self._cache.values()) + nbytes > self._host_cache_bytes:
            key, weights = self._cache.popitem(last=False)
            log.info("control %s@%s of %s dropped from host memory (least recently used)", weights.name,
                     weights.version, key[0])  # fmt: skip

    def _load(self, spec: ModelSpec, ref: ControlVersion) -> ControlWeights:
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
        with self._lock:  # room before the tensors exist: the cache and this load stay within the budget
            if summary.bytes <= self._host_cache_bytes:
                self._make_room(summary.bytes)
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
