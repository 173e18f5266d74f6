"""The control-model registry (ControlNets, IP-Adapters), kept in the model bucket as the adapter registry is.

A control version's files live under `adapters/_controls/{model}/{name}/{version}/` (`contract/naming.py`);
registering it (the admin call, or `make up` for the local stack's tiny ones) checks them against the base model's
own UNet (`contract/control_files.py`) and writes `.../{name}/registration.json` with its kind and digest, which the
worker checks again when it loads the files. The bucket is the one source of truth; each process keeps what it
read for a few seconds, an unknown name for less.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime

from google.api_core import exceptions
from pydantic import BaseModel, ConfigDict

from contract import naming
from contract.control_files import (
    ControlFileError,
    ControlKind,
    base_denoiser_files,
    check_control,
    check_file_names,
    controlnet_blocks,
    image_prompt_shape,
    slots_problem,
    union_modes,
)
from contract.lora_files import read_header
from contract.model_spec import ModelSpec

REFRESH_SECONDS = 10.0
UNKNOWN_SECONDS = 2.0


class ControlRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    kind: ControlKind
    version: str
    sha256: str
    bytes: int
    tensors: int
    # Elements over its tensors (its GPU bytes are these times the serving dtype's size); None in older records.
    parameters: int | None = None
    registered_at: str | None = None
    # A ControlNet Union's number of control modes (contract/control_files.py `union_modes`); None: not a Union.
    modes: int | None = None


class ControlBudgetError(ControlFileError):
    """A version larger than the model's control budget leaves room for (a 413 at registration)."""


def check_budget(spec: ModelSpec, record: ControlRecord, budget: int, where: str) -> None:
    """Refuses a version whose tensors in the serving dtype, `max_controls_per_request` of them at once, exceed the
    model's control budget (contract/memory_plan.py `control_budget`: `budget` bytes, from `where`)."""
    from contract.memory_plan import DTYPE_BYTES

    assert spec.controls is not None and spec.family is not None
    dtype, at_once = spec.family.gpu_dtype, spec.controls.max_controls_per_request
    device = (record.parameters or 0) * DTYPE_BYTES[dtype]
    if device * at_once > budget:
        raise ControlBudgetError(
            f"{record.name}@{record.version} takes {device} bytes on the GPU ({record.parameters} parameters in "
            f"{dtype}); {spec.name} runs up to {at_once} control models at once within its control budget of "
            f"{budget} bytes ({where}): at most {budget // at_once} bytes each"
        )


class ControlNotFoundError(Exception):
    """No such control version in the bucket."""


class ControlRegistry:
    def __init__(self, bucket) -> None:
        """`bucket`: the model bucket (a google.cloud.storage Bucket)."""
        self._bucket = bucket
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], tuple[float, ControlRecord | None]] = {}
        self._base: dict[str, tuple[dict, dict]] = {}

    def register(
        self, spec: ModelSpec, name: str, kind: str, version: str, budget: tuple[int, str] | None = None
    ) -> ControlRecord:
        """Checks the version's files (and, given the model's control budget, its size on the GPU: `check_budget`)
        and makes it the control's current one; ControlFileError says why not."""
        record = self.check(spec, name, kind, version)
        if budget is not None:
            check_budget(spec, record, *budget)
        record.registered_at = datetime.now(UTC).isoformat()
        blob = self._bucket.blob(naming.control_record(spec.name, name))
        blob.upload_from_string(record.model_dump_json(), content_type="application/json")
        with self._lock:
            self._known[(spec.name, name)] = (time.monotonic() + REFRESH_SECONDS, record)
        return record

    def check(self, spec: ModelSpec, name: str, kind: str, version: str) -> ControlRecord:
        policy = spec.controls
        family = spec.family
        if policy is None or family is None:
            raise ControlFileError(f"{spec.name} takes no control models (no `controls` block in the catalog)")
        if kind not in family.controls:
            raise ControlFileError(f"kind: {family.name} models take {', '.join(family.controls)}, not {kind!r}")
        prefix = naming.control_prefix(spec.name, name, version)
        blobs = list(self._bucket.client.list_blobs(self._bucket, prefix=prefix))
        if not blobs:
            raise ControlNotFoundError(f"nothing under gs://{self._bucket.name}/{prefix}")
        check_file_names(kind, [blob.name[len(prefix) :] for blob in blobs])
        total = sum(blob.size or 0 for blob in blobs)
        if total > policy.max_bytes:
            raise ControlFileError(f"{total} bytes exceeds the limit of {policy.max_bytes}")
        files = {blob.name[len(prefix) :]: blob.download_as_bytes() for blob in blobs}
        if sum(len(data) for data in files.values()) > policy.max_bytes:
            raise ControlFileError(f"the files exceed the limit of {policy.max_bytes} bytes")
        base_config, base_header = self._base_unet(spec)
        summary = check_control(kind, files, base_config, base_header)
        slots = spec.image_prompt_slots(spec.compile is not None)
        if kind == "ip_adapter" and slots is not None:  # a compiled model's slots take one shape
            shape = image_prompt_shape(files, base_config)
            if (problem := slots_problem(spec.name, *shape, slots.embedding_width, slots.tokens)) is not None:
                raise ControlFileError(problem)
        from contract.memory_plan import controlnet_depth_problem

        blocks = controlnet_blocks(kind, files)  # a transformer ControlNet's: the plan counts its call up to a depth
        if blocks is not None and (problem := controlnet_depth_problem(spec, blocks)) is not None:
            raise ControlBudgetError(problem)
        return ControlRecord(name=name, kind=kind, version=version, sha256=summary.sha256, bytes=summary.bytes,
                             tensors=summary.tensors, modes=union_modes(kind, files), parameters=summary.parameters)  # fmt: skip

    def resolve(self, spec: ModelSpec, name: str) -> ControlRecord | None:
        """The control's current version, or None when it is not registered for this model."""
        key = (spec.name, name)
        with self._lock:
            expires, record = self._known.get(key, (0.0, None))
        if time.monotonic() < expires:
            return record
        try:
            raw = self._bucket.blob(naming.control_record(spec.name, name)).download_as_bytes()
            record = ControlRecord.model_validate_json(raw)
        except exceptions.NotFound:
            record = None
        with self._lock:
            self._known[key] = (time.monotonic() + (REFRESH_SECONDS if record else UNKNOWN_SECONDS), record)
        return record

    def list(self, spec: ModelSpec) -> list[ControlRecord]:
        """The registered control models of a model, by name."""
        prefix = naming.model_controls_prefix(spec.name)
        names = {
            blob.name[len(prefix) :].split("/", 1)[0]
            for blob in self._bucket.client.list_blobs(self._bucket, prefix=prefix)
            if blob.name.endswith("/registration.json")
        }
        records = [self.resolve(spec, name) for name in sorted(names)]
        return [record for record in records if record is not None]

    def _base_unet(self, spec: ModelSpec) -> tuple[dict, dict]:
        """The base UNet's config and safetensors header, read once (a ranged read: no weights downloaded)."""
        with self._lock:
            cached = self._base.get(spec.weights_path)
        if cached is not None:
            return cached
        root = spec.weights_path.rstrip("/")
        config_file, weights_file = base_denoiser_files(spec.family.name if spec.family else "")
        config_blob = self._bucket.get_blob(f"{root}/{config_file}")
        weights_blob = self._bucket.get_blob(f"{root}/{weights_file}") if weights_file else None
        if config_blob is None or (weights_file and weights_blob is None):
            raise ControlFileError(f"the base denoiser of {spec.name} is not in the bucket: nothing to check against")
        config = json.loads(config_blob.download_as_bytes())
        header: dict = {}
        if weights_blob is not None:  # FLUX.1's transformer: its config alone (contract/control_files.py)
            header = read_header(lambda start, end: weights_blob.download_as_bytes(start=start, end=end),
                                 weights_blob.size, file=f"the base model's {weights_file}")  # fmt: skip
        with self._lock:
            self._base[spec.weights_path] = (config, header)
        return config, header
