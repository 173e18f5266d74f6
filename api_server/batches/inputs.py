"""Which `gs://` objects a key may name as a batch's `input_file`: only those under the locations its settings give
it (MAAS_BATCH_INPUTS), never the service's own buckets, and a refusal that reads the same whether the object is
missing, forbidden or outside the key's locations, so the route cannot be used to probe for objects."""

from __future__ import annotations

import re

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from contract.settings import BATCH_INPUT_KEY_ID, EVERY_KEY

URI = re.compile(r"gs://([a-z0-9][a-z0-9._-]{1,220})/(.{1,1024})")


class BatchInputPolicy:
    """Checks an `input_file` against the caller's locations, then that the service can read it."""

    def __init__(self, storage_client, inputs: dict[str, tuple[str, ...]], service_buckets: set[str]) -> None:
        self._storage = storage_client
        self._inputs = inputs
        self._service_buckets = frozenset(service_buckets)

    def locations(self, caller: Caller) -> list[str]:
        """The gs:// prefixes this caller may read batch inputs from (its own, then those of every key)."""
        granted = [*self._inputs.get(caller.digest, ()), *self._inputs.get(EVERY_KEY, ())]
        return [location.replace(BATCH_INPUT_KEY_ID, caller.key_id) for location in granted]

    def check(self, uri: object, caller: Caller) -> str:
        """The URI, if the caller may name it and the object can be read; else the one 422 for every reason."""
        match = URI.fullmatch(uri) if isinstance(uri, str) else None
        if match is None:
            raise ApiError(422, "input_file: a gs://bucket/object URI of a JSONL file", "input_file")
        bucket, name = match[1], match[2]
        if not self._entitled(bucket, name, caller) or not self._readable(bucket, name):
            raise self._refusal(uri, caller)  # type: ignore[arg-type]
        return uri  # type: ignore[return-value]

    def _entitled(self, bucket: str, name: str, caller: Caller) -> bool:
        if bucket in self._service_buckets or any(part in ("", ".", "..") for part in name.split("/")):
            return False
        return any(f"gs://{bucket}/{name}".startswith(location) for location in self.locations(caller))

    def _readable(self, bucket: str, name: str) -> bool:
        try:
            return self._storage.bucket(bucket).get_blob(name) is not None
        except Exception:  # noqa: BLE001 - forbidden, unreachable or missing: one answer for all (no probing)
            return False

    def _refusal(self, uri: str, caller: Caller) -> ApiError:
        locations = self.locations(caller)
        allowed = f"this key's: {', '.join(locations)}" if locations else "none for this key: send the lines inline"
        message = f"input_file: {uri[:300]} is not a readable object in this key's batch input locations ({allowed})"
        return ApiError(422, message, "input_file")
