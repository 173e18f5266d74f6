"""Which `gs://` objects a key may name as a batch's `input_file` or as a line's image, and which `bq://` tables as its
`input_table`: only those under the locations its settings give it (MAAS_BATCH_INPUTS), never the service's own
buckets or datasets, and a refusal that reads the same whether the object or table is missing, forbidden or outside
the key's locations, so the route cannot be used to probe for them."""

from __future__ import annotations

import re

from google.api_core import exceptions

from api_server.batches.tables import (
    SNAPSHOT_GRACE_MS,
    TABLE_URI,
    check_columns,
    snapshot_table,
    snapshot_uri,
    table_id,
)
from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from contract.settings import BATCH_INPUT_KEY_ID, EVERY_KEY

URI = re.compile(r"gs://([a-z0-9][a-z0-9._-]{1,220})/(.{1,1024})")


class BatchInputPolicy:
    """Checks an `input_file` or `input_table` against the caller's locations, then that the service can read it."""

    def __init__(
        self,
        storage_client,
        inputs: dict[str, tuple[str, ...]],
        service_buckets: set[str],
        bigquery_client=None,
        service_datasets: set[str] = frozenset(),
    ) -> None:
        self._storage = storage_client
        self._inputs = inputs
        self._service_buckets = frozenset(service_buckets)
        self._bigquery = bigquery_client
        self._service_datasets = frozenset(service_datasets)

    def locations(self, caller: Caller, scheme: str = "gs://") -> list[str]:
        """The gs:// (or bq://) prefixes this caller may read batch inputs from (its own, then those of every key)."""
        granted = [*self._inputs.get(caller.digest, ()), *self._inputs.get(EVERY_KEY, ())]
        return [location.replace(BATCH_INPUT_KEY_ID, caller.key_id) for location in granted if location[:5] == scheme]

    def check(self, uri: object, caller: Caller) -> str:
        """The URI, if the caller may name it and the object can be read; else the one 422 for every reason."""
        match = URI.fullmatch(uri) if isinstance(uri, str) else None
        if match is None:
            raise ApiError(422, "input_file: a gs://bucket/object URI of a JSONL file", "input_file")
        bucket, name = match[1], match[2]
        if not self._entitled(bucket, name, caller) or not self._readable(bucket, name):
            raise self._refusal(uri, caller)  # type: ignore[arg-type]
        return uri  # type: ignore[return-value]

    def read_image(self, caller: Caller, uri: str, field: str, max_bytes: int) -> bytes:
        """A line's image named by URI (`lines.inline_images`): its bytes, if the caller may name it and the service can
        read it (else the one 422 for every reason, naming `field`), and it is at most `max_bytes` (else a 413). GCS
        failing for a reason of its own (a 5xx, unreachable) raises as it is: the line is read again at the next step
        (`runner.py`), not refused."""
        match = URI.fullmatch(uri)
        if match is None:
            raise ApiError(422, f"{field}: base64 image data or a gs://bucket/object URI", field)
        bucket, name = match[1], match[2]
        blob, data = None, None
        if self._entitled(bucket, name, caller):
            try:
                blob = self._storage.bucket(bucket).get_blob(name)
                if blob is not None and (blob.size or 0) <= max_bytes:
                    data = blob.download_as_bytes()
            except exceptions.ClientError:  # forbidden, missing bucket, bad name: one answer for all (no probing)
                blob = None
        if blob is None:
            raise self._refusal(uri, caller, field)
        if data is None or len(data) > max_bytes:
            size = blob.size if data is None else len(data)
            raise ApiError(413, f"{field}: {uri[:300]} is {size} bytes, past the {max_bytes} left for this line's "
                                "images (the line with its images inline, as base64, is limited by "
                                "MAAS_MAX_REQUEST_BYTES)", field)  # fmt: skip
        return data

    def _entitled(self, bucket: str, name: str, caller: Caller) -> bool:
        if bucket in self._service_buckets or any(part in ("", ".", "..") for part in name.split("/")):
            return False
        return any(f"gs://{bucket}/{name}".startswith(location) for location in self.locations(caller))

    def _readable(self, bucket: str, name: str) -> bool:
        try:
            return self._storage.bucket(bucket).get_blob(name) is not None
        except Exception:  # noqa: BLE001 - forbidden, unreachable or missing: one answer for all (no probing)
            return False

    def check_table(self, uri: object, caller: Caller) -> str:
        """The `bq://project.dataset.table` URI, if the caller may name it and it is a table the service can read
        (else the one 422 for every reason), whose columns are a batch line's (else a 422 naming the column: the
        caller may read the table, so its columns are no secret)."""
        match = TABLE_URI.fullmatch(uri) if isinstance(uri, str) else None
        if match is None:
            raise ApiError(422, "input_table: a bq://project.dataset.table URI of a BigQuery table", "input_table")
        entitled = f"{match[1]}.{match[2]}" not in self._service_datasets and any(
            uri.startswith(location) for location in self.locations(caller, "bq://")
        )
        table = self._table(uri) if entitled else None  # type: ignore[arg-type]
        if table is None:
            locations = self.locations(caller, "bq://")
            allowed = f"this key's: {', '.join(locations)}" if locations else "none for this key"
            message = (
                f"input_table: {uri[:300]} is not a readable table in this key's batch input locations ({allowed})"
            )
            raise ApiError(422, message, "input_table")
        if table.table_type not in (None, "TABLE", "SNAPSHOT"):  # a view or an external table has no rows to list
            raise ApiError(422, f"input_table: {uri[:300]} is a {table.table_type}; name a table", "input_table")
        check_columns(table.schema)
        return uri  # type: ignore[return-value]

    def snapshot(self, uri: str, batch_id: str, expires_ms: int) -> str:
        """The table as it is now, for the batch to read (`tables.snapshot_table`): its snapshot's bq:// URI; a 422
        when it holds no rows, a 503 when the snapshot cannot be taken."""
        project, dataset = next(iter(sorted(self._service_datasets))).split(".")
        snapshot = snapshot_uri(project, dataset, batch_id)
        try:
            has_rows = snapshot_table(self._bigquery, uri, snapshot, expires_ms + SNAPSHOT_GRACE_MS)
        except Exception as exc:  # noqa: BLE001 - the caller's table was readable a moment ago: the service's trouble
            raise ApiError(503, f"input_table: the table's snapshot could not be taken ({type(exc).__name__}); "
                           "submit again", "input_table", headers={"Retry-After": "10"}) from exc  # fmt: skip
        if not has_rows:
            self._bigquery.delete_table(table_id(snapshot), not_found_ok=True)
            raise ApiError(422, f"input_table: {uri[:300]} holds no rows", "input_table")
        return snapshot

    def _table(self, uri: str):
        if self._bigquery is None:
            return None
        try:
            return self._bigquery.get_table(table_id(uri))
        except Exception:  # noqa: BLE001 - forbidden, unreachable or missing: one answer for all (no probing)
            return None

    def _refusal(self, uri: str, caller: Caller, field: str = "input_file") -> ApiError:
        locations = self.locations(caller)
        inline = "the lines" if field == "input_file" else "the image"
        allowed = f"this key's: {', '.join(locations)}" if locations else f"none for this key: send {inline} inline"
        message = f"{field}: {uri[:300]} is not a readable object in this key's batch input locations ({allowed})"
        return ApiError(422, message, field)
