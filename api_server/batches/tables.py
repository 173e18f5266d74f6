"""A BigQuery table as a batch's input, as Vertex AI batch prediction reads one: each row is one line.

A row's columns are a line's fields (`lines.LINE_FIELDS`): `custom_id` and `model` (STRING, required), `instances`
(a JSON array: a JSON column, a STRING column holding its JSON text, or a REPEATED RECORD such as
`ARRAY<STRUCT<prompt STRING>>`) and `parameters` (a JSON object: JSON, STRING of JSON text, or RECORD; optional).
The columns are checked when the batch is submitted (a 422 naming the column); a NULL cell is an absent field. The
batch reads the table as it was when it was submitted: a BigQuery table snapshot taken then, in the service's dataset
(`snapshot_table`), so rows written or changed while it runs change nothing, and a table with no rows is refused
then (a 422), not in the runner. A row is read by its position (`tabledata.list` from a start index, one page at a time, never the whole table), so
the row's 1-based position is its line number and the feeder's cursor is the number of rows read, as a file's is
its byte offset: a resumed reader starts at that row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime

from api_server.batches.lines import LINE_FIELDS, Line
from api_server.core.errors import ApiError

# `bq://project.dataset.table`, as Vertex AI's BigQuery source names a table.
TABLE_URI = re.compile(r"bq://([a-z][a-z0-9-]{0,62})\.([A-Za-z0-9_]{1,1024})\.([A-Za-z0-9_$-]{1,1024})")
# Rows per `tabledata.list` page: a page is what the reader holds (a row may be a few MiB of base64 images).
PAGE_ROWS = 100
REQUIRED_COLUMNS = ("custom_id", "model")
TEXT_COLUMNS = ("custom_id", "model")
# instances: a JSON array; parameters: a JSON object.
JSON_COLUMNS = {"instances": "a JSON array", "parameters": "a JSON object"}


# A batch's snapshot outlives the batch's window by this, then BigQuery drops it (no cleanup to forget).
SNAPSHOT_GRACE_MS = 24 * 3600 * 1000
SNAPSHOT_TIMEOUT_SECONDS = 60


def snapshot_uri(project: str, dataset: str, batch_id: str) -> str:
    """The batch's input snapshot, in the service's own dataset (a table name takes letters, digits, underscores)."""
    return f"bq://{project}.{dataset}.batch_input_{batch_id.replace('-', '_')}"


def snapshot_table(client, uri: str, snapshot: str, expires_ms: int) -> bool:
    """Takes a snapshot of the table as it is now (a copy job with `operation_type=SNAPSHOT`: no storage is copied
    until the table changes) at `snapshot`, dropped by BigQuery at `expires_ms`; whether it holds any row (its
    first row listed: `num_rows` can lag behind recent streaming inserts)."""
    from google.cloud import bigquery

    expires = datetime.fromtimestamp(expires_ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    config = bigquery.CopyJobConfig(operation_type="SNAPSHOT", destination_expiration_time=expires)
    client.copy_table(table_id(uri), table_id(snapshot), job_config=config).result(timeout=SNAPSHOT_TIMEOUT_SECONDS)
    return next(iter(client.list_rows(table_id(snapshot), max_results=1)), None) is not None


def table_id(uri: str) -> str:
    """`bq://p.d.t` as the client's `p.d.t`."""
    return uri.removeprefix("bq://")


def check_columns(schema: Sequence) -> None:
    """The table's columns as a batch line's fields, or a 422 naming the first column that is not one."""
    by_name = {field.name: field for field in schema}
    for name in by_name:
        if name not in LINE_FIELDS:
            raise ApiError(
                422, f"input_table: column {name[:128]} is not a batch line field; expected {', '.join(LINE_FIELDS)}",
                "input_table",
            )  # fmt: skip
    for name in REQUIRED_COLUMNS:
        if name not in by_name:
            raise ApiError(422, f"input_table: the table has no {name} column (a STRING)", "input_table")
    for name in TEXT_COLUMNS:
        field = by_name[name]
        if field.field_type != "STRING" or field.mode == "REPEATED":
            raise ApiError(422, f"input_table: column {name} is {_type(field)}; expected STRING", "input_table")
    for name, shape in JSON_COLUMNS.items():
        field = by_name.get(name)
        if field is None:
            continue
        repeated = field.mode == "REPEATED"
        record = field.field_type in ("RECORD", "STRUCT")
        fits = field.field_type in ("JSON", "STRING") and not repeated
        fits |= record and repeated == (name == "instances")
        if not fits:
            wanted = "ARRAY<STRUCT>" if name == "instances" else "STRUCT"
            raise ApiError(
                422, f"input_table: column {name} is {_type(field)}; expected {shape} (JSON, STRING of JSON text or "
                f"{wanted})", "input_table",
            )  # fmt: skip


def _type(field) -> str:
    return f"ARRAY<{field.field_type}>" if field.mode == "REPEATED" else field.field_type


def row_line(values: Mapping[str, object]) -> tuple[bytes, ApiError | None]:
    """A row as its line's JSON bytes, or the reason it is not a line (the row then is an errors-file line, as an
    invalid JSONL line is). A NULL cell is a field left out; a STRING cell of a JSON column is parsed."""
    line: dict = {}
    for name, value in values.items():
        if value is None:
            continue
        if name in JSON_COLUMNS and isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                error = ApiError(422, f"{name}: the cell is not JSON text ({JSON_COLUMNS[name]})", name)
                return _only_custom_id(values), error
        line[name] = value
    return json.dumps(line, separators=(",", ":"), default=str).encode(), None


def _only_custom_id(values: Mapping[str, object]) -> bytes:
    """The refused row's custom_id alone, so its error line carries it."""
    custom_id = values.get("custom_id")
    return json.dumps({"custom_id": custom_id} if isinstance(custom_id, str) else {}).encode()


def table_lines(rows: Iterator[Mapping[str, object]], start_row: int, max_line_bytes: int) -> Iterator[Line]:
    """The rows from position `start_row` (0-based: rows already read) as lines numbered from `start_row + 1`;
    a line's offsets are row positions (`start_offset` its own, `end_offset` the next's), so a resumed reader
    starts at the cursor's row. A row whose line exceeds the limit is refused as a too-long line is."""
    for number, row in enumerate(rows, start=start_row + 1):
        data, refused = row_line(row)
        if refused is None and len(data) > max_line_bytes:
            data = None  # type: ignore[assignment]
        yield Line(number, number, data, number - 1, refused)


def read_table(client, uri: str, start_row: int, max_line_bytes: int) -> Iterator[Line]:
    """The table's rows from `start_row` through the official client's `list_rows` (tabledata.list), one page of
    `PAGE_ROWS` in memory at a time."""
    table = client.get_table(table_id(uri))
    rows = client.list_rows(table, start_index=start_row, page_size=PAGE_ROWS)
    return table_lines((dict(row.items()) for row in rows), start_row, max_line_bytes)
