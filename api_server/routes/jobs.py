"""Jobs: POST /v1/models/<model>/jobs submits and answers 202; GET /v1/jobs/<id> reads; DELETE cancels."""

from __future__ import annotations

import redis
from flask import Blueprint, current_app, jsonify, request
from spectree import Response

from api_server import metrics
from api_server.errors import ApiError
from api_server.jobs import JobState, job_view
from api_server.openapi import INFERENCE_RESPONSES, InferenceHeaders, JobView, documented, errors
from api_server.routes.predict import accept
from api_server.schemas import PredictBody

bp = Blueprint("jobs", __name__)
FINISHED = ("succeeded", "failed", "expired")


@bp.post("/v1/models/<model:model>/jobs")
@documented(INFERENCE_RESPONSES, json=PredictBody, headers=InferenceHeaders, tags=["jobs"])
def submit(model: str):
    """Submit a job

    Answers 202 at once with the job (200 when the result cache already holds the answer)."""
    return accept(model, respond_async=True)


@bp.get("/v1/jobs/<job_id>")
@documented(Response(HTTP_200=JobView, **errors(401, 404, 503)), tags=["jobs"])
def read(job_id: str):
    """Read a job: its status, progress, result or error"""
    job = _owned_job(job_id)
    metrics.JOB_STATES.labels(job.status).inc()
    return jsonify(_view(job))


@bp.delete("/v1/jobs/<job_id>")
@documented(Response(HTTP_200=JobView, **errors(401, 404, 409, 503)), tags=["jobs"])
def cancel(job_id: str):
    """Cancel a job

    A queued job never runs; a running one stops at its next step. 409 once finished."""
    job = _owned_job(job_id)
    if job.status in FINISHED:
        raise ApiError(409, f"job {job_id} already finished ({job.status})")
    if job.status != "cancelled":
        serving = current_app.extensions["maas_serving"]
        _guarded(lambda: serving.jobs.cancel(job_id))
        metrics.JOBS.labels("cancelled").inc()
        job.status, job.progress = "cancelled", None
    return jsonify(_view(job))


def _owned_job(job_id: str) -> JobState:
    services = current_app.extensions["maas"]
    key_id = services.auth.authenticate(request)
    serving = current_app.extensions["maas_serving"]
    job = _guarded(lambda: serving.jobs.get(job_id, key_id)) if len(job_id) <= 64 else None
    if job is None:  # another key's job is as absent as one that never existed
        raise ApiError(404, f"no job {job_id!r}")
    return job


def _guarded(action):
    serving = current_app.extensions["maas_serving"]
    try:
        result = action()
    except redis.RedisError as exc:
        serving.redis.failed(exc)
        raise ApiError(503, "job store unavailable, retry later", headers={"Retry-After": "5"}) from exc
    serving.redis.succeeded()
    return result


def _view(job: JobState) -> dict:
    return job_view(job, current_app.extensions["maas_serving"].inference.predictions)
