"""GET /v1/usage: the caller's own usage and GPU-seconds per day and model, read from the billing view."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

from flask import Blueprint, jsonify, request
from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema
from spectree import Response

from api_server.core.errors import ApiError
from api_server.inference_log.usage import UsageReader
from api_server.process.openapi import documented, errors
from api_server.process.routes.access import authenticated, caller
from api_server.process.state import app_state

bp = authenticated(Blueprint("usage", __name__))
MAX_DAYS = 366


class UsageQuery(BaseModel):
    since: str | SkipJsonSchema[None] = Field(
        default=None, description="`7d` (default), `30d`, or a date `2026-11-01` (UTC); at most 366 days back"
    )


class UsageRow(BaseModel):
    day: str
    model: str
    requests: int
    succeeded: int
    images: int
    cache_hits: int
    gpu_seconds: float


class UsageTotals(BaseModel):
    requests: int
    succeeded: int
    images: int
    cache_hits: int
    gpu_seconds: float


class BatchUsage(BaseModel):
    batch_job_id: str
    model: str
    lines: int = Field(description="lines that reached a model (invalid lines are not counted)")
    succeeded: int
    images: int
    gpu_seconds: float


class Usage(BaseModel):
    api_key_id: str = Field(description="the caller's key id (a digest prefix), the only key shown")
    since: str
    days: list[UsageRow]
    totals: UsageTotals
    batches: list[BatchUsage] = Field(description="GPU-seconds per batch job (POST /v1/batches) begun since then")


def parse_since(value: str | None, today: date) -> date:
    """`Nd` or an ISO date, no further back than MAX_DAYS; a bad value is a 422 naming `since`."""
    if value is None or value == "":
        return today - timedelta(days=7)
    if match := re.fullmatch(r"(\d{1,4})d", value):
        since = today - timedelta(days=int(match[1]))
    else:
        try:
            since = date.fromisoformat(value)
        except ValueError:
            raise ApiError(422, f"since {value[:40]!r}: expected Nd (e.g. 7d) or a date YYYY-MM-DD", "since") from None
    if since < today - timedelta(days=MAX_DAYS) or since > today:
        raise ApiError(422, f"since: between {MAX_DAYS} days ago and today", "since")
    return since


@bp.get("/v1/usage")
@documented(Response(HTTP_200=Usage, **errors(401, 422, 503)), query=UsageQuery, tags=["usage"])
def usage():
    """The caller's usage: requests, images, cache hits and GPU-seconds per day and model, and per batch

    From the billing view (the BigQuery inference log); rows arrive there a few seconds after the requests."""
    since = parse_since(request.args.get("since"), datetime.now(UTC).date())
    state = app_state()
    reader = state.lazy.get("usage") or state.lazy.setdefault("usage", UsageReader(state.settings))
    return jsonify(reader.usage(caller().key_id, since))
