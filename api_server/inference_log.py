"""Writes one BigQuery row per request from a background thread, so logging never delays a response.

Rows are validated against the schema file first (the emulator accepts bad rows silently), sent in
batches with the request id as insert id (retries do not duplicate), retried with backoff, and, if
BigQuery stays unreachable, written to the log as ERROR entries with the full row: never dropped silently.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from google.cloud import bigquery

from contract.log_schema import validate_row

log = logging.getLogger(__name__)


@dataclass
class InferenceLogRow:
    request_id: str
    created_at: datetime
    model: str
    status: str
    http_status: int
    model_version: str | None = None
    task: str | None = None
    error: str | None = None
    api_key_id: str | None = None
    cache_hit: bool | None = None
    num_images: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    seed: int | None = None
    total_ms: float | None = None
    queue_ms: float | None = None
    inference_ms: float | None = None
    worker_id: str | None = None
    api_instance: str | None = None

    def to_json(self) -> dict:
        row = {key: value for key, value in self.__dict__.items() if value is not None}
        row["created_at"] = self.created_at.astimezone(UTC).isoformat()
        return validate_row(row)


class InferenceLogWriter:
    def __init__(
        self,
        client: bigquery.Client,
        table: str,
        flush_interval: float = 0.5,
        max_batch: int = 500,
        max_attempts: int = 5,
    ) -> None:
        self._client = client
        self._table = table
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._max_attempts = max_attempts
        self._queue: queue.Queue[dict] = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inference-log", daemon=True)
        self._thread.start()

    def write(self, row: InferenceLogRow) -> None:
        try:
            self._queue.put(row.to_json())
        except ValueError:
            log.exception("invalid inference log row %s", row.request_id)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._stopped.wait(self._flush_interval)
            self.flush()

    def flush(self) -> None:
        while True:
            batch: list[dict] = []
            while len(batch) < self._max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                return
            self._send(batch)

    def _send(self, rows: list[dict]) -> None:
        delay = 0.5
        for attempt in range(1, self._max_attempts + 1):
            try:
                errors = self._client.insert_rows_json(
                    self._table, rows, row_ids=[r["request_id"] for r in rows], timeout=10
                )
                if not errors:
                    return
                log.error("BigQuery rejected rows: %s", errors)
                break
            except Exception as exc:  # noqa: BLE001 - transport errors of any kind are retried
                log.warning("inference log insert attempt %d failed: %s", attempt, exc)
                if attempt < self._max_attempts and not self._stopped.is_set():
                    time.sleep(delay)
                    delay *= 2
        for row in rows:
            log.error(
                "inference log row not written to BigQuery", extra={"fields": {"inference_log_row": json.dumps(row)}}
            )

    def close(self) -> None:
        """Stop the thread and flush what is queued: called on SIGTERM (gunicorn worker exit)."""
        self._stopped.set()
        self._thread.join(timeout=5)
        self.flush()
