"""LoRA adapters on the worker: loaded from the model bucket on a background thread into a host-memory LRU.

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
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
class AdapterSet:
    """One request's adapters: ready when all are loaded or one failed (`error`)."""

    refs: tuple[AdapterRef, ...]
    loaded: list[tuple[LoraWeights, float]] = field(default_factory=list)
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ready(self) -> bool:
        return self.done.is_set()

    def weights(self) -> list[tuple[LoraWeights, float]]:
        """What the runner applies; raises (ValueError: the request fails alone) when loading failed."""
        if self.error is not None:
            raise ValueError(f"adapter could not be loaded: {self.error}")
        return self.loaded


# A host-cache entry: the serving unit (its queue name) and the adapter's name, version and registered digest.
CacheKey = tuple[str, str, str, str]


def _cache_key(spec: ModelSpec, ref: AdapterRef) -> CacheKey:
    return spec.queue, ref.name, ref.version, ref.sha256


class AdapterLoader:
    """One background thread downloading, checking and parsing adapters into one LRU, bounded per unit by count
    (the catalog's `host_cache`) and for the worker by bytes (`host_cache_bytes`)."""

    def __init__(
        self,
        bucket,
        weights_dirs: dict[str, Path],
        on_ready: Callable[[], None],
        observe: Callable[[str, str, float], None] = lambda model, outcome, seconds: None,
        host_cache_bytes: int = ADAPTER_HOST_CACHE_BYTES,
    ) -> None:
        self._bucket = bucket
        self._weights_dirs = weights_dirs
        self._on_ready = on_ready
        self._observe = observe
        self._host_cache_bytes = host_cache_bytes
        self._cache: OrderedDict[CacheKey, LoraWeights] = OrderedDict()
        self._base: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[ModelSpec, AdapterSet] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="adapter-loader", daemon=True)
        self.loads = 0  # adapters read from the bucket (cache misses)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the adapter files held in the host cache now."""
        with self._lock:
            return sum(weights.nbytes for weights in self._cache.values())

    def cached(self, spec: ModelSpec) -> list[tuple[str, str, str]]:
        """The unit's cached adapters (name, version, digest), least recently used first."""
        with self._lock:
            return [key[1:] for key in self._cache if key[0] == spec.queue]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)

    def request(self, spec: ModelSpec, refs: tuple[AdapterRef, ...]) -> AdapterSet:
        """The request's set: ready at once when every adapter is cached, else loaded in the background."""
        adapters = AdapterSet(refs)
        cached = self._cached(spec, refs)
        if cached is not None:
            adapters.loaded = cached
            adapters.done.set()
        else:
            self._queue.put((spec, adapters))
        return adapters

    def _cached(self, spec: ModelSpec, refs: tuple[AdapterRef, ...]) -> list[tuple[LoraWeights, float]] | None:
        keys = [_cache_key(spec, ref) for ref in refs]
        with self._lock:
            if not all(key in self._cache for key in keys):
                return None
            for key in keys:
                self._cache.move_to_end(key)
            return [(self._cache[key], ref.scale) for key, ref in zip(keys, refs, strict=True)]

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            spec, adapters = work
            try:
                adapters.loaded = [(self._weights(spec, ref), ref.scale) for ref in adapters.refs]
            except Exception as exc:  # noqa: BLE001 - the request fails alone; the loader goes on
                log.warning("adapters %s for %s could not be loaded: %s", [r.name for r in adapters.refs], spec.queue,
                            exc)  # fmt: skip
                adapters.error = exc
            adapters.done.set()
            self._on_ready()

    def _weights(self, spec: ModelSpec, ref: AdapterRef) -> LoraWeights:
        key = _cache_key(spec, ref)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.perf_counter()
        try:
            weights = self._load(spec, ref)
        except Exception:
            self._observe(spec.name, "failed", time.perf_counter() - started)
            raise
        seconds = time.perf_counter() - started
        self._observe(spec.name, "loaded", seconds)
        log.info("adapter %s@%s for %s loaded in %.3fs (%.1f MB)", ref.name, ref.version, spec.queue, seconds,
                 weights.nbytes / 1e6)  # fmt: skip
        with self._lock:
            self.loads += 1
            if weights.nbytes <= self._host_cache_bytes:
                self._make_room(spec, weights.nbytes)
                self._cache[key] = weights
            else:  # its request holds it; the next one loads it again
                log.warning("adapter %s@%s (%d bytes) is larger than the host cache (%d bytes): not kept",
                            ref.name, ref.version, weights.nbytes, self._host_cache_bytes)  # fmt: skip
        return weights

    def _make_room(self, spec: ModelSpec, nbytes: int) -> None:
        """Drops the least recently used entries until one more of `nbytes` fits both limits (the lock held)."""
        limit = spec.adapters.host_cache if spec.adapters else 1
        while (unit := [key for key in self._cache if key[0] == spec.queue]) and len(unit) >= limit:
            self._drop(unit[0], "the model's host_cache count")
        while self._cache and sum(w.nbytes for w in self._cache.values()) + nbytes > self._host_cache_bytes:
            self._drop(next(iter(self._cache)), "the worker's host cache bytes")

    def _drop(self, key: CacheKey, limit: str) -> None:
        weights = self._cache.pop(key)
        log.info("adapter %s@%s of %s dropped from host memory (least recently used, %s)", weights.name,
                 weights.version, key[0], limit)  # fmt: skip

    def _load(self, spec: ModelSpec, ref: AdapterRef) -> LoraWeights:
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

        with self._lock:  # room for its tensors before they exist: the cache and this load stay within the budget
            if len(data) <= self._host_cache_bytes:
                self._make_room(spec, len(data))
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
