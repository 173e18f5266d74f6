"""One BigQuery row per request, written off the request path, never lost silently and never doubled in a view.

A request's row is validated against the schema file (the emulator accepts bad rows silently; a bad row
is logged in full at ERROR and dropped alone), queued in memory, and every `spool_interval` written to
the on-disk spool (`spool.py`). A second thread sends spooled segments in order through the Storage
Write API (`bigquery_write.py`) and deletes each once BigQuery has it; while BigQuery is unreachable the
rows wait on disk and are retried with backoff; on SIGTERM the memory queue is spooled; after a restart
the spool is sent first. A full spool refuses rows loudly (ERROR with the full row, and a counter).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields
from datetime import UTC, datetime

from api_server.inference_log.bigquery_write import RowsRejectedError, StorageWriteSink, StreamLostError
from api_server.inference_log.spool import LogSpool, Segment, SpoolFullError
from contract.log_schema import validate_row
from contract.messages import InferenceReply

log = logging.getLogger(__name__)
SCHEMA_VERSION = 4
MAX_BACKOFF_SECONDS = 10.0


def from_epoch_ms(epoch_ms: int | float | None) -> datetime | None:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, UTC)


@dataclass
class InferenceLogRow:
    request_id: str
    created_at: datetime
    model: str
    status: str
    http_status: int
    job_id: str | None = None
    api_key_id: str | None = None
    model_version: str | None = None
    task: str | None = None
    model_family: str | None = None
    endpoint: str | None = None
    error_kind: str | None = None
    error: str | None = None
    cache_hit: bool | None = None
    coalesced: bool | None = None
    idempotent_replay: bool | None = None
    reply_mode: str | None = None
    priority: str | None = None
    num_images: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    seed: int | None = None
    adapters: str | None = None
    controls: str | None = None
    input_bytes: int | None = None
    output_bytes: int | None = None
    published_at: datetime | None = None
    worker_started_at: datetime | None = None
    worker_finished_at: datetime | None = None
    replied_at: datetime | None = None
    total_ms: float | None = None
    queue_ms: float | None = None
    inference_ms: float | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    worker_id: str | None = None
    accelerator: str | None = None
    attempt: int | None = None
    api_instance: str | None = None
    shadow_of: str | None = None
    fallback_from: str | None = None
    fallback_error: str | None = None
    # Admission refused the model asked for and its fallback answered (api_server/predict/admission.py).
    overload_fallback_from: str | None = None
    # A flow's rows (api_server/flows/rows.py): its own (`flow`, billed) and one per stage that ran (`stage`).
    flow: str | None = None
    stage: str | None = None
    stage_index: int | None = None
    flow_request_id: str | None = None
    gpu_seconds: float | None = None
    batch_job_id: str | None = None
    custom_id: str | None = None
    # An inpaint request's: the share of pixels its masks repaint (mean over its instances).
    mask_fraction: float | None = None
    # The step cache it ran with (its kind) and the steps its images skipped (contract/step_cache.py).
    step_cache: str | None = None
    steps_skipped: int | None = None
    schema_version: int | None = SCHEMA_VERSION

    def record_reply(self, reply: InferenceReply, published_ms: float | None = None) -> None:
        """What only the worker knows: where, when, in which batch and on which try the request ran."""
        self.worker_id, self.accelerator, self.attempt = reply.worker_id or None, reply.accelerator, reply.attempt
        self.batch_id, self.batch_size = reply.batch_id, reply.batch_size or None
        self.steps_skipped = reply.steps_skipped
        self.queue_ms, self.inference_ms = reply.queue_ms, reply.inference_ms
        self.worker_started_at = from_epoch_ms(reply.worker_started_ms)
        self.worker_finished_at = from_epoch_ms(reply.worker_finished_ms)
        self.published_at = from_epoch_ms(published_ms) or self.published_at
        self.replied_at = datetime.now(UTC)
        if reply.error_kind and not self.error_kind:
            self.error_kind = reply.error_kind

    def end_job(self, answered_ms: int | None) -> None:
        """A job's row measures the job, not its 202: `total_ms` from the request's arrival to its result being
        available (the worker's `answered_ms`; for an unanswered job, now, when its expiry is recorded)."""
        ended = from_epoch_ms(answered_ms) or datetime.now(UTC)
        self.replied_at = ended
        self.total_ms = round(max(0.0, (ended - self.created_at).total_seconds() * 1000), 2)

    @classmethod
    def from_json(cls, row: dict) -> InferenceLogRow:
        """The inverse of `to_json` (a row kept in Redis while its job runs)."""
        names = {field.name: field for field in fields(cls)}
        values = {}
        for name, value in row.items():
            if name in names and isinstance(value, str) and "datetime" in str(names[name].type):
                value = datetime.fromisoformat(value)
            values[name] = value
        return cls(**values)

    def to_json(self) -> dict:
        row = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            row[field.name] = value.astimezone(UTC).isoformat() if isinstance(value, datetime) else value
        return validate_row(row)


class InferenceLogWriter:
    def __init__(
        self,
        sink: StorageWriteSink,
        spool: LogSpool,
        spool_interval: float = 0.2,
        max_batch: int = 500,
    ) -> None:
        self._sink = sink
        self._spool = spool
        self._spool_interval = spool_interval
        self._max_batch = max_batch
        self._queue: queue.Queue[dict] = queue.Queue()
        self._stopped = threading.Event()
        self._wake_sender = threading.Event()
        self._spool_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.stats = {"written": 0, "spooled": 0, "invalid": 0, "dropped_spool_full": 0, "rejected": 0}
        self._threads = [
            threading.Thread(target=self._spool_loop, name="inference-log-spool", daemon=True),
            threading.Thread(target=self._send_loop, name="inference-log-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def closed(self) -> bool:
        return self._stopped.is_set()

    def write(self, row: InferenceLogRow) -> None:
        """Never raises and never blocks on I/O: called on the request path (after `close`, it spools at once)."""
        try:
            self._queue.put(row.to_json())
            if self.closed:
                self.spool_queued()  # no thread moves it any more: straight to disk, sent by the next process
        except ValueError as exc:
            self.stats["invalid"] += 1
            log.error(
                "invalid inference log row %s: %s",
                row.request_id,
                exc,
                extra={"fields": {"inference_log_row": json.dumps(row.__dict__, default=str)}},
            )

    def _spool_loop(self) -> None:
        while not self._stopped.wait(self._spool_interval):
            if self.spool_queued():
                self._wake_sender.set()

    def spool_queued(self) -> int:
        """Moves queued rows to disk; returns how many."""
        moved = 0
        with self._spool_lock:
            while True:
                batch = []
                while len(batch) < self._max_batch:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if not batch:
                    return moved
                try:
                    self._spool.append(batch)
                    self.stats["spooled"] += len(batch)
                    moved += len(batch)
                except (SpoolFullError, OSError) as exc:
                    self.stats["dropped_spool_full"] += len(batch)
                    for row in batch:
                        log.error(
                            "inference log row not kept: %s",
                            exc,
                            extra={"fields": {"inference_log_row": json.dumps(row)}},
                        )

    def _send_loop(self) -> None:
        delay = 0.5
        while not self._stopped.is_set():
            self._wake_sender.wait(timeout=1.0)
            self._wake_sender.clear()
            if self._stopped.is_set():
                return
            if self.send_spooled():
                delay = 0.5
            else:
                self._stopped.wait(delay)
                delay = min(delay * 2, MAX_BACKOFF_SECONDS)
                self._wake_sender.set()

    def send_spooled(self, deadline: float | None = None) -> bool:
        """Sends every spooled segment in order; False if BigQuery could not take one (it is retried later)."""
        with self._send_lock:
            for segment in self._spool.pending():
                if deadline is not None and time.monotonic() > deadline:
                    return False
                if not self._send(segment):
                    return False
            return True

    def _send(self, segment: Segment) -> bool:
        rows = segment.rows()
        try:
            if segment.stream_lost():
                rows = self._not_yet_written(segment, rows)
                if not rows:
                    segment.remove()
                    return True
            stream = self._sink.open_stream()
            target = segment.target()
            if target is None:
                target = (stream, self._sink.next_offset)
                segment.set_target(*target)
            self._sink.append(rows, *target)
        except StreamLostError as exc:
            log.warning("inference log stream lost (%s); resending on a new stream", exc)
            if segment.target() and segment.target()[0] == self._sink.stream:
                self._sink.forget_stream()
            segment.mark_stream_lost()
            return False
        except RowsRejectedError as exc:
            self.stats["rejected"] += len(rows)
            for row in rows:
                log.error(
                    "inference log row rejected by BigQuery: %s",
                    exc,
                    extra={"fields": {"inference_log_row": json.dumps(row)}},
                )
            segment.remove()
            return True
        except Exception as exc:  # noqa: BLE001 - unreachable, throttled, timed out: the rows wait on disk
            log.warning("inference log: %d rows wait in the spool: %s", len(rows), type(exc).__name__)
            return False
        segment.remove()
        self.stats["written"] += len(rows)
        return True

    def _not_yet_written(self, segment: Segment, rows: list[dict]) -> list[dict]:
        """The rows of a segment whose stream was lost that the table does not hold: a new stream gets only those,
        so an append committed just before the loss (its answer lost with the stream) is not stored twice."""
        written = self._sink.written_request_ids(rows)
        remaining = [row for row in rows if row["request_id"] not in written]
        if written:
            log.info("inference log: %d of %d rows were written before the stream was lost", len(written), len(rows))
        self.stats["written"] += len(rows) - len(remaining)
        if remaining:
            segment.keep_only(remaining)
        return remaining

    def close(self, send_seconds: float = 5.0) -> None:
        """SIGTERM: spool what is queued, try to send for a few seconds; what is left is sent after a restart."""
        self._stopped.set()
        self._wake_sender.set()
        for thread in self._threads:
            thread.join(timeout=send_seconds)
        self.spool_queued()
        self.send_spooled(deadline=time.monotonic() + send_seconds)
        self._spool.close()
