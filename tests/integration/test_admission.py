"""Admission by predicted wait on the real stack: `sleep-admitted` (tests/models.fixtures.yaml) runs one request at a
time, 2 s each, on a worker of its own, with `noop` as its fallback. A known backlog of jobs makes a known wait: a
sync request that cannot start and end within its 30 s is refused at once (or answered by `noop` when it allows
it), a job with its long deadline is still admitted, and each is logged as what happened to it."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import requests

from contract.stores.inflight import InflightStore
from tests.conftest import open_hold, query_rows

pytestmark = pytest.mark.stack
MODEL = "sleep-admitted"
JOBS = 25  # 50 s of work ahead: far past a sync request's 30 s, well within a job's 900 s


def body(prompt: str | None = None, **extra) -> dict:
    return {"instances": [{"prompt": prompt or f"admission {uuid.uuid4().hex}"}], **extra}


def predict(stack, headers: dict, **extra) -> requests.Response:
    return requests.post(f"{stack.api_url}/v1/models/{MODEL}:predict", json=body(**extra), headers=headers, timeout=60)


def submit_job(stack, headers: dict, prompt: str | None = None) -> requests.Response:
    return requests.post(f"{stack.api_url}/v1/models/{MODEL}/jobs", json=body(prompt), headers=headers, timeout=30)


def wait_until_held(inflight: InflightStore, job_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while job_id not in inflight.holders():
        assert time.monotonic() < deadline, f"no worker took {job_id} within {timeout}s"
        time.sleep(0.05)


def test_an_overloaded_model_refuses_at_once_falls_back_when_allowed_and_still_admits_a_long_deadline(
    stack, auth_headers, settings, bigquery
):
    inflight = InflightStore(redis.Redis.from_url(settings.redis_url))
    # One answered request: the model's run time is known (about 2 s).
    warm = predict(stack, auth_headers)
    assert warm.status_code == 200, warm.text
    # A backlog: the first job is seen running (the fleet's capacity: one at a time), the rest wait behind it. Its
    # call is held after its first step until the test ends (a `!hold` prompt): nothing drains the backlog however
    # slowly the test submits it on a loaded machine.
    gate = f"admission-{uuid.uuid4().hex}"
    first = submit_job(stack, auth_headers, prompt=f"!hold {gate}")
    assert first.status_code == 202, first.text
    jobs = [first.json()["id"]]
    try:
        wait_until_held(inflight, jobs[0])
        for _ in range(JOBS - 1):
            job = submit_job(stack, auth_headers)
            assert job.status_code == 202, job.text  # judged against its 900 s: admitted
            jobs.append(job.json()["id"])

        refused = predict(stack, auth_headers)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "overloaded" in message
        # The status view's data: the backlog admission judged by, as GET /v1/status gives it to the page.
        view = requests.get(f"{stack.api_url}/v1/status", headers=auth_headers, timeout=10)
        assert view.status_code == 200, view.text
        (load,) = [model for model in view.json()["models"] if model["model"] == MODEL]
        # Retry-After from the estimate: the backlog ahead and the request itself at the model's measured run time
        # (2 s a request plus what a busy machine adds), beyond what fits in its 30 s; the time the request already
        # spent in the API counts against its deadline, so up to 10 s more on a crowded machine.
        retry_after = int(refused.headers["Retry-After"])
        assert 1 <= retry_after <= (JOBS + 1) * load["run_seconds"] - 30 + 10 and f"retry in {retry_after}s" in message
        assert load["admission"] and load["waiting"]["normal"] > 15 and load["workers"] >= 1
        assert load["predicted_start_seconds"] > 30 and load["run_seconds"] > 0
        page = requests.get(f"{stack.api_url}/status", timeout=10)
        assert page.status_code == 200 and "/playground/status.js" in page.text
        assert requests.get(f"{stack.api_url}/playground/status.js", timeout=10).status_code == 200

        fallen = predict(stack, auth_headers, allow_fallback=True)
        assert fallen.status_code == 200, fallen.text
        answer = fallen.json()
        assert (answer["model"], answer["model_version"], answer["fallback_from"]["model"]) == ("noop", "1", MODEL)
        assert fallen.headers["X-MaaS-Fallback-From"] == f"{MODEL}/1" and answer["predictions"]

        late_job = submit_job(stack, auth_headers)
        assert late_job.status_code == 202, late_job.text  # the same backlog, against a job's own deadline
        jobs.append(late_job.json()["id"])
    finally:
        for job_id in jobs:
            requests.delete(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10)
        open_hold(stack, gate)

    refused_id, fallen_id = refused.json()["error"]["request_id"], answer["request_id"]
    table = f"`{settings.project_id}.{settings.dataset}.inference_log`"
    sql = (
        f"SELECT request_id, model, model_version, status, error_kind, http_status, overload_fallback_from "
        f"FROM {table} WHERE request_id IN ('{refused_id}', '{fallen_id}')"
    )
    rows = {row["request_id"]: row for row in query_rows(bigquery, sql, 2, timeout=60)}
    assert {key: rows[refused_id][key] for key in ("model", "status", "error_kind", "http_status")} == {
        "model": MODEL, "status": "overloaded", "error_kind": "overloaded", "http_status": 503,
    }  # fmt: skip
    # The fallback's row is the fallback's: billed as `noop`, naming the model asked for.
    fallen_row = rows[fallen_id]
    assert (fallen_row["model"], fallen_row["model_version"], fallen_row["status"]) == ("noop", "1", "ok")
    assert fallen_row["overload_fallback_from"] == f"{MODEL}/1"
