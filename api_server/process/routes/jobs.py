"""Jobs: GET /v1/jobs lists the caller's; GET /v1/jobs/<id> reads one; DELETE cancels it. (Jobs are submitted
through `predict.py`.)"""

from __future__ import annotations

import re
import typing

from flask import Blueprint, jsonify, request
from spectree import Response

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.jobs.service import JobCursor
from api_server.process.openapi import JobList, JobListQuery, JobStatus, JobView, documented, errors
from api_server.process.routes.access import authenticated, caller
from api_server.process.state import app_state
from contract.digits import ascii_digits

bp = authenticated(Blueprint("jobs", __name__))
STATES = typing.get_args(JobStatus)
CURSOR = re.compile(r"(\d{1,15})_([0-9A-Za-z-]{1,64})")


@bp.get("/v1/jobs")
@documented(Response(HTTP_200=JobList, **errors(401, 422, 503)), query=JobListQuery, tags=["jobs"])
def list_jobs():
    """List the caller's jobs, newest first

    Only the caller's own jobs (and jobs its identical requests shared), while their records live
    (`MAAS_RESULT_TTL_SECONDS`). Page with `cursor`; filter with `state`."""
    limit, state, cursor = _list_query(request.args)
    jobs, next_cursor = app_state().serving.list_jobs(caller(), limit, cursor, state)
    return jsonify({"jobs": jobs, "next_cursor": None if next_cursor is None else str(next_cursor)})


def _list_query(args) -> tuple[int, str | None, JobCursor | None]:
    """limit, state and cursor, each checked; a bad one is a 422 naming it."""
    raw_limit = args.get("limit", "20")
    if not ascii_digits(raw_limit) or not 1 <= int(raw_limit) <= 100:
        raise ApiError(422, f"limit {raw_limit[:20]!r}: a whole number from 1 to 100", "limit")
    state = args.get("state") or None
    if state is not None and state not in STATES:
        raise ApiError(422, f"state {state[:20]!r}: one of {', '.join(STATES)}", "state")
    cursor = None
    if raw_cursor := args.get("cursor"):
        if not (match := CURSOR.fullmatch(raw_cursor)):
            raise ApiError(422, "cursor: pass the next_cursor of a previous page unchanged", "cursor")
        cursor = JobCursor(int(match[1]), match[2])
    return int(raw_limit), state, cursor


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
