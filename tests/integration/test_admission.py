"""Admission by predicted wait on the real stack: `sleep-admitted` (tests/models.fixtures.yaml) runs one request at a
time, 2 s each, on a worker of its own, with `noop` as its fallback and the catalog's default margin. A known backlog
of jobs makes a known wait: a sync request that cannot start and end within its 30 s is refused at once (or answered
by `noop` when it allows it), a job with its long deadline is still admitted, and each is logged as what happened to
it. The workers say they are ready before any request; a sequential client's answered requests are gone from the
backlog at once; a burst is refused or admitted so that no admitted request outlives its wait, and the dashboard's
admission series counts exactly the burst's 503s and fallbacks."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis
import requests

from contract.stores.inflight import InflightStore
from emulators.stack import StackConfig
from tests.conftest import open_hold, query_rows, wait_for

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


# The workers' word, the backlog a sequential client leaves, a burst, and the dashboard's count of it.


def model_load(stack, headers: dict, model: str = MODEL) -> dict:
    view = requests.get(f"{stack.api_url}/v1/status", headers=headers, timeout=10)
    assert view.status_code == 200, view.text
    (load,) = [entry for entry in view.json()["models"] if entry["model"] == model]
    return load


def ready_models(stack: StackConfig) -> set[str]:
    """The queues of the stack's deployments whose first worker says /readyz 200 now."""
    ready = set()
    for index, (_, specs) in enumerate(stack.catalog().deployments().items()):
        try:
            probe = requests.get(f"http://127.0.0.1:{stack.worker_health_port(index)}/readyz", timeout=5)
        except requests.RequestException:
            continue
        if probe.status_code == 200:
            ready |= {spec.queue for spec in specs}
    return ready


def test_every_ready_workers_models_count_it_before_any_request(stack, auth_headers):
    # Most of the stack's models are never asked anything by this module: their workers are up and idle. Each
    # counts its ready worker, so a first burst is judged by the fleet it has, not refused for want of history.
    queues = {(spec.name, spec.version): spec.queue for spec in stack.catalog().units()}

    def uncounted() -> list[str]:
        view = requests.get(f"{stack.api_url}/v1/status", headers=auth_headers, timeout=10).json()["models"]
        ready = ready_models(stack)
        assert len(ready) >= 5, ready  # most of the stack's workers are up (a test may have just restarted one)
        return [queue for entry in view if (queue := queues[entry["model"], entry["model_version"]]) in ready
                and entry["workers"] < 1]  # fmt: skip

    wait_for(lambda: not uncounted(), "every ready worker's models counting it", timeout=30)


def test_a_sequential_clients_answered_requests_leave_the_backlog_at_once_and_none_is_refused(stack, auth_headers):
    wait_for(lambda: model_load(stack, auth_headers)["held"] == 0 and not sum(
        model_load(stack, auth_headers)["waiting"].values()), "an idle sleep-admitted", timeout=120)  # fmt: skip
    for _ in range(4):
        answer = predict(stack, auth_headers)
        assert answer.status_code == 200, answer.text  # never refused: nothing else is in flight
        load = model_load(stack, auth_headers)
        # Answered: neither waiting nor held, the moment its caller has the answer.
        assert (load["waiting"], load["held"]) == ({"high": 0, "normal": 0}, 0), load
        assert load["workers"] >= 1 and load["predicted_start_seconds"] == 0.0


BURST = 32  # about twice what one worker answers in a 30 s wait at 2 s a request


@pytest.fixture(scope="module")
def burst(stack, auth_headers) -> list[dict]:
    """`BURST` sync requests sent at once to an idle `sleep-admitted` whose call time is known, half allowing the
    fallback: each one's status, request id, the model that answered it and how long it took."""
    wait_for(lambda: model_load(stack, auth_headers)["held"] == 0 and not sum(
        model_load(stack, auth_headers)["waiting"].values()), "an idle sleep-admitted", timeout=120)  # fmt: skip
    for _ in range(2):  # its call time (and spread) known, as a model that has served has
        assert predict(stack, auth_headers).status_code == 200
    start = threading.Barrier(BURST)
    outcomes: list[dict] = [{} for _ in range(BURST)]

    def send(index: int) -> None:
        body_ = body(f"burst {index} {uuid.uuid4().hex}", allow_fallback=index % 2 == 0)
        start.wait()
        sent = time.monotonic()
        response = requests.post(f"{stack.api_url}/v1/models/{MODEL}:predict", json=body_, headers=auth_headers,
                                 timeout=90)  # fmt: skip
        answer = response.json()
        outcomes[index] = {
            "status": response.status_code,
            "request_id": response.headers.get("X-Request-Id"),
            "model": answer.get("model"),
            "fallback": "fallback_from" in answer,
            "seconds": time.monotonic() - sent,
        }

    threads = [threading.Thread(target=send, args=(index,)) for index in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(outcomes), "a burst request got no answer"
    kinds = Counter("fallback" if o["fallback"] else o["status"] for o in outcomes)
    admitted = [o["seconds"] for o in outcomes if o["status"] in (200, 202) and not o["fallback"]]
    print(f"burst of {BURST}: {dict(kinds)}; admitted answered in at most {max(admitted, default=0):.1f} s")
    return outcomes


def test_no_request_admission_lets_through_in_a_burst_becomes_a_job(burst):
    statuses = Counter(outcome["status"] for outcome in burst)
    by_model = [outcome for outcome in burst if outcome["status"] == 200 and not outcome["fallback"]]
    fell_back = [outcome for outcome in burst if outcome["fallback"]]
    # Twice the capacity of its wait: some answered by the model, the rest refused at once or answered by `noop`.
    assert by_model and (statuses[503] or fell_back), statuses
    # No admitted request was handed back as a 202 job: each was answered by the model within its 30 s wait.
    assert statuses[202] == 0, burst
    assert set(statuses) <= {200, 503} and all(outcome["seconds"] < 30 for outcome in by_model), burst
    assert all(outcome["model"] == "noop" for outcome in fell_back)


def admission_series(line: dict, metric: dict) -> tuple[str, ...] | None:
    """The labels the log-based metric (terraform's `google_logging_metric`) gives one JSON log line, or None when
    its filter leaves the line out. Its filter's clauses on the line (jsonPayload) are applied; the others name the
    Cloud Run service, which every line of the local API process is."""
    for clause in metric["filter"].split(" AND "):
        if clause.startswith("jsonPayload."):
            path, operator = clause.removeprefix("jsonPayload.").split(":", 1)
            assert operator == "*", f"a filter clause this test does not read: {clause}"
            if _field(line, path) is None:
                return None
        else:
            assert clause.startswith("resource."), f"a filter clause this test does not read: {clause}"
    labels = []
    for label, extractor in sorted(metric["label_extractors"].items()):
        path = extractor.removeprefix("EXTRACT(jsonPayload.").removesuffix(")")
        assert extractor == f"EXTRACT(jsonPayload.{path})", extractor
        labels.append(f"{label}={_field(line, path)}")
    return tuple(labels)


def _field(line: dict, path: str):
    for part in path.split("."):
        line = line.get(part) if isinstance(line, dict) else None
    return line


def test_the_dashboards_admission_series_count_the_bursts_503s_and_fallbacks(stack: StackConfig, burst):
    from tests.infra.test_terraform import TERRAFORM_DIR, _load  # the dashboard's file alone: seconds less to parse

    (metric,) = [block["google_logging_metric"]["admission_decisions"]
                 for block in _load(TERRAFORM_DIR / "dashboard.tf")["resource"] if "google_logging_metric" in block]  # fmt: skip
    ids = {outcome["request_id"] for outcome in burst}
    lines = []
    for raw in (Path(stack.stack_dir) / "logs" / "api.log").read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("request_id") in ids:
            lines.append(line)
    series = [(line["request_id"], admission_series(line, metric)) for line in lines]
    counted = Counter(labels for _, labels in series if labels is not None)
    refused = sum(outcome["status"] == 503 for outcome in burst)
    fell_back = sum(outcome["fallback"] for outcome in burst)
    # The tile's series for the model, by decision: exactly what the burst's callers got, one line per request.
    expected = Counter(
        {("decision=refused", f"model={MODEL}"): refused, ("decision=fallback", f"model={MODEL}"): fell_back}
    )
    assert counted == +expected, series
    per_request = Counter(request_id for request_id, labels in series if labels is not None)
    assert max(per_request.values(), default=1) == 1
