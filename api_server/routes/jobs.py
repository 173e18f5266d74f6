"""Jobs: GET /v1/jobs/<id> reads one; DELETE cancels it. (Jobs are submitted through `predict.py`.)"""

from __future__ import annotations

from flask import Blueprint, jsonify
from spectree import Response

from api_server import metrics
from api_server.openapi import JobView, documented, errors
from api_server.routes.access import authenticated, caller
from api_server.state import app_state

bp = authenticated(Blueprint("jobs", __name__))


@bp.get("/v1/jobs/<job_id>")
@documented(Response(HTTP_200=JobView, **errors(401, 404, 503)), tags=["jobs"])
def read(job_id: str):
    """Read a job: its status, progress, result or error"""
    serving = app_state().serving
    job = serving.job(job_id, caller())
    metrics.JOB_STATES.labels(job.status).inc()
    return jsonify(serving.job_view(job))


@bp.delete("/v1/jobs/<job_id>")
@documented(Response(HTTP_200=JobView, **errors(401, 404, 409, 503)), tags=["jobs"])
def cancel(job_id: str):
    """Cancel a job

    A queued job never runs; a running one stops at its next step. 409 once finished (succeeded, failed,
    expired, or already cancelled)."""
    serving = app_state().serving
    job = serving.cancel(serving.job(job_id, caller()))
    metrics.JOBS.labels("cancelled").inc()
    return jsonify(serving.job_view(job))
