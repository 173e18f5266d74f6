"""The serving stage: a validated request's fate, from the model's choice to its answer, as one `Answer`.

`answer(prepared, mode)` tries, in order, an Idempotency-Key record, the result cache, an identical request
already in flight (coalescing), then the model: waiting for its reply (sync; a canary's model error is asked
again of the stable version, once) or handing back a job. Only an inference the model runs sends a shadow
copy. It knows nothing of Flask; the routes parse and render, the records stage (`records.py`) logs what it
returns. Refusals (a bad Idempotency-Key, a rate limit) raise `ApiError`; everything else is an `Answer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TypeVar

import redis

from api_server.core import metrics
from api_server.core.auth import Caller
from api_server.core.errors import ApiError, error_body
from api_server.core.redis_state import RedisState
from api_server.jobs.service import (
    FallbackRequest,
    JobCursor,
    JobState,
    JobStore,
    fallback_request_id,
    job_view,
    stage_timings,
    version_failed,
)
from api_server.predict.admission import AdmissionControl, Verdict
from api_server.predict.cache import cache_key, cache_policy
from api_server.predict.dispatch import DispatchTimings
from api_server.predict.flights import (
    CoordinationUnavailableError,
    FingerprintMismatchError,
    FlightPolicy,
    ResponseRecord,
    Role,
    SharedFlights,
    StillRunningError,
)
from api_server.predict.inference import InferenceService, PreparedRequest
from api_server.predict.limits import Lease, RequestLimiter
from api_server.versions.rollouts import Rollouts
from api_server.versions.shadow import ShadowTraffic
from api_server.versions.traffic import InvalidSplitError, choose_version, shadowed, validated_split
from contract.catalog import ModelCatalog, Rollout
from contract.messages import Attr, InferenceReply, InferenceRequest, Payload, Prediction, StageReport
from contract.model_spec import ModelSpec
from contract.outcomes import FINISHED_JOB_STATES, Outcome
from contract.settings import Settings
from contract.stores.inflight import InflightStore
from contract.stores.results import ResultStore

log = logging.getLogger(__name__)
T = TypeVar("T")
JSON = {"Content-Type": "application/json"}
MAX_IDEMPOTENCY_KEY_LENGTH = 255
# Retryable answers are not kept for an Idempotency-Key: the retry should run.
NOT_KEPT_FOR_IDEMPOTENCY = (429, 503)
FINISHED_STATES = "succeeded, failed, expired or cancelled"
# How often a request adopting a dead process's request looks for that request's stored answer.
ADOPTED_POLL_SECONDS = 0.2


class Mode(StrEnum):
    SYNC = "sync"  # wait for the model's reply (a job if the wait runs out)
    JOB = "job"  # answer with a job at once


class JobMade(StrEnum):
    """How this request made a job (its log row and webhook follow the job)."""

    SUBMITTED = "submitted"  # published as a job: the row waits for the job's end
    CONVERTED = "converted"  # a sync request whose wait ran out: likewise
    CACHED = "cached"  # a job answered from the cache: it has already succeeded


@dataclass(frozen=True)
class Fallback:
    """A request's first attempt, on the version the split chose, failed with a model error; the stable version
    (`answered_by`) was then asked once, within the caller's wait."""

    failed_version: str
    error: str
    failed_ms: float
    answered_by: ModelSpec
    # A flow's: the stage its first attempt ended in (the canary that failed it); the flow ran again with that
    # stage on its stable version (`answered_by` is then the flow as it ran the second time).
    stage: StageReport | None = None


@dataclass(frozen=True)
class OverloadFallback:
    """Admission refused the model asked for (`asked`: its predicted wait would miss the deadline) and the caller
    allowed a fallback: `answered_by`, the catalog's fallback for it, answered instead (and is billed)."""

    asked: ModelSpec
    answered_by: ModelSpec
    reason: str


@dataclass
class Answer:
    """What the serving stage did with a request: the outcome, the exact bytes to send, and how it got them."""

    outcome: Outcome
    record: ResponseRecord
    # X-Cache: "hit" or "miss" (None when the cache was not asked); `cache_event` is the metric's label.
    cache: str | None = None
    cache_event: str | None = None
    coalesced: bool = False
    replayed: bool = False
    reply: InferenceReply | None = None
    published_ms: float | None = None
    output_bytes: int | None = None
    job_made: JobMade | None = None
    job_deadline_ms: int | None = None
    # The version the split chose failed with a model error and the stable version was asked (its answer is this).
    fallback: Fallback | None = None
    # Its request was published with its partial log row kept in Redis: the records stage settles it.
    row_kept: bool = False
    # Admission refused the model asked for and its fallback answered (api_server/predict/admission.py).
    overload: OverloadFallback | None = None


class ServingStage:
    def __init__(
        self,
        settings: Settings,
        catalog: ModelCatalog,
        inference: InferenceService,
        jobs: JobStore,
        results: ResultStore,
        redis_state: RedisState,
        flights: SharedFlights,
        cache_flights: SharedFlights,
        limiter: RequestLimiter,
        rollouts: Rollouts,
        shadow: ShadowTraffic,
        inflight: InflightStore | None = None,
        admission: AdmissionControl | None = None,
    ) -> None:
        self._settings = settings
        self._admission = admission
        self._inflight = inflight
        self._catalog = catalog
        self._inference = inference
        self._jobs = jobs
        self._results = results
        self._redis = redis_state
        self._flights = flights
        self._cache_flights = cache_flights
        self._limiter = limiter
        self._rollouts = rollouts
        self._splits = rollouts.splits
        self._shadow = shadow

    def model(self, name: str, request_id: str, caller: Caller) -> ModelSpec:
        """The model version that serves a request for `name`: the split in force picks it, from the request id,
        or from the API key when the model says `sticky: api_key` (one key, one version)."""
        spec = self.stable(name)
        rollout = self._catalog.rollout(name)
        if rollout is None:
            return spec
        key = f"key:{caller.key_id}:{name}" if rollout.sticky == "api_key" else request_id
        return rollout.versions[choose_version(self._splits.split(name).traffic, key)]

    def stable(self, name: str) -> ModelSpec:
        """A model's stable version (its one version, for most), or a 404: what model-wide calls act on."""
        spec = self._catalog.get(name)
        if spec is None:
            raise ApiError(404, f"unknown model {name!r}; GET /v1/models lists them")
        return spec

    def pinned(self, name: str, version: str) -> ModelSpec:
        """One version of a model, whatever the split (404 for a version the catalog does not have)."""
        self.stable(name)
        spec = self._catalog.version(name, version)
        if spec is None:
            raise ApiError(404, f"model {name!r} has no version {version!r}; GET /v1/models/{name} lists them")
        return spec

    def model_view(self, name: str) -> tuple[ModelSpec, list[ModelSpec], dict | None]:
        """A model as GET shows it: its stable spec, its versions and the split in force (None: one version)."""
        spec = self.stable(name)
        rollout = self._catalog.rollout(name)
        if rollout is None:
            return spec, [spec], None
        return self._catalog.models[name], list(rollout.versions.values()), self._splits.split(name).to_json()

    def set_traffic(self, name: str, body: dict, actor: str) -> dict:
        """Validates and stores a model's new split (422 naming the field), audited; 503 when Redis is down."""
        rollout = self._versioned(name)
        unknown = set(body) - {"traffic", "shadow", "reason"}
        if unknown:
            raise ApiError(
                422, f"unknown fields {sorted(unknown)}; expected traffic, shadow, reason", sorted(unknown)[0]
            )
        reason = body.get("reason")
        if reason is not None and (not isinstance(reason, str) or len(reason) > 1024):
            raise ApiError(422, "reason must be a string of at most 1024 characters", "reason")
        try:
            traffic, shadow = validated_split(rollout, body.get("traffic"), body.get("shadow"))
        except InvalidSplitError as exc:
            raise ApiError(422, str(exc), exc.field) from exc
        return self._split_store(lambda: self._rollouts.set(name, traffic, shadow, actor, reason))

    def reset_traffic(self, name: str, actor: str) -> dict:
        self._versioned(name)
        return self._split_store(lambda: self._rollouts.reset(name, actor, None))

    def _versioned(self, name: str) -> Rollout:
        self.stable(name)
        rollout = self._catalog.rollout(name)
        if rollout is None:
            raise ApiError(409, f"model {name!r} has one version: there is no traffic split to change")
        return rollout

    def _split_store(self, action: Callable[[], T]) -> T:
        try:
            return action()
        except redis.RedisError as exc:
            self._redis.failed(exc)
            raise ApiError(503, "traffic split store unavailable, retry later", headers={"Retry-After": "5"}) from exc

    def admit(self, caller: Caller, spec: ModelSpec) -> Lease:
        """A concurrency lease held while the request is served, or a 429 (rate or concurrency limit).

        A lease, not a counter: a process that dies holding it frees the slot after the request's timeout."""
        return self._limiter.admit(caller.key_id, caller.digest, spec.request_timeout_seconds)

    def release(self, lease: Lease) -> None:
        self._limiter.release(lease)

    def prepare(self, spec: ModelSpec, payload: object, request_id: str, caller: Caller, **options) -> PreparedRequest:
        """The body validated against the model (422 naming the field); `options` as `PreparedRequest` has them."""
        return self._inference.prepare(spec, payload, request_id, caller, **options)

    def answer(self, prepared: PreparedRequest, mode: Mode) -> Answer:
        compute = self._submit_job if mode is Mode.JOB else self._through_cache
        if prepared.idempotency_key is None:
            return compute(prepared)
        return self._idempotent(prepared, mode, compute)

    def _send_shadow(self, prepared: PreparedRequest) -> None:
        """The split's shadow share of requests is also sent to the shadow version; nobody waits for it. Called
        where the primary publishes an inference, so a replay, a cache hit or a coalesced caller sends none."""
        rollout = self._catalog.rollout(prepared.spec.name)
        if rollout is None or prepared.pinned:
            return
        shadow = self._splits.split(rollout.name).shadow
        if shadow is not None and shadow.version != prepared.spec.version and shadowed(shadow, prepared.request_id):
            self._shadow.send(prepared, rollout.versions[shadow.version])

    # Jobs, read and cancelled by their owner.

    def job(self, job_id: str, caller: Caller) -> JobState:
        """The caller's job, or a 404 (another key's job is as absent as one that never existed)."""
        job = self._job_store(lambda: self._jobs.get(job_id, caller.key_id)) if len(job_id) <= 64 else None
        if job is None:
            raise ApiError(404, f"no job {job_id!r}")
        return job

    def cancel(self, job: JobState) -> JobState:
        """A queued job never runs; a running one stops at its next step; a finished one is a 409."""
        if job.status in FINISHED_JOB_STATES:
            raise ApiError(409, f"job {job.job_id} already finished ({job.status})")
        self._job_store(lambda: self._jobs.cancel(job.job_id))
        return replace(job, status="cancelled", progress=None)

    def job_view(self, job: JobState) -> dict:
        return job_view(job, self._inference.predictions)

    def list_jobs(
        self, caller: Caller, limit: int, after: JobCursor | None, status: str | None
    ) -> tuple[list[dict], JobCursor | None]:
        """A page of the caller's jobs as the list shows them (no results), and the next page's cursor."""
        jobs, cursor = self._job_store(lambda: self._jobs.list_for(caller.key_id, limit, after, status))
        return [job_view(job, None) for job in jobs], cursor

    def _job_store(self, action: Callable[[], T]) -> T:
        try:
            result = action()
        except redis.RedisError as exc:
            self._redis.failed(exc)
            raise _job_store_unavailable() from exc
        self._redis.succeeded()
        return result

    # Idempotency-Key: the first request's answer, for every repeat of the same key and body.

    def _idempotent(
        self, prepared: PreparedRequest, mode: Mode, compute: Callable[[PreparedRequest], Answer]
    ) -> Answer:
        idempotency_key = prepared.idempotency_key or ""
        if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LENGTH:
            raise ApiError(422, f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} characters", "Idempotency-Key")
        canonical = json.dumps(
            [prepared.spec.name, mode is Mode.JOB, prepared.payload], sort_keys=True, separators=(",", ":")
        )
        fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
        key = f"maas:idem:{prepared.caller.key_id}:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"
        ttl = self._settings.idempotency_ttl_seconds
        policy = FlightPolicy(
            keep_for=lambda record: None if record.status in NOT_KEPT_FOR_IDEMPOTENCY else ttl,
            lease_seconds=prepared.spec.request_timeout_seconds + 10,
            wait_seconds=prepared.spec.request_timeout_seconds + 5,
            strict=True,
        )
        computed: list[Answer] = []
        try:
            record, role = self._flights.run(
                key,
                fingerprint,
                _computing(compute, prepared, computed),
                policy,
                ticket=prepared.request_id,
                adopt=lambda request_id: self._adopted(prepared, mode, request_id),
            )
        except FingerprintMismatchError as exc:
            raise ApiError(
                422, "Idempotency-Key: already used with a different request body", "Idempotency-Key"
            ) from exc
        except StillRunningError as exc:
            raise ApiError(
                409, "a request with this Idempotency-Key is still running", headers={"Retry-After": "1"}
            ) from exc
        except CoordinationUnavailableError as exc:
            raise ApiError(
                503,
                "Idempotency-Key cannot be honoured right now (state store unavailable)",
                headers={"Retry-After": "5"},
            ) from exc
        if role in (Role.STORED, Role.FOLLOWER, Role.ADOPTED):
            outcome = _stored_outcome(record)
            replayed = replace(record, headers={**record.headers, "Idempotent-Replayed": "true"})
            return Answer(Outcome.REPLAY if outcome.answered else outcome, replayed, replayed=True)
        return computed[-1]

    def _adopted(self, prepared: PreparedRequest, mode: Mode, request_id: str) -> ResponseRecord | None:
        """The answer of `request_id`, an earlier request with this Idempotency-Key (or an identical cacheable one)
        whose API process died before answering: its stored reply, waited for while it is still in flight (up to
        the model's timeout, then handed over as its job), rather than run again. None when it never reached the
        queue: this one runs."""
        if self._inflight is None or not request_id:
            return None
        spec = prepared.spec
        started = time.perf_counter()
        give_up = time.monotonic() + spec.request_timeout_seconds
        try:
            if mode is Mode.JOB:  # its answer is its job, if the dead process made it
                made = self._jobs.get(request_id, prepared.caller.key_id) is not None
                return _job_record(request_id, spec.name, "queued") if made else None
            reply = self._results.get(request_id)
            if reply is None and not self._inflight.in_flight(request_id):
                return None
            while reply is None and time.monotonic() < give_up:
                time.sleep(ADOPTED_POLL_SECONDS)
                reply = self._results.get(request_id)
            if reply is None:
                return self._adopted_as_job(prepared, request_id)
        except redis.RedisError as exc:
            self._redis.failed(exc)
            return _refusal(_job_store_unavailable(), prepared.request_id).record
        self._redis.succeeded()
        timings = DispatchTimings(wait_ms=round((time.perf_counter() - started) * 1000, 2))
        return self._replied(prepared, reply, timings, request_id).record

    def _adopted_as_job(self, prepared: PreparedRequest, request_id: str) -> ResponseRecord:
        """An adopted request still unanswered after the wait: the caller gets it as a job, as it would have."""
        spec = prepared.spec
        kept = self._inflight.states([request_id])[0].kept if self._inflight is not None else None
        deadline_ms = kept.deadline_ms if kept is not None else self._inference.job_deadline_ms()
        if kept is not None and (rollout := self._catalog.rollout(spec.name)) is not None:
            # The version the split gave the adopted request, which need not be the one it gives this one.
            spec = rollout.versions.get(kept.attributes.get(Attr.MODEL_VERSION, ""), spec)
        self._jobs.create(request_id, prepared.caller.key_id, spec, deadline_ms, _arrival_ms(prepared))
        message = (
            f"no reply from {spec.name} within {spec.request_timeout_seconds}s; it is still queued as job "
            f"{request_id}: poll GET /v1/jobs/{request_id} (the Location header) until its status is "
            f"{FINISHED_STATES}; DELETE it to cancel"
        )
        return _job_record(request_id, spec.name, "queued", message)

    # The result cache and coalescing (sync), or the cache alone (jobs).

    def _through_cache(self, prepared: PreparedRequest) -> Answer:
        key = self._cache_key(prepared)
        if key is None:
            return replace(self._run_sync(prepared), cache_event="uncacheable")
        computed: list[Answer] = []
        policy = cache_policy(prepared.spec, self._settings.cache_ttl_seconds, self._settings.cache_max_entry_bytes)
        policy = _kept_unless_fallback(policy, computed)
        if prepared.fresh:
            computed.append(self._run_sync(prepared))
            self._cache_flights.store(key, computed[-1].record, policy)
            return replace(computed[-1], cache="miss", cache_event="bypass")
        record, role = self._cache_flights.run(
            key,
            "",
            _computing(self._run_sync, prepared, computed),
            policy,
            ticket=prepared.request_id,
            # An identical request whose process died running it: its answer is this one's too.
            adopt=lambda request_id: self._adopted(prepared, Mode.SYNC, request_id),
        )
        if role is Role.STORED:
            return Answer(Outcome.CACHE_HIT, record, cache="hit", cache_event="hit")
        if role in (Role.FOLLOWER, Role.ADOPTED):
            if record.status == 202:
                self._share_job(record, prepared.caller)
            outcome = _stored_outcome(record)
            outcome = Outcome.COALESCED if outcome.answered else outcome
            return Answer(outcome, record, cache="hit", cache_event="hit", coalesced=True)
        return replace(computed[-1], cache="miss", cache_event="miss" if role is Role.LEADER else "unavailable")

    def _cache_key(self, prepared: PreparedRequest) -> str | None:
        if not prepared.deterministic:
            return None
        return cache_key(prepared.spec, prepared.params, prepared.prompts, prepared.images, prepared.masks)

    def _share_job(self, record: ResponseRecord, caller: Caller) -> None:
        """A coalesced caller handed the leader's job link may read that job too."""
        try:
            self._jobs.share(json.loads(record.body)["id"], caller.key_id)
        except redis.RedisError as exc:
            self._redis.failed(exc)

    # The model: wait for its reply, or hand back a job.

    def _run_sync(self, prepared: PreparedRequest) -> Answer:
        left = prepared.received + prepared.spec.request_timeout_seconds - time.perf_counter()
        if (overloaded := self._overloaded(prepared, left)) is not None:
            return overloaded
        self._send_shadow(prepared)
        # The request stays runnable past the sync wait: if the wait runs out, the caller gets the job instead.
        deadline_ms = self._inference.job_deadline_ms()
        started = time.perf_counter()
        timings = DispatchTimings()
        answer = self._ask(prepared, deadline_ms, timings)
        if answer is None:
            return replace(self._hand_over_as_job(prepared, deadline_ms), row_kept=timings.row_kept)
        retry = self._on_stable(prepared, answer)
        if retry is None:
            return answer
        return self._fall_back(prepared, retry, answer, time.perf_counter() - started)

    # Admission by predicted wait (api_server/predict/admission.py): refuse at once, or answer with the fallback.

    def _verdict(self, prepared: PreparedRequest, left_seconds: float) -> Verdict | None:
        """Admission's verdict on publishing `prepared` now; None when not judged (admission off, a flow)."""
        if self._admission is None or prepared.flow is not None:
            return None
        return self._admission.check(prepared.spec, prepared.priority, left_seconds, prepared.request_id)

    def _overloaded(self, prepared: PreparedRequest, left_seconds: float) -> Answer | None:
        """None when the sync request may be published; else its answer now: a 503 with `Retry-After`, or, when
        the caller allows it and the catalog names one, the fallback model's answer (itself admitted first)."""
        verdict = self._verdict(prepared, left_seconds)
        if verdict is None or verdict.admitted:
            return None
        retry = self._fallback_for(prepared)
        if retry is None:  # no fallback (not allowed, none, the request not one it takes, or it is overloaded too)
            return self._refused(prepared, verdict, "its wait")
        fallback = retry.spec
        reason = _overload_message(prepared, verdict, "its wait")
        log.warning("%s overloaded for request %s (%s); answered by its fallback %s", prepared.spec.name,
                    prepared.request_id, reason, fallback.name)  # fmt: skip
        if self._admission is not None:
            self._admission.decided(prepared.spec, "fallback", verdict)
        deadline_ms = self._inference.job_deadline_ms()
        timings = DispatchTimings()
        answer = self._ask(retry, deadline_ms, timings)
        if answer is None:
            answer = replace(self._hand_over_as_job(retry, deadline_ms), row_kept=timings.row_kept)
        return _fallen_back(answer, OverloadFallback(prepared.spec, fallback, reason))

    def _fallback_for(self, prepared: PreparedRequest) -> PreparedRequest | None:
        """The request prepared for the model's fallback, when its caller allows one, the catalog names one, the
        request is one the fallback takes and the fallback itself is admitted; else None."""
        policy = prepared.spec.admission
        if not prepared.body.allow_fallback or policy is None or policy.fallback is None:
            return None
        fallback = self._catalog.get(policy.fallback)
        if fallback is None:
            return None
        try:
            retry = self.prepare(fallback, prepared.payload, prepared.request_id, prepared.caller,
                                 received=prepared.received, log_row=prepared.log_row,
                                 arrived_ms=prepared.arrived_ms)  # fmt: skip
        except ApiError as error:  # the request is not one the fallback takes: the refusal stands
            log.info("request %s cannot fall back to %s: %s", prepared.request_id, fallback.name, error.message)
            return None
        left = prepared.received + fallback.request_timeout_seconds - time.perf_counter()
        fallback_verdict = self._verdict(retry, left)
        if fallback_verdict is not None and not fallback_verdict.admitted:
            return None  # the request's one decision is the model's refusal (`_refused`), not a second line
        return retry

    def _refused(self, prepared: PreparedRequest, verdict: Verdict, deadline: str) -> Answer:
        """The 503 of a request admission refused, counted and logged once as `refused`."""
        if self._admission is not None:
            self._admission.decided(prepared.spec, "refused", verdict)
        return _overload_refusal(prepared, verdict, deadline)

    def _on_stable(
        self, prepared: PreparedRequest, answer: Answer
    ) -> tuple[PreparedRequest, StageReport | None] | None:
        """The request again on the stable version (under the fallback's id), when the split sent it to another
        version that failed it with a failure of its own (not a refusal of the request's input, which the stable
        version would refuse too); a flow's, with the stage it ended in on that stage's stable version (and that
        stage's report); None otherwise."""
        if not version_failed(answer.reply):
            return None
        assert answer.reply is not None
        retry_id = fallback_request_id(prepared.request_id)
        if prepared.flow is not None:
            ended = next((report for report in answer.reply.stages if not report.finished), None)
            call = prepared.flow.fallback(ended) if ended is not None else None
            return None if call is None else (prepared.for_version(call.spec, retry_id, flow=call), ended)
        stable = self._stable_behind(prepared)
        return None if stable is None else (prepared.for_version(stable, retry_id), None)

    def _stable_behind(self, prepared: PreparedRequest) -> ModelSpec | None:
        """The stable version, when the split sent this request to another one (a pinned request keeps the
        version it asked for)."""
        rollout = self._catalog.rollout(prepared.spec.name)
        if rollout is None or prepared.pinned or prepared.spec.version == rollout.stable:
            return None
        return rollout.versions[rollout.stable]

    def _job_fallback(self, prepared: PreparedRequest, message: InferenceRequest) -> FallbackRequest | None:
        """For a job the split sent to a canary: the stable version's request, asked if the canary fails it (the
        job-log loop does, `job_log.py`). Its inputs are the canary's (same objects, nothing uploaded twice). A
        flow's: the flow with every stage the split sent to a canary on its stable version, asked if one of those
        stages fails it."""
        retry_id = fallback_request_id(prepared.request_id)
        if prepared.flow is not None:
            call = prepared.flow.all_stable()
            if call is None:
                return None
            retry = call.message(message.model_copy(update={"request_id": retry_id}))
            return FallbackRequest(retry.model_dump_json(), prepared.priority)
        stable = self._stable_behind(prepared)
        if stable is None:
            return None
        update = {"request_id": retry_id, "model_version": stable.version}
        return FallbackRequest(message.model_copy(update=update).model_dump_json(), prepared.priority)

    def _fall_back(
        self,
        prepared: PreparedRequest,
        on_stable: tuple[PreparedRequest, StageReport | None],
        failed: Answer,
        failed_seconds: float,
    ) -> Answer:
        """Asks the stable version once, within what is left of the caller's wait; its answer is the caller's, so a
        canary's failure reaches neither the caller nor the bill (the row names both attempts). With no time
        left, the canary's answer stands. A flow runs again with the failed stage on its stable version."""
        assert failed.reply is not None
        retry, stage = on_stable
        stable = retry.spec
        left = prepared.received + prepared.spec.request_timeout_seconds - time.perf_counter()
        if left <= 0:
            return failed
        error = (failed.reply.error or f"model worker answered {failed.reply.status}")[:1024]
        fallback = Fallback(prepared.spec.version, error, round(failed_seconds * 1000, 2), stable, stage)
        log.warning("%s version %s failed request %s (%s); asking the stable version %s", prepared.spec.name,
                    prepared.spec.version, prepared.request_id, error, stable.version)  # fmt: skip
        metrics.FALLBACKS.labels(prepared.spec.name, prepared.spec.version).inc()
        # The caller's row, kept with the first attempt, is the one row of both attempts.
        deadline_ms = int((time.time() + left) * 1000)
        answer = self._ask(retry, deadline_ms, DispatchTimings(), wait_seconds=left, answering_for=prepared.request_id)
        if answer is None:
            message = (f"version {prepared.spec.version} failed ({error}) and the stable version {stable.version} "
                       f"gave no reply within the request's {prepared.spec.request_timeout_seconds}s")  # fmt: skip
            answer = _refusal(ApiError(504, message), prepared.request_id)
        return replace(answer, fallback=fallback, row_kept=failed.row_kept)

    def _ask(
        self,
        prepared: PreparedRequest,
        deadline_ms: int,
        timings: DispatchTimings,
        wait_seconds: float | None = None,
        answering_for: str | None = None,
    ) -> Answer | None:
        """One inference on `prepared.spec`, waited for: its answer, or None when no reply came within the wait
        (`timings.row_kept` then says whether its partial log row was kept with it). `answering_for`: the
        caller's request id, when this inference runs under an id of its own (a fallback)."""
        request_id = answering_for or prepared.request_id
        metrics.INFLIGHT_WAITS.inc()
        try:
            reply = self._inference.run(prepared, timings, deadline_ms, wait_seconds)
        except ApiError as error:
            return replace(_refusal(error, request_id), row_kept=timings.row_kept)
        finally:
            metrics.INFLIGHT_WAITS.dec()
        if reply is None:
            return None
        if self._admission is not None and reply.status == "ok":
            self._admission.ran(prepared.spec, reply, timings.published_ms)
        return replace(self._replied(prepared, reply, timings, request_id), row_kept=timings.row_kept)

    def _replied(
        self, prepared: PreparedRequest, reply: InferenceReply, timings: DispatchTimings, request_id: str
    ) -> Answer:
        """The answer to `prepared` from the worker's reply to `request_id` (the request that ran the model)."""
        published_ms = timings.published_ms or time.time() * 1000 - timings.wait_ms - timings.cleanup_ms
        outcome = Outcome.for_reply(reply.status, reply.error_kind)
        if outcome is not Outcome.OK:
            message = reply.error or f"model worker answered {reply.status}"
            record = _error_record(outcome.spec.http_status, message, request_id, outcome)
            return Answer(outcome, record, reply=reply, published_ms=published_ms)
        try:
            predictions = self._inference.predictions(reply)
        except ApiError as error:
            return replace(_refusal(error, request_id), reply=reply, published_ms=published_ms)
        body = {
            "predictions": predictions,
            "model": prepared.spec.name,
            # The version that ran it: an adopted request's, which the split may have sent elsewhere than this one.
            "model_version": reply.model_version or prepared.spec.version,
            "request_id": request_id,
            "timings_ms": {
                "total": round((time.perf_counter() - prepared.received) * 1000, 2),
                "queue": round(reply.queue_ms, 2),
                "inference": round(reply.inference_ms, 2),
                "subscribe": timings.subscribe_ms,
                "publish": timings.publish_ms,
                "wait": timings.wait_ms,
                "cleanup": timings.cleanup_ms,
            },
        }
        if reply.stages:  # a flow's: every stage that ran (api_server/flows/serving.py)
            body["stages"] = stage_timings(reply)
        return Answer(
            Outcome.OK,
            ResponseRecord(200, json.dumps(body).encode(), dict(JSON), outcome=Outcome.OK),
            reply=reply,
            published_ms=published_ms,
            output_bytes=sum(len(prediction["image_b64"]) * 3 // 4 for prediction in predictions),
        )

    def _hand_over_as_job(self, prepared: PreparedRequest, deadline_ms: int) -> Answer:
        spec = prepared.spec
        waited = f"no reply from {spec.name} within {spec.request_timeout_seconds}s"
        try:
            self._jobs.create(prepared.request_id, prepared.caller.key_id, spec, deadline_ms, _arrival_ms(prepared))
        except redis.RedisError as exc:
            self._redis.failed(exc)
            return _refusal(ApiError(504, waited), prepared.request_id)
        message = (
            f"{waited}; it is still queued as job {prepared.request_id}: poll GET /v1/jobs/{prepared.request_id} "
            f"(the Location header) until its status is {FINISHED_STATES}; DELETE it to cancel"
        )
        return Answer(
            Outcome.ACCEPTED,
            _job_record(prepared.request_id, prepared.spec.name, "queued", message),
            job_made=JobMade.CONVERTED,
            job_deadline_ms=deadline_ms,
        )

    def _submit_job(self, prepared: PreparedRequest) -> Answer:
        key = None if prepared.fresh else self._cache_key(prepared)
        if key is not None and (hit := self._cache_flights.lookup(key)) is not None:
            return self._cached_job(prepared, hit)
        deadline_ms = self._inference.job_deadline_ms()
        verdict = self._verdict(prepared, deadline_ms / 1000 - time.time())
        if verdict is not None and not verdict.admitted:
            return self._refused(prepared, verdict, "its job deadline")
        try:
            message = self._inference.message(prepared)
        except ApiError as error:
            return _refusal(error, prepared.request_id)
        try:
            self._jobs.create(
                prepared.request_id,
                prepared.caller.key_id,
                prepared.spec,
                deadline_ms,
                _arrival_ms(prepared),
                self._job_fallback(prepared, message),
            )
        except redis.RedisError as exc:
            self._redis.failed(exc)
            return _refusal(_job_store_unavailable(), prepared.request_id)
        try:
            log_row = prepared.log_row() if prepared.log_row is not None else None
            row_kept = self._inference.publish(message, prepared.spec, deadline_ms, prepared.priority, log_row)
        except ApiError as error:
            return _refusal(error, prepared.request_id)
        self._send_shadow(prepared)
        return Answer(
            Outcome.ACCEPTED,
            _job_record(prepared.request_id, prepared.spec.name, "queued"),
            job_made=JobMade.SUBMITTED,
            job_deadline_ms=deadline_ms,
            row_kept=row_kept,
        )

    def _cached_job(self, prepared: PreparedRequest, hit: ResponseRecord) -> Answer:
        """A job whose answer the cache already holds: made as a job that has already succeeded (202, like
        every job), so a client of the jobs endpoints always gets a job, and the model does not run again."""
        spec = prepared.spec
        cached = json.loads(hit.body)
        reply = InferenceReply(
            request_id=prepared.request_id,
            model=spec.name,
            model_version=spec.version,
            status="ok",
            predictions=[
                Prediction(image=Payload(b64=item["image_b64"]), seed=item["seed"], width=item["width"],
                           height=item["height"])
                for item in cached["predictions"]
            ],
        )  # fmt: skip
        deadline_ms = self._inference.job_deadline_ms()
        try:
            self._results.put(reply)
            self._jobs.create(prepared.request_id, prepared.caller.key_id, spec, deadline_ms, _arrival_ms(prepared))
        except redis.RedisError as exc:
            self._redis.failed(exc)
            return _refusal(_job_store_unavailable(), prepared.request_id)
        return Answer(
            Outcome.CACHE_HIT,
            _job_record(prepared.request_id, spec.name, "succeeded", outcome=Outcome.CACHE_HIT),
            cache="hit",
            cache_event="hit",
            job_made=JobMade.CACHED,
            job_deadline_ms=deadline_ms,
        )


def _computing(compute: Callable[[PreparedRequest], Answer], prepared: PreparedRequest, into: list[Answer]):
    """`compute` as a flight runs it (bytes out), keeping the whole `Answer` for the caller that computed."""

    def run() -> ResponseRecord:
        answer = compute(prepared)
        into.append(answer)
        return answer.record

    return run


def _kept_unless_fallback(policy: FlightPolicy, computed: list[Answer]) -> FlightPolicy:
    """`policy`, except that a fallback's answer is never kept: the cache key names the version the split
    chose, and that answer is the stable version's (the callers already waiting still share it)."""

    def keep_for(record: ResponseRecord) -> int | None:
        if computed and (computed[-1].fallback is not None or computed[-1].overload is not None):
            return None
        return policy.keep_for(record)

    return replace(policy, keep_for=keep_for)


def _overload_message(prepared: PreparedRequest, verdict: Verdict, against: str) -> str:
    return (
        f"{prepared.spec.name} is overloaded: this request would start in about {verdict.start_seconds:.1f}s and "
        f"end in about {verdict.finish_seconds:.1f}s, past {against}"
    )


def _overload_refusal(prepared: PreparedRequest, verdict: Verdict, against: str) -> Answer:
    """A 503 at once, nothing published: `Retry-After` is when the backlog ahead will have drained enough."""
    message = f"{_overload_message(prepared, verdict, against)}; retry in {verdict.retry_after}s"
    headers = {"Retry-After": str(verdict.retry_after)}
    return Answer(
        Outcome.OVERLOADED, _error_record(503, message, prepared.request_id, Outcome.OVERLOADED, None, headers)
    )


def _fallen_back(answer: Answer, overload: OverloadFallback) -> Answer:
    """The fallback's answer, saying so: `X-MaaS-Fallback-From` (model/version asked for), and `fallback_from` in a
    200's body (whose `model` and `model_version` are the fallback's)."""
    record = answer.record
    asked = f"{overload.asked.name}/{overload.asked.version}"
    body = record.body
    if record.status == 200:
        parsed = json.loads(body)
        parsed["fallback_from"] = {
            "model": overload.asked.name, "model_version": overload.asked.version, "reason": overload.reason,
        }  # fmt: skip
        body = json.dumps(parsed).encode()
    record = replace(record, body=body, headers={**record.headers, "X-MaaS-Fallback-From": asked})
    return replace(answer, record=record, overload=overload)


def _stored_outcome(record: ResponseRecord) -> Outcome:
    """The outcome a kept or shared record answered with (records kept before outcomes were stored: by status)."""
    if record.outcome:
        return Outcome(record.outcome)
    return {200: Outcome.OK, 202: Outcome.ACCEPTED}.get(record.status) or Outcome.for_http_status(record.status)


def _job_store_unavailable() -> ApiError:
    return ApiError(503, "job store unavailable, retry later", headers={"Retry-After": "5"})


def _job_record(
    job_id: str, model: str, status: str, message: str | None = None, outcome: Outcome = Outcome.ACCEPTED
) -> ResponseRecord:
    location = f"/v1/jobs/{job_id}"
    body = {"id": job_id, "status": status, "model": model, "links": {"self": location}}
    if message:
        body["message"] = message
    return ResponseRecord(202, json.dumps(body).encode(), {**JSON, "Location": location}, outcome=outcome)


def _refusal(error: ApiError, request_id: str) -> Answer:
    outcome = Outcome.for_http_status(error.status)
    return Answer(outcome, _error_record(error.status, error.message, request_id, outcome, error.field, error.headers))


def _error_record(
    status: int,
    message: str,
    request_id: str,
    outcome: Outcome,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> ResponseRecord:
    body = error_body(status, message, field, request_id)
    return ResponseRecord(status, json.dumps(body).encode(), {**JSON, **(headers or {})}, outcome=outcome)


def _arrival_ms(prepared: PreparedRequest) -> int:
    """When the request arrived, epoch ms: a job's `created_at`, also when a sync wait turned it into a job."""
    if prepared.arrived_ms is not None:
        return prepared.arrived_ms
    return int((time.time() - (time.perf_counter() - prepared.received)) * 1000)
