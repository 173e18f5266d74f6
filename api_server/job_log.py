"""Writes the inference log rows that outlive their HTTP request: a job's when the job ends, and an orphan's.

An accepted job's partial row waits in Redis with the job (`JobStore.defer_log_row`). Every API process
looks at the unlogged jobs once a second; a job whose reply the worker stored (or whose deadline passed
unanswered) is claimed with ZREM, which succeeds in exactly one process, and its completed row written.
A job is therefore logged once even if the process that accepted it died.

An orphan is a published request whose API process died before writing its row: the row kept with the request
(`contract/inflight.py`) names its process, whose liveness key has lapsed. Once the request ends (the worker's
stored reply, or its deadline), the same loop adopts the row (one ZREM, in exactly one process; the owner's own
write claims it the same way) and writes it with the inference's outcome and `http_status` 0: nobody was answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from api_server.inference_log import InferenceLogRow, InferenceLogWriter
from api_server.jobs import EXPIRY_GRACE_MS, JobStore, reply_outcome
from contract.inflight import InflightStore
from contract.messages import InferenceReply
from contract.outcomes import Outcome
from contract.results import ResultStore

log = logging.getLogger(__name__)


# The `http_status` of an orphan's row: its API process died before answering anything.
NO_ANSWER_HTTP_STATUS = 0


class JobLogFinisher:
    def __init__(
        self,
        jobs: JobStore,
        inference_log: InferenceLogWriter,
        interval: float = 1.0,
        inflight: InflightStore | None = None,
        results: ResultStore | None = None,
        forget_reply_subscription: Callable[[str], object] | None = None,
    ) -> None:
        """`forget_reply_subscription(request_id)`: deletes the per-request reply subscription an orphan leaked."""
        self._jobs = jobs
        self._forget_reply_subscription = forget_reply_subscription
        self._inflight = inflight
        self._results = results
        self._log = inference_log
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self.finish_ended()
                self.finish_orphaned()
            except redis.RedisError as exc:
                log.debug("job log rows wait for Redis: %s", exc)
            except Exception:  # noqa: BLE001 - the next round tries again; a row is never half written
                log.exception("could not write job log rows")

    def finish_ended(self) -> int:
        """Writes the rows of jobs that ended; returns how many."""
        written = 0
        if self._log.closed:
            return 0  # shutting down: another process claims and writes these
        for job_id, row_json, reply in self._jobs.ended_unlogged():
            if self._log.closed or not self._jobs.claim_log_row(job_id):
                continue  # another API process writes this one
            self._log.write(_ended(InferenceLogRow.from_json(row_json), reply))
            written += 1
        return written

    def finish_orphaned(self) -> int:
        """Adopts and writes the rows of ended requests whose API process died; returns how many."""
        if self._inflight is None or self._results is None or self._log.closed:
            return 0
        kept = self._inflight.unlogged()
        alive = self._inflight.alive([item.owner for item in kept])
        now_ms = time.time() * 1000
        written = 0
        for item in kept:
            if item.owner in alive or self._log.closed:
                continue  # its own process writes it
            reply = self._results.get(item.request_id)
            if reply is None and now_ms <= item.deadline_ms + EXPIRY_GRACE_MS:
                continue  # still in flight: a worker or the watchdog answers it by its deadline
            row_json = self._inflight.claim_row(item.request_id)
            if row_json is None:
                continue  # another process adopted it (or its owner wrote it) meanwhile
            row = _ended(InferenceLogRow.from_json(row_json), reply)
            row.http_status = NO_ANSWER_HTTP_STATUS
            if row.endpoint != "job":
                row.total_ms = None  # no response was sent: nothing to time
            log.warning(
                "wrote the log row of request %s: its API process %s died before answering", item.request_id,
                item.owner,
            )  # fmt: skip
            self._log.write(row)
            written += 1
            if row.reply_mode == "per-request" and self._forget_reply_subscription is not None:
                self._forget_reply_subscription(item.request_id)  # nobody waits on it any more
        return written

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _ended(row: InferenceLogRow, reply: InferenceReply | None) -> InferenceLogRow:
    """A kept row completed with the request's end: the worker's reply, or none by the deadline (expired)."""
    outcome = Outcome.EXPIRED if reply is None else reply_outcome(reply)
    if reply is None:
        row.error = "no worker answered before the deadline"
        row.end_job(None)
    else:
        row.record_reply(reply)
        row.end_job(reply.answered_ms)
        if not outcome.answered:
            row.error = (reply.error or reply.status)[:1024]
    row.status = outcome.spec.log_status
    if not outcome.answered:
        row.error_kind = row.error_kind or outcome.spec.error_kind
    return row
