"""Writes the inference log rows that outlive their HTTP request: a job's when the job ends, and an orphan's.

An accepted job's partial row waits in Redis with the job (`JobStore.defer_log_row`). Every API process
looks at the unlogged jobs once a second; a job whose reply the worker stored (or whose deadline passed
unanswered) is claimed with ZREM, which succeeds in exactly one process, and its completed row written.
A job is therefore logged once even if the process that accepted it died. The one process that writes a
submitted job's row also hands its outcome and latency to the rollback guard (`rollouts.py`), so a canary
failing only through jobs is rolled back like one failing sync calls. A job the split sent to a canary that
failed it with a model error is not ended yet: the process that claims it asks the stable version once (under
`{job}-fallback`, within the job's deadline), and the job, its view and its row follow that attempt.

An orphan is a published request whose API process died before writing its row: the row kept with the request
(`contract/stores/inflight.py`) names its process, whose liveness key has lapsed. Once the request ends (the worker's
stored reply, or its deadline), the same loop adopts the row (one ZREM, in exactly one process; the owner's own
write claims it the same way) and writes it with the inference's outcome and `http_status` 0: nobody was answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.flows.observed import observe_stage, observe_stages
from api_server.flows.rows import rows_of
from api_server.flows.serving import planned_flow, stage_versions
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter
from api_server.jobs.service import EXPIRY_GRACE_MS, EndedJob, JobStore, reply_outcome
from api_server.predict.inference import InferenceService
from api_server.versions.rollouts import RolloutObservations
from contract.catalog import ModelCatalog
from contract.messages import InferenceReply, InferenceRequest, StageReport
from contract.model_spec import ModelSpec
from contract.outcomes import Outcome
from contract.stores.inflight import InflightStore
from contract.stores.results import ResultStore

log = logging.getLogger(__name__)
# Ends that say nothing about the version that ran: the caller cancelled, or the caller's own input was refused
# (any version would refuse it), so neither counts for or against a canary in the rollback guard.
NOT_THE_VERSIONS_DOING = frozenset({Outcome.CANCELLED, Outcome.INPUT_REFUSED})
# The `http_status` of an orphan's row: its API process died before answering anything.
NO_ANSWER_HTTP_STATUS = 0


class JobLogFinisher:
    def __init__(
        self,
        jobs: JobStore,
        inference_log: InferenceLogWriter,
        interval: float = 1.0,
        observations: RolloutObservations | None = None,
        catalog: ModelCatalog | None = None,
        inference: InferenceService | None = None,
        inflight: InflightStore | None = None,
        results: ResultStore | None = None,
        forget_reply_subscription: Callable[[str], object] | None = None,
    ) -> None:
        """`catalog` and `inference`: to ask the stable version when a canary failed a job (without them, a
        canary's failed job is failed). `inflight` and `results`: to adopt orphans' rows.
        `forget_reply_subscription(request_id)`: deletes the per-request reply subscription an orphan leaked."""
        self._jobs = jobs
        self._forget_reply_subscription = forget_reply_subscription
        self._inflight = inflight
        self._results = results
        self._log = inference_log
        self._observations = observations
        self._catalog = catalog
        self._inference = inference
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
        for ended in self._jobs.ended_unlogged():
            if self._log.closed or not self._jobs.claim_log_row(ended.job_id):
                continue  # another API process writes this one
            row, reply = InferenceLogRow.from_json(ended.row), ended.reply
            if ended.fallback is not None and self._fall_back(ended, row):
                continue  # not ended: its stable version's attempt is, when it ends
            if ended.fallback_from is not None:
                row.model_version = self._stable_version(row.model) or _flow_version(reply) or row.model_version
                row.fallback_from, row.fallback_error = ended.fallback_from, ended.fallback_error
            row, outcome = ended_row(row, reply)
            for each in rows_of(row, reply, self._catalog):
                self._log.write(each)
            if ended.observe:
                self._observe(row, outcome, reply)
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
            row, _ = ended_row(InferenceLogRow.from_json(row_json), reply)
            row.http_status = NO_ANSWER_HTTP_STATUS
            if row.endpoint != "job":
                row.total_ms = None  # no response was sent: nothing to time
            log.warning(
                "wrote the log row of request %s: its API process %s died before answering", item.request_id,
                item.owner,
            )  # fmt: skip
            for each in rows_of(row, reply, self._catalog):
                self._log.write(each)
            written += 1
            if row.reply_mode == "per-request" and self._forget_reply_subscription is not None:
                self._forget_reply_subscription(item.request_id)  # nobody waits on it any more
        return written

    def _fall_back(self, ended: EndedJob, row: InferenceLogRow) -> bool:
        """Asks the stable version once for a job a canary failed; False when it cannot be asked (the
        canary's answer is then the job's)."""
        assert ended.fallback is not None and ended.reply is not None
        message = InferenceRequest.model_validate_json(ended.fallback.request_json).model_copy(
            update={"published_at_ms": int(time.time() * 1000)}
        )
        on_stable = self._stable_of(row, message, ended.reply)
        if self._inference is None or on_stable is None:
            self._jobs.drop_fallback(ended.job_id)
            return False
        spec, stage = on_stable
        stable = spec.version
        failed = ended.reply.model_version if stage is None else row.model_version or ""
        error = (ended.reply.error or ended.reply.status)[:1024]
        try:
            self._inference.publish(message, spec, ended.deadline_ms, ended.fallback.priority)  # type: ignore[arg-type]
        except ApiError as exc:
            log.error("job %s: the stable version of %s could not be asked (%s)", ended.job_id, row.model, exc)
            self._jobs.drop_fallback(ended.job_id)
            return False
        self._jobs.fell_back(ended.job_id, failed, error, stable, ended.deadline_ms)
        metrics.FALLBACKS.labels(row.model, failed).inc()
        log.warning("job %s: %s version %s failed it (%s); asking the stable version %s", ended.job_id, row.model,
                    failed, error, stable)  # fmt: skip
        if ended.observe and self._observations is not None:
            answered = ended.reply.answered_ms or int(time.time() * 1000)
            failed_ms = max(0.0, answered - row.created_at.timestamp() * 1000)
            if stage is not None:  # a flow's: the stage's canary failed it
                observe_stage(self._observations, row.request_id, stage, failed_ms, False)
            else:
                self._observations.observe(row.model, failed, row.request_id, failed_ms, False)
        return True

    def _stable_of(
        self, row: InferenceLogRow, message: InferenceRequest, reply: InferenceReply
    ) -> tuple[ModelSpec, StageReport | None] | None:
        """What the stable version's attempt is published as, and for a flow the stage its canary failed; None
        when there is none to ask (a flow whose failed stage already ran on its stable version)."""
        if self._catalog is None:
            return None
        if message.flow is None:
            stable = self._stable_version(row.model)
            return None if stable is None else (self._catalog.rollouts[row.model].versions[stable], None)
        ended = next((report for report in reply.stages if not report.finished), None)
        plans = message.flow.stages
        if ended is None or ended.index >= len(plans) or plans[ended.index].model_version == ended.model_version:
            return None
        spec = planned_flow(self._catalog, message.flow)
        return None if spec is None else (spec, ended)

    def _stable_version(self, model: str) -> str | None:
        rollout = self._catalog.rollout(model) if self._catalog is not None else None
        return rollout.stable if rollout is not None else None

    def _observe(self, row: InferenceLogRow, outcome: Outcome, reply: InferenceReply | None) -> None:
        """A submitted job's end feeds the rollback guard like a sync answer: its outcome and its latency from
        arrival to result (a cancelled job, or one whose input the version refused, says nothing about its version).
        A flow's job: each stage that ran, as calls to the stages' versions (api_server/flows/observed.py)."""
        if self._observations is None:
            return
        if row.flow is not None:
            if reply is not None:
                observe_stages(self._observations, row.request_id, reply)
            return
        if row.model_version is None or outcome in NOT_THE_VERSIONS_DOING:
            return
        ok = outcome is Outcome.OK
        self._observations.observe(row.model, row.model_version, row.request_id, row.total_ms or 0.0, ok)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _flow_version(reply: InferenceReply | None) -> str | None:
    """A flow's version as its reply's stages ran it (`base=1,refiner=2`); None for a model's reply."""
    if reply is None or not reply.stages:
        return None
    return stage_versions([(report.stage, report.model_version) for report in reply.stages])


def ended_row(row: InferenceLogRow, reply: InferenceReply | None) -> tuple[InferenceLogRow, Outcome]:
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
    return row, outcome
