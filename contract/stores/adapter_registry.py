"""The LoRA adapter registry, kept in the model bucket: what a request may name, at which version and digest.

An adapter version's file lives under `adapters/{model}/{name}/{version}/`; registering it (the admin call,
or `make up` for the local stack's tiny adapters) checks it (`contract/lora_files.py`) against the base
model's own weights and writes `adapters/{model}/{name}/registration.json`. Catalog-listed adapters
(`adapters.listed`) need no record: they are checked the first time a process resolves them. The bucket
is the one source of truth, so every API instance sees a registration; each keeps what it read for a few
seconds (`REFRESH_SECONDS`), an unknown name for less.
"""

from __future__ import annotations

import hashlib
import threading
import time
from datetime import UTC, datetime
from typing import Literal

from google.api_core import exceptions
from pydantic import BaseModel, ConfigDict

from contract import naming
from contract.lora_files import (
    AdapterFileError,
    base_headers,
    bytes_reader,
    check_file_names,
    check_finite,
    check_targets,
    lora_targets,
    read_header,
)
from contract.model_spec import ModelSpec

REFRESH_SECONDS = 10.0
UNKNOWN_SECONDS = 2.0


class AdapterRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    version: str
    sha256: str
    bytes: int
    rank: int
    targets: int
    source: Literal["registered", "catalog"] = "registered"
    registered_at: str | None = None


class AdapterNotFoundError(Exception):
    """No such adapter version in the bucket."""


class AdapterRegistry:
    def __init__(self, bucket) -> None:
        """`bucket`: the model bucket (a google.cloud.storage Bucket)."""
        self._bucket = bucket
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], tuple[float, AdapterRecord | None]] = {}
        self._base: dict[str, dict[str, dict]] = {}
        # Catalog-listed versions already checked by this process: a version's file is not read twice.
        self._listed: dict[tuple[str, str, str], AdapterRecord] = {}

    def register(self, spec: ModelSpec, name: str, version: str) -> AdapterRecord:
        """Checks the version's file and makes it the adapter's current one; AdapterFileError says why not."""
        record = self.check(spec, name, version, "registered")
        record.registered_at = datetime.now(UTC).isoformat()
        blob = self._bucket.blob(naming.adapter_record(spec.name, name))
        blob.upload_from_string(record.model_dump_json(), content_type="application/json")
        with self._lock:
            self._known[(spec.name, name)] = (time.monotonic() + REFRESH_SECONDS, record)
        return record

    def check(self, spec: ModelSpec, name: str, version: str, source: str = "registered") -> AdapterRecord:
        policy = spec.adapters
        if policy is None:
            raise AdapterFileError(f"{spec.name} takes no adapters (no `adapters` block in the catalog)")
        prefix = naming.adapter_prefix(spec.name, name, version)
        blobs = [blob for blob in self._bucket.client.list_blobs(self._bucket, prefix=prefix)]
        if not blobs:
            raise AdapterNotFoundError(f"nothing under gs://{self._bucket.name}/{prefix}")
        check_file_names([blob.name[len(prefix) :] for blob in blobs])
        blob = blobs[0]
        if blob.size is not None and blob.size > policy.max_bytes:
            raise AdapterFileError(f"{naming.ADAPTER_FILE}: {blob.size} bytes exceeds the limit of {policy.max_bytes}")
        data = blob.download_as_bytes()
        if len(data) > policy.max_bytes:
            raise AdapterFileError(f"{naming.ADAPTER_FILE}: {len(data)} bytes exceeds the limit of {policy.max_bytes}")
        header = read_header(bytes_reader(data), len(data))
        targets = lora_targets(header, spec.family)
        rank = check_targets(targets, self._base_headers(spec), policy.max_rank)
        check_finite(header, data)
        return AdapterRecord(
            name=name,
            version=version,
            sha256=hashlib.sha256(data).hexdigest(),
            bytes=len(data),
            rank=rank,
            targets=len(targets),
            source=source,
        )

    def resolve(self, spec: ModelSpec, name: str) -> AdapterRecord | None:
        """The adapter's current version, or None when it is not registered (nor listed in the catalog)."""
        key = (spec.name, name)
        with self._lock:
            expires, record = self._known.get(key, (0.0, None))
        if time.monotonic() < expires:
            return record
        record = self._read(spec, name)
        with self._lock:
            self._known[key] = (time.monotonic() + (REFRESH_SECONDS if record else UNKNOWN_SECONDS), record)
        return record

    def list(self, spec: ModelSpec) -> list[AdapterRecord]:
        """Registered adapters (records in the bucket) and catalog-listed ones, by name."""
        prefix = naming.model_adapters_prefix(spec.name)
        names = {
            blob.name[len(prefix) :].split("/", 1)[0]
            for blob in self._bucket.client.list_blobs(self._bucket, prefix=prefix)
            if blob.name.endswith("/registration.json")
        }
        names |= set(spec.adapters.listed) if spec.adapters else set()
        records = [self.resolve(spec, name) for name in sorted(names)]
        return [record for record in records if record is not None]

    def _read(self, spec: ModelSpec, name: str) -> AdapterRecord | None:
        try:
            raw = self._bucket.blob(naming.adapter_record(spec.name, name)).download_as_bytes()
        except exceptions.NotFound:
            raw = None
        if raw is not None:
            return AdapterRecord.model_validate_json(raw)
        version = spec.adapters.listed.get(name) if spec.adapters else None
        if version is None:
            return None
        key = (spec.name, name, version)
        if key not in self._listed:
            self._listed[key] = self.check(spec, name, version, "catalog")
        return self._listed[key]

    def _base_headers(self, spec: ModelSpec) -> dict[str, dict]:
        """The base model's safetensors headers per component, read once (ranged reads: no weights downloaded)."""
        with self._lock:
            cached = self._base.get(spec.weights_path)
        if cached is not None:
            return cached
        root = spec.weights_path.rstrip("/")

        def open_file(path: str):
            blob = self._bucket.get_blob(f"{root}/{path}")
            if blob is None:
                return None
            return (lambda start, end: blob.download_as_bytes(start=start, end=end)), blob.size

        headers = base_headers(spec.family.lora_components if spec.family else (), open_file)
        if not headers:
            raise AdapterFileError(f"the base weights of {spec.name} are not in the bucket: nothing to check against")
        with self._lock:
            self._base[spec.weights_path] = headers
        return headers
