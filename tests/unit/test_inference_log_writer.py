"""The BigQuery log writer retries, deduplicates by request id, and never drops a row silently."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from api_server.inference_log import InferenceLogRow, InferenceLogWriter


class FlakyBigQuery:
    """A stand-in for bigquery.Client.insert_rows_json that fails a given number of times first."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[list[dict], list[str]]] = []

    def insert_rows_json(self, table, rows, row_ids, timeout):
        self.calls.append((rows, row_ids))
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("bigquery unreachable")
        return []


def row(request_id: str) -> InferenceLogRow:
    return InferenceLogRow(request_id=request_id, created_at=datetime.now(UTC), model="m", status="ok", http_status=200)


def test_rows_are_retried_until_written_with_request_ids_as_insert_ids():
    client = FlakyBigQuery(failures=2)
    writer = InferenceLogWriter(client, "p.d.t", flush_interval=60)
    writer.write(row("a"))
    writer.write(row("b"))
    writer.close()
    assert len(client.calls) == 3
    rows, row_ids = client.calls[-1]
    assert row_ids == ["a", "b"] and [r["request_id"] for r in rows] == ["a", "b"]


def test_rows_that_cannot_be_written_are_logged_in_full(caplog):
    client = FlakyBigQuery(failures=100)
    writer = InferenceLogWriter(client, "p.d.t", flush_interval=60, max_attempts=2)
    writer.write(row("lost-1"))
    with caplog.at_level(logging.ERROR):
        writer.close()
    kept = [r for r in caplog.records if r.getMessage() == "inference log row not written to BigQuery"]
    assert len(kept) == 1 and "lost-1" in kept[0].fields["inference_log_row"]
