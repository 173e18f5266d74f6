"""Registered weights (LoRA adapters, control models) loaded from the model bucket on one background thread into one
host-memory LRU, for the adapter and control loaders (`model_worker/adapters/loader.py`,
`model_worker/controls/loader.py`), which say how a version is read and checked.

A request naming some gets a `LoadingSet` at intake; it is ready when every version is loaded or one failed, so the
device loop never waits for a download. The cache is keyed by the serving unit (a model, or one version of it: its
own base weights) and the version's registered digest, and bounded by `host_cache_bytes` for the whole worker (and,
where the loader says, a count per unit), the least recently used dropped first; a version larger than the whole
cache serves its request and is not kept. A load makes room before it builds its tensors (`make_room`), so beside
the cache it holds at most about twice its files.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from contract.model_spec import ModelSpec

log = logging.getLogger(__name__)

# A host-cache entry: the serving unit (its queue name) and the version's name, version and registered digest.
CacheKey = tuple[str, str, str, str]


def cache_key(spec: ModelSpec, ref: Any) -> CacheKey:
    return spec.queue, ref.name, ref.version, ref.sha256


@dataclass(eq=False)
class LoadingSet:
    """One request's versions: ready when all are loaded or one failed (`error`)."""

    # What the versions are, in the message a failed load raises ("adapter could not be loaded: ...").
    what: ClassVar[str] = "weights"
    refs: tuple
    loaded: list = field(default_factory=list)
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ready(self) -> bool:
        return self.done.is_set()

    def weights(self) -> list:
        """What the runner uses, in the request's order; raises (ValueError: the request fails alone) when a load
        failed."""
        if self.error is not None:
            raise ValueError(f"{self.what} could not be loaded: {self.error}")
        return self.loaded


class HostCacheLoader:
    """The background thread and the LRU; a loader gives `load` (read, check and build one version, making room
    first), `entry` (what a set holds for a loaded version and its request's ref) and, if it has one, `unit_limit`."""

    label = "weights"  # in the log lines
    set_type: type[LoadingSet] = LoadingSet

    def __init__(
        self,
        bucket,
        weights_dirs: dict[str, Path],
        on_ready: Callable[[], None],
        host_cache_bytes: int,
        observe: Callable[[str, str, float], None] = lambda model, outcome, seconds: None,
    ) -> None:
        self._bucket = bucket
        self._weights_dirs = weights_dirs
        self._on_ready = on_ready
        self._observe = observe
        self._host_cache_bytes = host_cache_bytes
        self._cache: OrderedDict[CacheKey, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[ModelSpec, LoadingSet] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"{self.label}-loader", daemon=True)
        self.loads = 0  # versions read from the bucket (cache misses)

    # --- what a loader says --------------------------------------------------------------------------------

    def load(self, spec: ModelSpec, ref: Any) -> Any:
        """One version read from the bucket, checked and built (its `nbytes` counted by the cache)."""
        raise NotImplementedError

    def entry(self, weights: Any, ref: Any) -> Any:
        """What a request's set holds for a loaded version: the weights themselves unless the loader says."""
        return weights

    def unit_limit(self, spec: ModelSpec) -> int | None:
        """At most this many versions per serving unit (the catalog's); None: the bytes alone bound the cache."""
        return None

    # --- the cache --------------------------------------------------------------------------------------------

    @property
    def cached_bytes(self) -> int:
        """Bytes of the versions held in the host cache now."""
        with self._lock:
            return sum(weights.nbytes for weights in self._cache.values())

    def cached(self, spec: ModelSpec) -> list[tuple[str, str, str]]:
        """The unit's cached versions (name, version, digest), least recently used first."""
        with self._lock:
            return [key[1:] for key in self._cache if key[0] == spec.queue]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)

    def request(self, spec: ModelSpec, refs: tuple) -> LoadingSet:
        """The request's set: ready at once when every version is cached, else loaded in the background."""
        loading = self.set_type(tuple(refs))
        keys = [cache_key(spec, ref) for ref in refs]
        with self._lock:
            if all(key in self._cache for key in keys):
                for key in keys:
                    self._cache.move_to_end(key)
                loading.loaded = [self.entry(self._cache[key], ref) for key, ref in zip(keys, refs, strict=True)]
                loading.done.set()
                return loading
        self._queue.put((spec, loading))
        return loading

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            spec, loading = work
            try:
                loading.loaded = [self.entry(self._weights(spec, ref), ref) for ref in loading.refs]
            except Exception as exc:  # noqa: BLE001 - the request fails alone; the loader goes on
                log.warning("%s %s for %s could not be loaded: %s", self.label, [r.name for r in loading.refs],
                            spec.queue, exc)  # fmt: skip
                loading.error = exc
            loading.done.set()
            self._on_ready()

    def _weights(self, spec: ModelSpec, ref: Any) -> Any:
        key = cache_key(spec, ref)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.perf_counter()
        try:
            weights = self.load(spec, ref)
        except Exception:
            self._observe(spec.name, "failed", time.perf_counter() - started)
            raise
        seconds = time.perf_counter() - started
        self._observe(spec.name, "loaded", seconds)
        log.info("%s %s@%s for %s loaded in %.3fs (%.1f MB)", self.label, ref.name, ref.version, spec.queue, seconds,
                 weights.nbytes / 1e6)  # fmt: skip
        with self._lock:
            self.loads += 1
            if weights.nbytes <= self._host_cache_bytes:
                self._make_room(spec, weights.nbytes)
                self._cache[key] = weights
            else:  # its request holds it; the next one loads it again
                log.warning("%s %s@%s (%d bytes) is larger than the host cache (%d bytes): not kept", self.label,
                            ref.name, ref.version, weights.nbytes, self._host_cache_bytes)  # fmt: skip
        return weights

    def make_room(self, spec: ModelSpec, nbytes: int) -> None:
        """Room for a version of `nbytes` about to be built, before its tensors exist (a loader's `load` calls it):
        the cache and the load stay within the budget."""
        with self._lock:
            if nbytes <= self._host_cache_bytes:
                self._make_room(spec, nbytes)

    def _make_room(self, spec: ModelSpec, nbytes: int) -> None:
        """Drops the least recently used entries until one more of `nbytes` fits every limit (the lock held)."""
        limit = self.unit_limit(spec)
        while limit is not None and len(unit := [key for key in self._cache if key[0] == spec.queue]) >= limit:
            self._drop(unit[0], "the model's host_cache count")
        while self._cache and sum(w.nbytes for w in self._cache.values()) + nbytes > self._host_cache_bytes:
            self._drop(next(iter(self._cache)), "the worker's host cache bytes")

    def _drop(self, key: CacheKey, limit: str) -> None:
        weights = self._cache.pop(key)
        log.info("%s %s@%s of %s dropped from host memory (least recently used, %s)", self.label, weights.name,
                 weights.version, key[0], limit)  # fmt: skip
