"""Writes a job's inference log row when the job ends, not when it is accepted, so the row carries the outcome.

An accepted job's partial row waits in Redis with the job (`JobStore.defer_log_row`). Every API process
looks at the unlogged jobs once a second; a job whose reply the worker stored (or whose deadline passed
unanswered) is claimed with ZREM, which succeeds in exactly one process, and its completed row written.
A job is therefore logged once even if the process that accepted it died. The one process that writes a
submitted job's row also hands its outcome and latency to the rollback guard (`rollouts.py`), so a canary
failing only through jobs is rolled back like one failing sync calls.
"""

from __future__ import annotations

import logging
import threading

import redis

from api_server.inference_log import InferenceLogRow, InferenceLogWriter
from api_server.jobs import JobStore, reply_outcome
from api_server.rollouts import RolloutObservations
from contract.outcomes import Outcome

log = logging.getLogger(__name__)


class JobLogFinisher:
    def __init__(
        self,
        jobs: JobStore,
        inference_log: InferenceLogWriter,
        interval: float = 1.0,
        observations: RolloutObservations | None = None,
    ) -> None:
        self._jobs = jobs
        self._log = inference_log
        self._observations = observations
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self.finish_ended()
            except redis.RedisError as exc:
                log.debug("job log rows wait for Redis: %s", exc)
            except Exception:  # noqa: BLE001 - the next round tries again; a row is never half written
                log.exception("could not write job log rows")

    def finish_ended(self) -> int:
        """Writes the rows of jobs that ended; returns how many."""
        written = 0
        if self._log.closed:
            return 0  # shutting down: another process claims and writes these
        for ended in self._jobs.ended_unlogged():
            if self._log.closed or not self._jobs.claim_log_row(ended.job_id):
                continue  # another API process writes this one
            row, reply = InferenceLogRow.from_json(ended.row), ended.reply
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
            self._log.write(row)
            if ended.observe:
                self._observe(row, outcome)
            written += 1
        return written

    def _observe(self, row: InferenceLogRow, outcome: Outcome) -> None:
        """A submitted job's end feeds the rollback guard like a sync answer: its outcome and its latency from
        arrival to result (a cancelled job says nothing about its version)."""
        if self._observations is None or row.model_version is None or outcome is Outcome.CANCELLED:
            return
        ok = outcome is Outcome.OK
        self._observations.observe(row.model, row.model_version, row.request_id, row.total_ms or 0.0, ok)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
