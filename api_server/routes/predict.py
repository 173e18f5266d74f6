"""POST /v1/models/<model>:predict (and, through `accept`, job submission): validate, then answer from the
cache, an identical request in flight, an Idempotency-Key record, or the model; one inference log row
whatever happens."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime

import redis
from flask import Blueprint, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from api_server import metrics
from api_server.cache import cache_key, cache_policy
from api_server.dispatch import DispatchTimings
from api_server.errors import ApiError, error_body
from api_server.flights import (
    CoordinationUnavailableError,
    FingerprintMismatchError,
    FlightPolicy,
    ResponseRecord,
    Role,
    StillRunningError,
)
from api_server.inference import PreparedRequest
from api_server.inference_log import InferenceLogRow
from api_server.jobs import REPLY_STATUS_HTTP
from api_server.limits import NO_LEASE
from api_server.openapi import INFERENCE_RESPONSES, InferenceHeaders, documented
from api_server.schemas import PredictBody

bp = Blueprint("predict", __name__)

JSON = {"Content-Type": "application/json"}
MAX_IDEMPOTENCY_KEY_LENGTH = 255
# Retryable answers are not kept for an Idempotency-Key: the retry should run.
NOT_KEPT_FOR_IDEMPOTENCY = (429, 503)


@bp.post("/v1/models/<model:model>:predict")
@documented(INFERENCE_RESPONSES, json=PredictBody, headers=InferenceHeaders, tags=["inference"])
def predict(model: str):
    """Generate images

    Waits for the worker's reply: 200 with the images, or 202 with a job if the wait runs out (or at once
    with `Prefer: respond-async`)."""
    return accept(model, respond_async="respond-async" in request.headers.get("Prefer", "").lower())


def accept(model: str, respond_async: bool) -> Response:
    """A predict body in, the response out: 200 with the images, or 202 with a job when async (asked for,
    or the sync wait ran out)."""
    services = current_app.extensions["maas"]
    serving = current_app.extensions["maas_serving"]
    started = time.perf_counter()
    row = InferenceLogRow(
        request_id=g.request_id,
        created_at=datetime.now(UTC),
        model=model[:128],
        status="error",
        http_status=500,
        api_instance=services.settings.instance_id,
        cache_hit=False,
        endpoint="job" if respond_async else "sync",
        reply_mode=services.waiter.mode,
    )
    try:
        record, cache = _answer(services, serving, model, row, started, respond_async)
        row.http_status, row.status = record.status, _log_status(record.status)
        if record.status >= 400:
            row.error = json.loads(record.body)["error"]["message"][:1024]
            row.error_kind = row.error_kind or _error_kind(record.status)
        response = Response(record.body, status=record.status, headers=record.headers)
        if cache:
            response.headers["X-Cache"] = cache
        return response
    except ApiError as error:
        row.http_status, row.status, row.error = error.status, _log_status(error.status), error.message[:1024]
        row.error_kind = _error_kind(error.status)
        raise
    except HTTPException as error:  # raised by Flask itself, e.g. 413 while reading the body
        row.http_status, row.status, row.error = error.code or 500, _log_status(error.code or 500), error.name
        row.error_kind = _error_kind(error.code or 500)
        raise
    finally:
        serving.limiter.release(g.pop("limit_lease", NO_LEASE))
        row.total_ms = round((time.perf_counter() - started) * 1000, 2)
        _write_log_row(services, serving, row)


def _write_log_row(services, serving, row: InferenceLogRow) -> None:
    """Now, or, for a job this request created, when the job ends (its row then carries the outcome)."""
    deferred = g.pop("deferred_job_deadline_ms", None)
    if deferred is not None and row.http_status == 202:
        try:
            serving.jobs.defer_log_row(row.request_id, row.to_json(), deferred)
            return
        except redis.RedisError as exc:
            serving.redis.failed(exc)  # written now, as accepted: a row without its outcome beats no row
        except ValueError:
            pass  # an invalid row: the writer logs it in full
    services.inference_log.write(row)


ERROR_KINDS = {
    400: "bad_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found", 409: "conflict",
    413: "too_large", 422: "invalid_request", 429: "rate_limited", 500: "internal", 503: "unavailable",
    504: "timeout",
}  # fmt: skip


def _error_kind(http_status: int) -> str:
    return ERROR_KINDS.get(http_status, "rejected" if http_status < 500 else "internal")


def _log_status(http_status: int) -> str:
    if http_status == 202:
        return "accepted"
    return {200: "ok", 504: "timeout", 503: "unavailable"}.get(
        http_status, "rejected" if http_status < 500 else "error"
    )


def _answer(services, serving, model: str, row: InferenceLogRow, started: float, respond_async: bool):
    key_id, digest = services.auth.identify(request)
    row.api_key_id = key_id
    spec = services.catalog.get(model)
    if spec is None:
        raise ApiError(404, f"unknown model {model!r}; GET /v1/models lists them")
    row.model_version, row.task = spec.version, spec.task
    # A lease, not a counter: a process that dies holding it frees the slot after the request's timeout.
    g.limit_lease = serving.limiter.admit(key_id, digest, spec.request_timeout_seconds)
    try:
        payload = request.get_json(silent=True)
    except RecursionError:  # nested deeper than the parser's recursion limit
        raise ApiError(400, "body: JSON nested too deeply") from None
    if payload is None:
        raise ApiError(400, "body must be a JSON object (Content-Type: application/json)")
    prepared = serving.inference.prepare(spec, payload, g.request_id, digest)
    row.num_images, row.width, row.height = len(prepared.prompts), prepared.params.width, prepared.params.height
    row.num_inference_steps, row.seed = prepared.params.num_inference_steps, prepared.params.seed
    row.priority = prepared.priority
    row.input_bytes = sum(len(image) for image in prepared.images if image)

    key = cache_key(spec, prepared.params, prepared.prompts, prepared.images) if prepared.deterministic else None
    bypass = "no-cache" in request.headers.get("Cache-Control", "").lower()
    outcome: dict[str, str] = {}

    def run_sync() -> ResponseRecord:
        return _run_sync(serving, prepared, key_id, row, started)

    def through_cache() -> ResponseRecord:
        if key is None:
            metrics.CACHE.labels("uncacheable").inc()
            return run_sync()
        policy = cache_policy(spec, serving.settings.cache_ttl_seconds, serving.settings.cache_max_entry_bytes)
        if bypass:
            metrics.CACHE.labels("bypass").inc()
            record = run_sync()
            serving.cache_flights.store(key, record, policy)
            outcome["cache"] = "miss"
            return record
        record, role = serving.cache_flights.run(key, "", run_sync, policy)
        _count_cache(role, outcome)
        if role is Role.FOLLOWER and record.status == 202:
            _share_job(serving, record, key_id)
        return record

    def submit_job() -> ResponseRecord:
        if key is not None and not bypass and (hit := serving.cache_flights.lookup(key)) is not None:
            _count_cache(Role.STORED, outcome)
            return hit
        return _submit_job(serving, prepared, key_id, row)

    compute = submit_job if respond_async else through_cache
    idempotency_key = request.headers.get("Idempotency-Key")
    if idempotency_key is None:
        record = compute()
    else:
        record = _idempotent(serving, spec, key_id, idempotency_key, model, payload, respond_async, compute, outcome)
    row.cache_hit = outcome.get("cache") == "hit" and not outcome.get("coalesced")
    row.coalesced = bool(outcome.get("coalesced"))
    row.idempotent_replay = bool(outcome.get("replayed"))
    return record, outcome.get("cache")


def _count_cache(role: Role, outcome: dict) -> None:
    if role is Role.STORED:
        metrics.CACHE.labels("hit").inc()
        outcome["cache"] = "hit"
    elif role is Role.FOLLOWER:
        metrics.CACHE.labels("hit").inc()
        metrics.COALESCED.inc()
        outcome["cache"] = "hit"
        outcome["coalesced"] = "true"
    else:
        metrics.CACHE.labels("miss" if role is Role.LEADER else "unavailable").inc()
        outcome["cache"] = "miss"


def _idempotent(serving, spec, key_id, idempotency_key, model, payload, respond_async, compute, outcome):
    if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise ApiError(422, f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} characters", "Idempotency-Key")
    canonical = json.dumps([model, respond_async, payload], sort_keys=True, separators=(",", ":"))
    fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
    key = f"maas:idem:{key_id}:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"
    ttl = serving.settings.idempotency_ttl_seconds
    policy = FlightPolicy(
        keep_for=lambda record: None if record.status in NOT_KEPT_FOR_IDEMPOTENCY else ttl,
        lease_seconds=spec.request_timeout_seconds + 10,
        wait_seconds=spec.request_timeout_seconds + 5,
        strict=True,
    )
    try:
        record, role = serving.flights.run(key, fingerprint, compute, policy)
    except FingerprintMismatchError as exc:
        raise ApiError(422, "Idempotency-Key: already used with a different request body", "Idempotency-Key") from exc
    except StillRunningError as exc:
        raise ApiError(
            409, "a request with this Idempotency-Key is still running", headers={"Retry-After": "1"}
        ) from exc
    except CoordinationUnavailableError as exc:
        raise ApiError(
            503, "Idempotency-Key cannot be honoured right now (state store unavailable)", headers={"Retry-After": "5"}
        ) from exc
    if role in (Role.STORED, Role.FOLLOWER):
        metrics.IDEMPOTENT_REPLAYS.inc()
        outcome["replayed"] = "true"
        record = ResponseRecord(record.status, record.body, {**record.headers, "Idempotent-Replayed": "true"})
    return record


def _run_sync(serving, prepared: PreparedRequest, key_id: str, row: InferenceLogRow, started: float) -> ResponseRecord:
    try:
        timings = DispatchTimings()
        # The request stays runnable past the sync wait: if the wait runs out, the caller gets the job instead.
        deadline_ms = serving.inference.job_deadline_ms()
        metrics.INFLIGHT_WAITS.inc()
        try:
            reply = serving.inference.run(prepared, timings, deadline_ms)
        finally:
            metrics.INFLIGHT_WAITS.dec()
        if reply is None:
            return _hand_over_as_job(serving, prepared, key_id, deadline_ms, row)
        row.record_reply(reply, published_ms=time.time() * 1000 - timings.wait_ms - timings.cleanup_ms)
        if reply.status != "ok":
            raise ApiError(REPLY_STATUS_HTTP[reply.status], reply.error or f"model worker answered {reply.status}")
        predictions = serving.inference.predictions(reply)
        row.output_bytes = sum(len(prediction["image_b64"]) * 3 // 4 for prediction in predictions)
        body = {
            "predictions": predictions,
            "model": prepared.spec.name,
            "model_version": prepared.spec.version,
            "request_id": prepared.request_id,
            "timings_ms": {
                "total": round((time.perf_counter() - started) * 1000, 2),
                "queue": round(reply.queue_ms, 2),
                "inference": round(reply.inference_ms, 2),
                "subscribe": timings.subscribe_ms,
                "publish": timings.publish_ms,
                "wait": timings.wait_ms,
                "cleanup": timings.cleanup_ms,
            },
        }
        return ResponseRecord(200, json.dumps(body).encode(), dict(JSON))
    except ApiError as error:
        return _error_record(error, prepared.request_id)


def _hand_over_as_job(
    serving, prepared: PreparedRequest, key_id: str, deadline_ms: int, row: InferenceLogRow
) -> ResponseRecord:
    spec = prepared.spec
    try:
        # Created when the request arrived, not when this 202 leaves a model's timeout later.
        serving.jobs.create(prepared.request_id, key_id, spec, deadline_ms, _epoch_ms(row.created_at))
    except redis.RedisError as exc:
        serving.redis.failed(exc)
        return _error_record(ApiError(504, f"no reply from {spec.name} within {spec.request_timeout_seconds}s"))
    row.job_id, row.endpoint = prepared.request_id, "job"
    g.deferred_job_deadline_ms = deadline_ms
    _add_webhook(serving, prepared, deadline_ms)
    metrics.JOBS.labels("converted").inc()
    return _job_record(
        prepared, f"no reply from {spec.name} within {spec.request_timeout_seconds}s; still queued as a job"
    )


def _submit_job(serving, prepared: PreparedRequest, key_id: str, row: InferenceLogRow) -> ResponseRecord:
    deadline_ms = serving.inference.job_deadline_ms()
    try:
        serving.jobs.create(prepared.request_id, key_id, prepared.spec, deadline_ms, _epoch_ms(row.created_at))
    except redis.RedisError as exc:
        serving.redis.failed(exc)
        return _error_record(ApiError(503, "job store unavailable, retry later", headers={"Retry-After": "5"}))
    _add_webhook(serving, prepared, deadline_ms)
    try:
        serving.inference.submit(prepared, deadline_ms)
    except ApiError as error:
        return _error_record(error, prepared.request_id)
    metrics.JOBS.labels("submitted").inc()
    row.job_id = prepared.request_id
    g.deferred_job_deadline_ms = deadline_ms
    return _job_record(prepared, None)


def _epoch_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _add_webhook(serving, prepared: PreparedRequest, deadline_ms: int) -> None:
    if prepared.webhook_url is None:
        return
    try:
        serving.jobs.add_webhook(prepared.request_id, prepared.webhook_url, deadline_ms)
    except redis.RedisError as exc:
        serving.redis.failed(exc)  # the job itself was just stored; its webhook is lost with Redis


def _job_record(prepared: PreparedRequest, message: str | None) -> ResponseRecord:
    location = f"/v1/jobs/{prepared.request_id}"
    body = {"id": prepared.request_id, "status": "queued", "model": prepared.spec.name, "links": {"self": location}}
    if message:
        body["message"] = message
    return ResponseRecord(202, json.dumps(body).encode(), {**JSON, "Location": location})


def _share_job(serving, record: ResponseRecord, key_id: str) -> None:
    """A coalesced caller handed the leader's job link may read that job too."""
    try:
        serving.jobs.share(json.loads(record.body)["id"], key_id)
    except redis.RedisError as exc:
        serving.redis.failed(exc)


def _error_record(error: ApiError, request_id: str | None = None) -> ResponseRecord:
    body = error_body(error.status, error.message, error.field, request_id or g.get("request_id"))
    return ResponseRecord(error.status, json.dumps(body).encode(), {**JSON, **error.headers})
