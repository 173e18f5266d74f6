"""LoRA adapters on the worker: loaded from the model bucket on a background thread into a host-memory LRU (the loader
the control models use too: `model_worker/host_cache.py`).

A request naming adapters gets an `AdapterSet` at intake; the pool holds it back (without holding anyone
else back) until the set is ready, so the device loop never waits for a download: it keeps serving the
others and the request joins once its adapters are in memory. A set holds its own references to the
loaded weights, so an adapter dropped from the cache while a request waits for the device is not loaded
twice for it. Each file is checked again here (its digest against the registration, its header and targets
against the local base weights, and its values for NaN and infinity) before torch loads a tensor (the tensors
are kept as the file has them: diffusers converts the layout when the device loads them); a set that
fails is ready too, and its request fails alone (bad_input, naming the adapter) when the runner refuses it.

The cache is keyed by the serving unit (a model, or one version of it: its own base weights) and the file's
SHA-256 as registered: a version re-registered with another file is another entry, never the old tensors, and an
adapter checked against one version's base is checked again against another's. It is bounded twice: at most
`host_cache` adapters per unit (the catalog's), and at most `host_cache_bytes` of files for the whole worker
(MAAS_ADAPTER_HOST_CACHE_BYTES), the least recently used dropped first. A load makes room before it parses the
file, so beside the cache it holds at most about twice its file (the download, then the file and its tensors).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from contract import naming
from contract.generation import AdapterRef
from contract.lora_files import (
    AdapterFileError,
    base_headers,
    bytes_reader,
    check_finite,
    check_targets,
    lora_targets,
    read_header,
)
from contract.model_spec import ModelSpec
from contract.settings import ADAPTER_HOST_CACHE_BYTES
from model_worker.host_cache import HostCacheLoader, LoadingSet

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoraWeights:
    """One adapter version in host memory: the file's tensors as it holds them (any layout diffusers converts),
    handed to diffusers' `load_lora_weights` when the adapter is first put on the device."""

    name: str
    version: str
    sha256: str
    tensors: dict
    nbytes: int
    rank: int

    @property
    def key(self) -> tuple[str, str, str]:
        """What the device keeps it under: the file's digest with its name, so that a version re-registered with
        another file is another adapter there too (`lora.py`)."""
        return self.name, self.version, self.sha256


@dataclass(eq=False)
class AdapterSet(LoadingSet):
    """One request's adapters, each `(weights, scale)`: ready when all are loaded or one failed (`error`)."""

    what: ClassVar[str] = "adapter"


class AdapterLoader(HostCacheLoader):
    """One background thread downloading, checking and parsing adapters into one LRU (`model_worker/host_cache.py`),
    bounded per unit by count (the catalog's `host_cache`) and for the worker by bytes (`host_cache_bytes`)."""

    label = "adapter"
    set_type = AdapterSet

    def __init__(
        self,
        bucket,
        weights_dirs: dict[str, Path],
        on_ready: Callable[[], None],
        observe: Callable[[str, str, float], None] = lambda model, outcome, seconds: None,
        host_cache_bytes: int = ADAPTER_HOST_CACHE_BYTES,
    ) -> None:
        super().__init__(bucket, weights_dirs, on_ready, host_cache_bytes, observe)
        self._base: dict[str, dict] = {}

    def entry(self, weights: LoraWeights, ref: AdapterRef) -> tuple[LoraWeights, float]:
        return weights, ref.scale

    def unit_limit(self, spec: ModelSpec) -> int | None:
        return spec.adapters.host_cache if spec.adapters else 1

    def load(self, spec: ModelSpec, ref: AdapterRef) -> LoraWeights:
        policy = spec.adapters
        if policy is None:
            raise AdapterFileError(f"{spec.name} takes no adapters")
        blob = self._bucket.get_blob(naming.adapter_prefix(spec.name, ref.name, ref.version) + naming.ADAPTER_FILE)
        if blob is None:
            raise AdapterFileError(f"{ref.name}@{ref.version}: no {naming.ADAPTER_FILE} in the bucket")
        if blob.size > policy.max_bytes:
            raise AdapterFileError(f"{ref.name}@{ref.version}: {blob.size} bytes exceeds {policy.max_bytes}")
        data = blob.download_as_bytes()
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise AdapterFileError(f"{ref.name}@{ref.version}: the file changed since it was registered")
        try:
            header = read_header(bytes_reader(data), len(data))
            rank = check_targets(lora_targets(header, spec.family), self._base_headers(spec), policy.max_rank)
            check_finite(header, data)  # also for a version registered before registration checked it
        except AdapterFileError as exc:
            raise AdapterFileError(f"{ref.name}@{ref.version}: {exc}") from exc
        from safetensors.torch import load as load_safetensors

        self.make_room(spec, len(data))  # before its tensors exist
        return LoraWeights(ref.name, ref.version, ref.sha256, load_safetensors(data), len(data), rank)

    def _base_headers(self, spec: ModelSpec) -> dict:
        if spec.queue not in self._base:
            components = spec.family.lora_components if spec.family else ()
            self._base[spec.queue] = base_headers(components, _file_opener(self._weights_dirs[spec.queue]))
        return self._base[spec.queue]


def _file_opener(root: Path):
    """Reads the local base weights' headers (a few kB of each file, never the weights)."""

    def open_file(path: str):
        file = root / path
        if not file.is_file():
            return None

        def read(start: int, end: int) -> bytes:
            with file.open("rb") as handle:
                handle.seek(start)
                return handle.read(end - start + 1)

        return read, file.stat().st_size

    return open_file
