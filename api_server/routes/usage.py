"""GET /v1/usage: the caller's own usage and GPU-seconds per day and model, read from the billing view."""

from __future__ import annotations

import re
import threading
from datetime import UTC, date, datetime, timedelta

from flask import Blueprint, Flask, current_app, jsonify, request
from google.api_core import exceptions as google_exceptions
from google.cloud import bigquery
from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema
from spectree import Response

from api_server.errors import ApiError
from api_server.openapi import documented, errors
from contract import clients

bp = Blueprint("usage", __name__)
BILLING_VIEW = "billing_by_api_key_daily"
MAX_DAYS = 366
_client_lock = threading.Lock()


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


class Usage(BaseModel):
    api_key_id: str = Field(description="the caller's key id (a digest prefix), the only key shown")
    since: str
    days: list[UsageRow]
    totals: UsageTotals


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
    """The caller's usage: requests, images, cache hits and GPU-seconds per day and model

    From the billing view (the BigQuery inference log); rows arrive there a few seconds after the requests."""
    key_id = current_app.extensions["maas"].auth.authenticate(request)
    since = parse_since(request.args.get("since"), datetime.now(UTC).date())
    settings = current_app.extensions["maas"].settings
    sql = (
        "SELECT CAST(day AS STRING) AS day, model, requests, succeeded, images, cache_hits, gpu_seconds "
        f"FROM `{settings.project_id}.{settings.dataset}.{BILLING_VIEW}` "
        "WHERE api_key_id = @key AND day >= @since ORDER BY day, model"
    )
    config = bigquery.QueryJobConfig(
        query_parameters=[
            bigquery.ScalarQueryParameter("key", "STRING", key_id),
            bigquery.ScalarQueryParameter("since", "DATE", since),
        ]
    )
    try:
        rows = [dict(row) for row in bigquery_client(current_app).query(sql, job_config=config).result(timeout=20)]
    except (google_exceptions.GoogleAPICallError, google_exceptions.RetryError, TimeoutError) as exc:
        raise ApiError(503, "usage is unavailable right now, retry later", headers={"Retry-After": "10"}) from exc
    days = [
        {
            "day": row["day"],
            "model": row["model"],
            **{name: int(row[name] or 0) for name in ("requests", "succeeded", "images", "cache_hits")},
            "gpu_seconds": round(float(row["gpu_seconds"] or 0), 3),
        }
        for row in rows
    ]
    totals = {name: sum(day[name] for day in days) for name in ("requests", "succeeded", "images", "cache_hits")}
    totals["gpu_seconds"] = round(sum(day["gpu_seconds"] for day in days), 3)
    return jsonify({"api_key_id": key_id, "since": since.isoformat(), "days": days, "totals": totals})


def bigquery_client(app: Flask) -> bigquery.Client:
    """One query client per process, made on the first call (after gunicorn forked)."""
    client = app.extensions.get("maas_bigquery_query")
    if client is None:
        with _client_lock:
            client = app.extensions.setdefault(
                "maas_bigquery_query", clients.bigquery_client(app.extensions["maas"].settings)
            )
    return client
