"""The records stage: what a request leaves behind once answered: its inference log row, its metrics, its
access line and, for a job it made, its webhook.

An inference request's row is opened when the request arrives (so a 401 or a 404 is logged too) and
closed when the response is ready: from the serving stage's `Answer` when there is one, otherwise from the
refusal's HTTP status; both name their outcome in `contract/outcomes.py`. A row of a job the request
made waits in Redis for the job's end (`job_log.py`), so it carries the job's outcome.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import redis
from flask import Request, Response

from api_server.core import metrics
from api_server.core.auth import Caller
from api_server.core.redis_state import RedisState
from api_server.flows.observed import observe_stage, observe_stages
from api_server.flows.rows import rows_of
from api_server.flows.serving import FlowCall
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter
from api_server.jobs.service import JobStore
from api_server.predict.inference import PreparedRequest
from api_server.predict.limits import NO_LEASE, Lease
from api_server.predict.masks import repaint_fraction
from api_server.predict.serving import Answer, JobMade, Mode
from api_server.versions.rollouts import RolloutObservations
from contract.catalog import ModelCatalog
from contract.generation import LOGGED_PARAMETERS
from contract.model_spec import ModelSpec
from contract.outcomes import Outcome
from contract.step_cache import running_step_cache
from contract.stores.inflight import InflightStore

log = logging.getLogger("api_server")
UNLOGGED_PATHS = ("/healthz", "/readyz")
# Jobs whose row waits for their end (a cached job has already ended: its row is written now).
DEFERRED = (JobMade.SUBMITTED, JobMade.CONVERTED)


def now_to_the_millisecond(ago_seconds: float = 0.0) -> datetime:
    """A row's `created_at`, truncated as the request's `published_at_ms` and the worker's times are: at full
    precision, a request published within the same millisecond would be logged as published before it arrived.
    `ago_seconds`: how long ago the request arrived (its wait for an API thread), as its job's `created_at` counts."""
    now = datetime.now(UTC) - timedelta(seconds=ago_seconds)
    return now.replace(microsecond=now.microsecond - now.microsecond % 1000)


@dataclass
class InferenceCall:
    """One inference request as the route sees it, filled in as it goes: who, which model, what, the answer."""

    row: InferenceLogRow
    mode: Mode
    started: float = field(default_factory=time.perf_counter)
    caller: Caller | None = None
    spec: ModelSpec | None = None
    lease: Lease = NO_LEASE
    prepared: PreparedRequest | None = None
    answer: Answer | None = None
    # A call to a flow (api_server/flows/serving.py): its row is the flow's, billed; its stages' rows follow its reply.
    flow: FlowCall | None = None

    @property
    def arrived_ms(self) -> int:
        """Its row's `created_at` in epoch ms: when the request arrived, for its job too."""
        return round(self.row.created_at.timestamp() * 1000)


class RequestRecords:
    def __init__(
        self,
        inference_log: InferenceLogWriter,
        jobs: JobStore,
        redis_state: RedisState,
        instance_id: str,
        reply_mode: str,
        observations: RolloutObservations | None = None,
        inflight: InflightStore | None = None,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self._log = inference_log
        self._inflight = inflight
        self._catalog = catalog  # a flow's stage rows take their unit's task and family from it
        self._observations = observations
        self._jobs = jobs
        self._redis = redis_state
        self._instance_id = instance_id
        self._reply_mode = reply_mode

    def open(self, request_id: str, model: str, mode: Mode, started: float | None = None) -> InferenceCall:
        """A call's record; `started`: when the request arrived (`time.perf_counter()`), now if not given."""
        started = time.perf_counter() if started is None else started
        row = InferenceLogRow(
            request_id=request_id,
            created_at=now_to_the_millisecond(time.perf_counter() - started),
            model=model[:128],
            status="error",
            http_status=500,
            api_instance=self._instance_id,
            cache_hit=False,
            endpoint=mode.value,
            reply_mode=self._reply_mode,
        )
        return InferenceCall(row, mode, started=started)

    def pending_row(self, call: InferenceCall) -> dict:
        """The row as it stands when the request is published: kept with it in Redis, so that if this process dies
        before answering, the process that adopts the request writes it (`job_log.py`)."""
        self._fill(call)
        return call.row.to_json()

    def close(self, call: InferenceCall, http_status: int, error: str | None) -> None:
        """Completes the row from what the request reached, then writes it (or leaves it to its job)."""
        row, answer = call.row, call.answer
        self._fill(call)
        if answer is not None and answer.fallback is not None:
            # Both attempts: the version the split chose (its error) and the stable version, which answered.
            row.model_version = answer.fallback.answered_by.version
            row.fallback_from, row.fallback_error = answer.fallback.failed_version, answer.fallback.error
        if answer is not None and answer.overload is not None:
            # Admission refused the model asked for; its fallback answered: the row (and the bill) is the fallback's.
            answered_by = answer.overload.answered_by
            row.model, row.model_version, row.task = answered_by.name, answered_by.version, answered_by.task
            row.model_family = answered_by.family.name if answered_by.family else None
            row.overload_fallback_from = f"{answer.overload.asked.name}/{answer.overload.asked.version}"
        outcome = answer.outcome if answer is not None else Outcome.for_http_status(http_status)
        row.http_status, row.status = http_status, outcome.spec.log_status
        if answer is not None:
            self._answered(row, answer, call.prepared)
        if not outcome.answered and outcome is not Outcome.ACCEPTED:
            row.error = (error or outcome.value)[:1024]
            row.error_kind = row.error_kind or outcome.spec.error_kind
        row.total_ms = round((time.perf_counter() - call.started) * 1000, 2)
        self._observe(call, outcome, row.total_ms)
        if answer is not None and answer.row_kept and not self._settle(row.request_id):
            return  # this process looked dead: another adopted the request and wrote its row
        if answer is not None and answer.job_made in DEFERRED and http_status == 202:
            self._defer(row, answer)
        else:
            for each in rows_of(row, answer.reply if answer is not None else None, self._catalog):
                self._log.write(each)

    def _settle(self, request_id: str) -> bool:
        """True when the row kept with the published request is still this process's to write."""
        try:
            return self._inflight is None or self._inflight.settle_row(request_id)
        except redis.RedisError as exc:
            self._redis.failed(exc)
            return True  # nobody can adopt it without Redis either: written now

    def _fill(self, call: InferenceCall) -> None:
        """What the request reached so far: caller, model version, parameters."""
        row = call.row
        if call.caller is not None:
            row.api_key_id = call.caller.key_id
        if call.flow is not None:
            row.flow = call.flow.flow.name
        if call.spec is not None:
            row.model_version, row.task = call.spec.version, call.spec.task
            row.model_family = call.spec.family.name if call.spec.family else None
        if (prepared := call.prepared) is not None:
            for name in LOGGED_PARAMETERS:
                setattr(row, name, getattr(prepared.params, name))
            row.num_images, row.priority = len(prepared.prompts), prepared.priority
            row.adapters, row.controls = listed(prepared.params.adapters), listed(prepared.params.controls)
            row.input_bytes = sum(len(image) for image in prepared.images if image)
            row.mask_fraction = mask_fraction(prepared.masks)
            if (step_cache := running_step_cache(prepared.spec.step_cache, prepared.params.step_cache)) is not None:
                row.step_cache = step_cache.kind

    def _observe(self, call: InferenceCall, outcome: Outcome, total_ms: float) -> None:
        """A versioned model's call that reached its version (a reply, or none in time) feeds the rollback guard;
        a fallback feeds it twice: the failed first attempt, and the stable version's own."""
        spec, answer = call.spec, call.answer
        if self._observations is not None and call.flow is not None and answer is not None:
            self._observe_flow(call.row.request_id, answer)
            return
        if self._observations is None or spec is None or not spec.versioned or answer is None:
            return
        if (fallback := answer.fallback) is not None:
            request_id = call.row.request_id
            self._observations.observe(spec.name, fallback.failed_version, request_id, fallback.failed_ms, False)
            spec, total_ms = fallback.answered_by, max(0.0, total_ms - fallback.failed_ms)
        elif answer.reply is None and outcome is not Outcome.ACCEPTED:
            return  # a cache hit, a replay, a refusal: nothing the version did
        elif outcome is Outcome.INPUT_REFUSED:
            return  # the caller's own input, which any version would refuse
        if answer.job_made in (JobMade.SUBMITTED, JobMade.CACHED):
            return  # a submitted job is observed when it ends (job_log.py); a cached one ran nothing
        ok = outcome is Outcome.OK
        self._observations.observe(spec.name, spec.version, call.row.request_id, total_ms, ok)

    def _observe_flow(self, request_id: str, answer: Answer) -> None:
        """A flow's call feeds the guard per stage, as calls to the stages' versions would (api_server/flows/observed.py):
        a fallback's failed stage (its canary) with the first attempt's time, then every stage that answered. A job's
        stages are observed when it ends (job_log.py)."""
        assert self._observations is not None
        if answer.job_made is not None:
            return
        if (fallback := answer.fallback) is not None and fallback.stage is not None:
            observe_stage(self._observations, request_id, fallback.stage, fallback.failed_ms, False)
        if answer.reply is not None:
            observe_stages(self._observations, request_id, answer.reply)

    def _answered(self, row: InferenceLogRow, answer: Answer, prepared: PreparedRequest | None) -> None:
        if answer.reply is not None:
            row.record_reply(answer.reply, published_ms=answer.published_ms)
        row.output_bytes = answer.output_bytes
        row.cache_hit = answer.cache == "hit" and not answer.coalesced
        row.coalesced, row.idempotent_replay = answer.coalesced, answer.replayed
        if answer.cache_event is not None:
            metrics.CACHE.labels(answer.cache_event).inc()
        if answer.coalesced:
            metrics.COALESCED.inc()
        if answer.replayed:
            metrics.IDEMPOTENT_REPLAYS.inc()
        if answer.job_made is not None:
            metrics.JOBS.labels(answer.job_made.value).inc()
            row.job_id, row.endpoint = row.request_id, Mode.JOB.value
            if prepared is not None and prepared.webhook_url is not None:
                self._add_webhook(row.request_id, prepared.webhook_url, answer.job_deadline_ms or 0)

    def _add_webhook(self, job_id: str, url: str, deadline_ms: int) -> None:
        try:
            self._jobs.add_webhook(job_id, url, deadline_ms)
        except redis.RedisError as exc:
            self._redis.failed(exc)  # the job itself was just stored; its webhook is lost with Redis

    def _defer(self, row: InferenceLogRow, answer: Answer) -> None:
        """Now, or, for a job this request created, when the job ends (its row then carries the outcome)."""
        try:
            # A converted job's wait already fed the rollback guard (as a call not answered in time).
            # A flow's stages are known only at its end: a converted flow job is observed then.
            observe = answer.job_made is JobMade.SUBMITTED or row.flow is not None
            self._jobs.defer_log_row(row.request_id, row.to_json(), answer.job_deadline_ms or 0, observe)
            return
        except redis.RedisError as exc:
            self._redis.failed(exc)  # written now, as accepted: a row without its outcome beats no row
        except ValueError:
            pass  # an invalid row: the writer logs it in full
        self._log.write(row)


def route_of(request: Request) -> str:
    return request.url_rule.rule.replace("<model:model>", "<model>") if request.url_rule else "unmatched"


def count_request(request: Request, response: Response, started: float) -> None:
    route = route_of(request)
    if route != "/metrics":
        metrics.REQUESTS.labels(route, request.method, str(response.status_code)).inc()
        metrics.LATENCY.labels(route).observe(time.perf_counter() - started)


def access_line(request: Request, response: Response, started: float) -> None:
    """One line per request in Cloud Logging's `httpRequest` shape (the health probes are left out)."""
    if request.path in UNLOGGED_PATHS:
        return
    latency = time.perf_counter() - started
    log.info(
        "%s %s %d",
        request.method,
        request.path,
        response.status_code,
        extra={
            "fields": {
                "httpRequest": {
                    "requestMethod": request.method,
                    "requestUrl": request.path,
                    "status": response.status_code,
                    "responseSize": str(response.calculate_content_length() or 0),
                    "latency": f"{latency:.6f}s",
                },
            }
        },
    )


def listed(refs) -> str | None:
    """A log row's `adapters` or `controls` column: each as `name@version:scale`, in the request's order; None for
    none. The same for a predict's row and a batch line's."""
    return ",".join(f"{ref.name}@{ref.version}:{ref.scale:g}" for ref in refs) or None


def mask_fraction(masks: list[bytes | None]) -> float | None:
    """An inpaint request's log `mask_fraction`: the share of its images' pixels the masks repaint (the mean over its
    instances, 4 places); None without masks. The same for a predict's row and a batch line's."""
    given = [mask for mask in masks if mask is not None]
    return round(sum(repaint_fraction(mask) for mask in given) / len(given), 4) if given else None
