"""The BigQuery emulator answers queries that overlap Storage Write API appends, as BigQuery does.

bqemulator shares one DuckDB connection between its REST handlers and its gRPC threads; DuckDB refuses a
second call on a busy connection ("connection is busy with another call") instead of waiting, so a query
racing an append failed at random (a flaky `make test`), and so could the append. The launcher gives each
gRPC thread a connection of its own (`emulators/bigquery_launcher.py`).
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime

import pytest
from google.cloud import bigquery as bq

from api_server.inference_log.bigquery_write import StorageWriteSink, write_client
from contract.log_schema import bigquery_schema

pytestmark = pytest.mark.stack

APPENDS, ROWS_PER_APPEND = 30, 400


def _rows(batch: int) -> list[dict]:
    now = datetime.now(UTC).isoformat()
    return [
        {"request_id": f"race-{batch}-{i}", "created_at": now, "model": "noop", "status": "ok", "http_status": 200}
        for i in range(ROWS_PER_APPEND)
    ]


def test_queries_racing_appends_are_all_answered(stack, settings, bigquery):
    table_id = f"{settings.project_id}.{settings.dataset}.append_race_{uuid.uuid4().hex[:8]}"
    bigquery.create_table(bq.Table(table_id, schema=bigquery_schema()))
    path = f"projects/{settings.project_id}/datasets/{settings.dataset}/tables/{table_id.rsplit('.', 1)[1]}"
    sink = StorageWriteSink(write_client(settings), path)
    batches = [_rows(batch) for batch in range(APPENDS)]
    append_errors: list[BaseException] = []

    def append_all() -> None:
        stream = sink.open_stream()
        for batch, rows in enumerate(batches):
            try:
                sink.append(rows, stream, batch * ROWS_PER_APPEND)
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                append_errors.append(exc)

    writer = threading.Thread(target=append_all)
    writer.start()
    query_errors: list[str] = []
    queries = 0
    try:
        while writer.is_alive() or queries < 5:
            queries += 1
            try:
                list(bigquery.query(f"SELECT COUNT(*) AS n, MAX(request_id) AS last FROM `{table_id}`").result())
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                query_errors.append(f"{type(exc).__name__}: {exc}"[:300])
    finally:
        writer.join(timeout=120)
    try:
        assert query_errors == [], f"{len(query_errors)} of {queries} queries failed"
        assert append_errors == []
        [row] = bigquery.query(f"SELECT COUNT(*) AS n, COUNT(DISTINCT request_id) AS ids FROM `{table_id}`").result()
        assert (row["n"], row["ids"]) == (APPENDS * ROWS_PER_APPEND, APPENDS * ROWS_PER_APPEND)
    finally:
        bigquery.delete_table(table_id)
