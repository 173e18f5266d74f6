"""Rows from real requests carry the right values: a miss, a cache hit, coalesced requests, a job, errors."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
import requests

from tests.conftest import query_rows

pytestmark = pytest.mark.stack


def rows_for(bigquery, settings, request_ids: list[str]) -> dict[str, dict]:
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    ids = ", ".join(f"'{request_id}'" for request_id in request_ids)
    rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id IN ({ids})", len(request_ids), timeout=60)
    return {row["request_id"]: row for row in rows}


def predict(stack, auth_headers, model: str, seed: int, **extra) -> requests.Response:
    return requests.post(
        f"{stack.api_url}/v1/models/{model}:predict",
        json={"instances": [{"prompt": "logged"}], "parameters": {"seed": seed}},
        headers=auth_headers,
        timeout=60,
        **extra,
    )


def test_a_miss_then_a_cache_hit(stack, auth_headers, bigquery, settings):
    seed = random.randrange(10**6)
    miss, hit = predict(stack, auth_headers, "noop", seed), predict(stack, auth_headers, "noop", seed)
    assert (miss.headers["X-Cache"], hit.headers["X-Cache"]) == ("miss", "hit")
    rows = rows_for(bigquery, settings, [miss.headers["X-Request-Id"], hit.headers["X-Request-Id"]])
    first, second = rows[miss.headers["X-Request-Id"]], rows[hit.headers["X-Request-Id"]]
    assert first["status"] == "ok" and first["cache_hit"] is False and first["endpoint"] == "sync"
    assert first["batch_id"] and first["batch_size"] >= 1 and first["accelerator"] == "synthetic"
    assert first["attempt"] == 1 and first["worker_id"] and first["reply_mode"] == "per-request"
    assert first["priority"] == "normal" and first["output_bytes"] > 0 and first["schema_version"] == 4
    assert first["created_at"] <= first["published_at"] <= first["worker_started_at"] <= first["replied_at"]
    assert second["status"] == "ok" and second["cache_hit"] is True and second["batch_id"] is None


def test_identical_concurrent_requests_log_one_run_and_the_rest_coalesced(stack, auth_headers, bigquery, settings):
    seed = random.randrange(10**6)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: predict(stack, auth_headers, "sleep", seed), range(4)))
    assert {response.status_code for response in responses} == {200}
    rows = rows_for(bigquery, settings, [response.headers["X-Request-Id"] for response in responses])
    ran = [row for row in rows.values() if not row["coalesced"] and not row["cache_hit"]]
    assert len(ran) == 1 and ran[0]["batch_id"]
    assert sum(bool(row["coalesced"]) for row in rows.values()) + sum(bool(r["cache_hit"]) for r in rows.values()) == 3


def test_a_job_is_logged_once_with_its_outcome(stack, auth_headers, bigquery, settings):
    response = requests.post(
        f"{stack.api_url}/v1/models/noop/jobs",
        json={"instances": [{"prompt": "a job"}], "parameters": {"seed": random.randrange(10**6)}},
        headers=auth_headers,
        timeout=30,
    )
    assert response.status_code == 202
    job_id = response.json()["id"]
    deadline = time.monotonic() + 30
    while requests.get(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10).json()["status"] != (
        "succeeded"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    row = rows_for(bigquery, settings, [job_id])[job_id]
    assert (row["status"], row["http_status"], row["endpoint"], row["job_id"]) == ("ok", 202, "job", job_id)
    assert row["batch_id"] and row["worker_started_at"] is not None
    # End to end, not the 202: from the request's arrival to its result being available (the job's end).
    view = requests.get(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10).json()
    assert row["replied_at"] == datetime.fromisoformat(view["finished_at"]) >= row["worker_finished_at"]
    # Both are whole milliseconds, read from the clock within the same millisecond or across one boundary.
    assert abs((row["created_at"] - datetime.fromisoformat(view["created_at"])).total_seconds()) <= 0.001
    end_to_end_ms = (row["replied_at"] - row["created_at"]).total_seconds() * 1000
    assert row["total_ms"] == pytest.approx(end_to_end_ms, abs=0.5)


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        ("/v1/models/nope:predict", {"instances": [{"prompt": "x"}]}, 404, "not_found"),
        ("/v1/models/noop:predict", {"instances": [{"prompt": ""}]}, 422, "invalid_request"),
    ],
)
def test_refused_requests_are_logged_with_their_kind(stack, auth_headers, bigquery, settings, path, body, status, kind):
    response = requests.post(f"{stack.api_url}{path}", json=body, headers=auth_headers, timeout=30)
    assert response.status_code == status
    request_id = response.headers["X-Request-Id"]
    row = rows_for(bigquery, settings, [request_id])[request_id]
    assert (row["http_status"], row["error_kind"], row["status"]) == (status, kind, "rejected")
    # An unknown model is refused before routing: no model version, so no model's usage in the views.
    assert (row["model_version"] is None) == (status == 404)


def test_a_version_that_fails_every_call_is_logged_as_a_worker_error_not_bad_input(
    stack, auth_headers, bigquery, settings
):
    """`rollback-bad` version 2 (`fails: true` in the local catalog) fails in the model, not in its input."""
    response = requests.post(
        f"{stack.api_url}/v1/models/rollback-bad/versions/2:predict",
        json={"instances": [{"prompt": "a broken canary"}]},
        headers=auth_headers,
        timeout=60,
    )
    assert response.status_code == 500, response.text
    request_id = response.headers["X-Request-Id"]
    row = rows_for(bigquery, settings, [request_id])[request_id]
    assert (row["http_status"], row["status"], row["error_kind"]) == (500, "error", "inference_failed")
    assert row["model_version"] == "2"
