"""No inference log row is lost or doubled when BigQuery stops or the API process is killed."""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from chaos.verdict import row_copies
from emulators.processes import ProcessRegistry, http_ok

pytestmark = pytest.mark.stack


def predict(stack, auth_headers, tag: str) -> str:
    response = requests.post(
        f"{stack.api_url}/v1/models/noop:predict",
        json={"instances": [{"prompt": tag}], "parameters": {"seed": 1}},
        headers={**auth_headers, "Cache-Control": "no-cache"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["request_id"]


@pytest.fixture
def paused_bigquery(stack):
    """SIGSTOPs the BigQuery emulator; resumes it when the test calls the returned function (or at teardown)."""
    pid = ProcessRegistry(stack.stack_dir).pid("bigquery")
    os.killpg(pid, signal.SIGSTOP)
    resumed = []

    def resume() -> None:
        if not resumed:
            os.killpg(pid, signal.SIGCONT)
            resumed.append(True)

    yield resume
    resume()


def test_bigquery_stopped_for_30s_under_traffic_loses_and_doubles_no_row(
    stack, settings, auth_headers, bigquery, paused_bigquery
):
    tag = uuid.uuid4().hex[:8]
    deadline = time.monotonic() + 30
    with ThreadPoolExecutor(4) as pool:
        sent = []
        while time.monotonic() < deadline:
            sent += list(pool.map(lambda i: predict(stack, auth_headers, f"{tag}-{i}"), range(4)))
    paused_bigquery()
    counts = row_copies(bigquery, settings, sent, wait_seconds=90)
    assert len(sent) > 40
    assert set(counts) == set(sent), f"{len(set(sent) - set(counts))} rows missing"
    assert set(counts.values()) == {1}, "rows written twice"


def test_rows_spooled_by_a_killed_api_are_delivered_once_after_its_restart(
    stack, settings, auth_headers, bigquery, paused_bigquery
):
    registry = ProcessRegistry(stack.stack_dir)
    sent = [predict(stack, auth_headers, f"spooled-{i}") for i in range(5)]
    spool = stack.stack_dir / "log-spool"
    deadline = time.monotonic() + 10
    while not any(request_id in path.read_text() for path in spool.glob("*.jsonl") for request_id in sent[-1:]):
        assert time.monotonic() < deadline, "rows never reached the spool"
        time.sleep(0.1)
    killed = registry.pid("api")
    os.killpg(killed, signal.SIGKILL)
    paused_bigquery()
    # The stack's supervisor starts the API again, as Cloud Run or Kubernetes would.
    deadline = time.monotonic() + 60
    while registry.pid("api") in (None, killed) or not http_ok(f"{stack.api_url}/healthz"):
        assert time.monotonic() < deadline, "the API was not restarted"
        time.sleep(0.2)
    counts = row_copies(bigquery, settings, sent, wait_seconds=60)
    assert counts == dict.fromkeys(sent, 1)
