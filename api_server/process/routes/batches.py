"""Batch jobs (issue 35): POST /v1/batches submits one, GET reads or lists the caller's, DELETE cancels one (as
DELETE cancels a job), and /results and /errors read its output files back. The work is `api_server/batches/`."""

from __future__ import annotations

from typing import Literal

from flask import Blueprint, Response, jsonify, request, stream_with_context
from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema
from spectree import Response as Documented

from api_server.core.errors import ApiError
from api_server.process.openapi import documented, errors
from api_server.process.routes.access import authenticated, caller
from api_server.process.state import app_state
from contract.digits import ascii_digits

bp = authenticated(Blueprint("batches", __name__))
BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired"
]


class BatchLine(BaseModel):
    custom_id: str = Field(description="unique in the batch: its result line and error line carry it")
    model: str = Field(description="a model of GET /v1/models (adapters in parameters.adapters)")
    instances: list[dict]
    parameters: dict = Field(default_factory=dict, description="as a predict's, without priority")


class BatchBody(BaseModel):
    input_file: str | SkipJsonSchema[None] = Field(
        default=None,
        description="gs://bucket/object of a JSONL file, one BatchLine per line (read as a stream), under one of the "
        "key's batch input locations (MAAS_BATCH_INPUTS); anything else, missing or not, is one 422",
    )
    requests: list[BatchLine] | SkipJsonSchema[None] = Field(
        default=None, description="the lines inline instead: at most MAAS_BATCH_INLINE_MAX_LINES (1,000)"
    )
    input_table: str | SkipJsonSchema[None] = Field(
        default=None,
        description="bq://project.dataset.table instead: each row a line, its columns the BatchLine's fields (custom_id "
        "and model STRING; instances and parameters JSON, STRING of JSON text or RECORD), read by position; under one "
        "of the key's batch input locations (MAAS_BATCH_INPUTS); anything else, missing or not, is one 422",
    )
    completion_window: str = Field(default="24h", description="24h, 30m, 90s: from 5s to 168h")
    webhook_url: str | SkipJsonSchema[None] = Field(default=None, description="https URL called once at the end")
    metadata: dict[str, str] = Field(default_factory=dict, description="up to 16 keys, kept as given")


class RequestCounts(BaseModel):
    total: int = Field(description="lines read so far; once ended, every line of the file (row of the table)")
    succeeded: int
    failed: int = Field(description="invalid lines and lines the model failed")
    cancelled: int
    expired: int


class BatchError(BaseModel):
    code: int
    message: str


class BatchView(BaseModel):
    id: str
    object: Literal["batch"]
    status: BatchStatus
    input_file: str | None = Field(default=None, description="the gs:// input file (null for a table's batch)")
    input_table: str | None = Field(default=None, description="the bq:// input table, for a table's batch")
    completion_window: str
    request_counts: RequestCounts
    created_at: str
    expires_at: str
    in_progress_at: str | None = None
    finalizing_at: str | None = None
    cancelling_at: str | None = None
    completed_at: str | None = None
    failed_at: str | None = None
    cancelled_at: str | None = None
    expired_at: str | None = None
    output: dict[str, str] = Field(description="gs:// prefixes of the results and errors part files and images")
    links: dict[str, str]
    metadata: dict[str, str]
    error: BatchError | None = Field(default=None, description="why a failed batch failed")


class BatchList(BaseModel):
    batches: list[BatchView] = Field(description="newest first")
    next_before: str | None = Field(description="pass as `before` for the next page; null when nothing is left")


class BatchListQuery(BaseModel):
    limit: int = Field(default=20, ge=1, le=100)
    before: str | SkipJsonSchema[None] = Field(default=None, description="`next_before` of the previous page")


def _batches():
    return app_state().batches


@bp.post("/v1/batches")
@documented(Documented(HTTP_200=BatchView, **errors(400, 401, 422, 429, 503)), json=BatchBody, tags=["batches"])
def submit():
    """Submit a batch

    A JSONL file in GCS (or the lines inline), run at batch priority on idle capacity; each line validated as
    the predict route validates a body. Results and errors are written as they finish, one line per custom_id.
    429 when the key has MAAS_BATCH_MAX_ACTIVE_PER_KEY batches not yet ended."""
    body = request.get_json(silent=True)
    if body is None:
        raise ApiError(400, "body must be a JSON object (Content-Type: application/json)")
    return jsonify(_batches().submit(body, caller()))


@bp.get("/v1/batches")
@documented(Documented(HTTP_200=BatchList, **errors(401, 422, 503)), query=BatchListQuery, tags=["batches"])
def list_batches():
    """List the caller's batches, newest first"""
    raw_limit, before = request.args.get("limit", "20"), request.args.get("before")
    if not ascii_digits(raw_limit) or not 1 <= int(raw_limit) <= 100:
        raise ApiError(422, f"limit {raw_limit[:20]!r}: a whole number from 1 to 100", "limit")
    if before is not None and not (ascii_digits(before) and len(before) <= 15):
        raise ApiError(422, "before: pass the next_before of a previous page unchanged", "before")
    limit = int(raw_limit)
    batches = _batches().list(caller(), limit, int(before) if before else None)
    next_before = None
    if len(batches) == limit:
        last = batches[-1]["created_at"]
        from datetime import datetime

        next_before = str(int(datetime.fromisoformat(last).timestamp() * 1000))
    return jsonify({"batches": batches, "next_before": next_before})


@bp.get("/v1/batches/<batch_id>")
@documented(Documented(HTTP_200=BatchView, **errors(401, 404, 503)), tags=["batches"])
def read(batch_id: str):
    """Read a batch: status, request_counts, times, output locations"""
    service = _batches()
    return jsonify(service.view(service.get(batch_id, caller())))


@bp.delete("/v1/batches/<batch_id>")
@documented(Documented(HTTP_200=BatchView, **errors(401, 404, 409, 503)), tags=["batches"])
def cancel(batch_id: str):
    """Cancel a batch

    Nothing more is fed; lines in flight are answered cancelled; what finished stays in the results. 409 once
    it has ended, or once a cancel was accepted (the status never goes back from `cancelling`)."""
    service = _batches()
    return jsonify(service.cancel(service.get(batch_id, caller())))


@bp.get("/v1/batches/<batch_id>/results")
@documented(Documented(HTTP_200=None, **errors(401, 404)), tags=["batches"])
def results(batch_id: str):
    """The results file so far (JSONL, one line per succeeded custom_id)"""
    return _output(batch_id, "results")


@bp.get("/v1/batches/<batch_id>/errors")
@documented(Documented(HTTP_200=None, **errors(401, 404)), tags=["batches"])
def errors_file(batch_id: str):
    """The errors file so far (JSONL, one line per failed, cancelled or expired custom_id)"""
    return _output(batch_id, "errors")


def _output(batch_id: str, kind: str) -> Response:
    service = _batches()
    batch = service.get(batch_id, caller())
    return Response(stream_with_context(service.output(batch, kind)), mimetype="application/jsonl")
