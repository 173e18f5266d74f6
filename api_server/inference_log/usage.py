"""The caller's own usage, read from the billing view: one parameterised query per call, one client per process."""

from __future__ import annotations

import threading
from datetime import date

from google.api_core import exceptions as google_exceptions
from google.cloud import bigquery

from api_server.core.errors import ApiError
from contract import google_clients
from contract.settings import Settings

BILLING_VIEW = "billing_by_api_key_daily"
BATCH_VIEW = "gpu_seconds_by_batch"
COUNTS = ("requests", "succeeded", "images", "cache_hits")


class UsageReader:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._client: bigquery.Client | None = None
        self._lock = threading.Lock()

    def _bigquery(self) -> bigquery.Client:
        """Made on the first call (after gunicorn forked)."""
        with self._lock:
            if self._client is None:
                self._client = google_clients.bigquery_client(self._settings)
            return self._client

    def usage(self, key_id: str, since: date) -> dict:
        """Per day and model, and totals, for one key only; BigQuery unreachable is a 503."""
        settings = self._settings
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
            rows = [dict(row) for row in self._bigquery().query(sql, job_config=config).result(timeout=20)]
        except (google_exceptions.GoogleAPICallError, google_exceptions.RetryError, TimeoutError) as exc:
            raise ApiError(503, "usage is unavailable right now, retry later", headers={"Retry-After": "10"}) from exc
        days = [
            {
                "day": row["day"],
                "model": row["model"],
                **{name: int(row[name] or 0) for name in COUNTS},
                "gpu_seconds": round(float(row["gpu_seconds"] or 0), 3),
            }
            for row in rows
        ]
        totals: dict = {name: sum(day[name] for day in days) for name in COUNTS}
        totals["gpu_seconds"] = round(sum(day["gpu_seconds"] for day in days), 3)
        batches = self._batches(key_id, since, config)
        return {"api_key_id": key_id, "since": since.isoformat(), "days": days, "totals": totals, "batches": batches}

    def _batches(self, key_id: str, since: date, config: bigquery.QueryJobConfig) -> list[dict]:
        """GPU-seconds per batch job (its lines' inferences), for batches begun since `since`."""
        settings = self._settings
        sql = (
            "SELECT batch_job_id, model, lines, succeeded, images, gpu_seconds "
            f"FROM `{settings.project_id}.{settings.dataset}.{BATCH_VIEW}` "
            "WHERE api_key_id = @key AND day >= @since ORDER BY batch_job_id, model"
        )
        try:
            rows = [dict(row) for row in self._bigquery().query(sql, job_config=config).result(timeout=20)]
        except (google_exceptions.GoogleAPICallError, google_exceptions.RetryError, TimeoutError) as exc:
            raise ApiError(503, "usage is unavailable right now, retry later", headers={"Retry-After": "10"}) from exc
        return [
            {
                "batch_job_id": row["batch_job_id"],
                "model": row["model"],
                **{name: int(row[name] or 0) for name in ("lines", "succeeded", "images")},
                "gpu_seconds": round(float(row["gpu_seconds"] or 0), 3),
            }
            for row in rows
        ]
