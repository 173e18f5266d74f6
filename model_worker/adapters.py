"""LoRA adapters on the worker: loaded from the model bucket on a background thread into a host-memory LRU.

A request naming adapters gets an `AdapterSet` at intake; the pool holds it back (without holding anyone
else back) until the set is ready, so the device loop never waits for a download: it keeps serving the
others and the request joins once its adapters are in memory. A set holds its own references to the
loaded weights, so an adapter dropped from the cache while a request waits for the device is not loaded
twice for it. Each file is checked again here (its digest against the registration, its header and targets
against the local base weights, and its values for NaN and infinity) before torch loads a tensor (the tensors
are kept as the file has them: diffusers converts the layout when the device loads them); a set that
fails is ready too, and its request fails alone (bad_input, naming the adapter) when the runner refuses it.
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
from contract.catalog import ModelSpec
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

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoraWeights:
    """One adapter version in host memory: the file's tensors as it holds them (any layout diffusers converts),
    handed to diffusers' `load_lora_weights` when the adapter is first put on the device."""

    name: str
    version: str
    tensors: dict
    nbytes: int
    rank: int

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.version


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


class AdapterLoader:
    """One background thread downloading, checking and parsing adapters; an LRU of `host_cache` per model."""

    def __init__(
        self,
        bucket,
        weights_dirs: dict[str, Path],
        on_ready: Callable[[], None],
        observe: Callable[[str, str, float], None] = lambda model, outcome, seconds: None,
        delays: dict[str, float] | None = None,
    ) -> None:
        self._bucket = bucket
        self._weights_dirs = weights_dirs
        self._on_ready = on_ready
        self._observe = observe
        self._delays = dict(delays or {})
        self._cache: dict[str, OrderedDict[tuple[str, str], LoraWeights]] = {}
        self._base: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[ModelSpec, AdapterSet] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="adapter-loader", daemon=True)
        self.loads = 0  # adapters read from the bucket (cache misses)

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
        with self._lock:
            cache = self._cache.setdefault(spec.name, OrderedDict())
            if not all((ref.name, ref.version) in cache for ref in refs):
                return None
            for ref in refs:
                cache.move_to_end((ref.name, ref.version))
            return [(cache[(ref.name, ref.version)], ref.scale) for ref in refs]

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            spec, adapters = work
            try:
                adapters.loaded = [(self._weights(spec, ref), ref.scale) for ref in adapters.refs]
            except Exception as exc:  # noqa: BLE001 - the request fails alone; the loader goes on
                log.warning("adapters %s for %s could not be loaded: %s", [r.name for r in adapters.refs], spec.name,
                            exc)  # fmt: skip
                adapters.error = exc
            adapters.done.set()
            self._on_ready()

    def _weights(self, spec: ModelSpec, ref: AdapterRef) -> LoraWeights:
        key = (ref.name, ref.version)
        with self._lock:
            cache = self._cache.setdefault(spec.name, OrderedDict())
            if key in cache:
                cache.move_to_end(key)
                return cache[key]
        started = time.perf_counter()
        try:
            weights = self._load(spec, ref)
        except Exception:
            self._observe(spec.name, "failed", time.perf_counter() - started)
            raise
        seconds = time.perf_counter() - started
        self._observe(spec.name, "loaded", seconds)
        log.info("adapter %s@%s for %s loaded in %.3fs (%.1f MB)", ref.name, ref.version, spec.name, seconds,
                 weights.nbytes / 1e6)  # fmt: skip
        with self._lock:
            self.loads += 1
            cache[key] = weights
            limit = spec.adapters.host_cache if spec.adapters else 1
            while len(cache) > limit:
                dropped, _ = cache.popitem(last=False)
                log.info("adapter %s@%s dropped from host memory (least recently used)", *dropped)
        return weights

    def _load(self, spec: ModelSpec, ref: AdapterRef) -> LoraWeights:
        policy = spec.adapters
        if policy is None:
            raise AdapterFileError(f"{spec.name} takes no adapters")
        if ref.name in self._delays:
            time.sleep(self._delays.pop(ref.name))  # the test hook: this adapter's first load only
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
            rank = check_targets(lora_targets(header), self._base_headers(spec), policy.max_rank)
            check_finite(header, data)  # also for a version registered before registration checked it
        except AdapterFileError as exc:
            raise AdapterFileError(f"{ref.name}@{ref.version}: {exc}") from exc
        from safetensors.torch import load as load_safetensors

        return LoraWeights(ref.name, ref.version, load_safetensors(data), len(data), rank)

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
