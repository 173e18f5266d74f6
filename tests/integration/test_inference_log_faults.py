"""No inference log row is lost or doubled when BigQuery stops or the API process is killed."""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
import requests

from api_server.inference_log.bigquery_write import StorageWriteSink, write_client
from api_server.inference_log.spool import LogSpool
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter
from chaos.verdict import row_copies
from contract.log_schema import bigquery_schema
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import restart

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
    deadline = time.monotonic() + 60  # bounds a hang only
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


def test_a_batch_committed_just_before_a_bigquery_restart_is_stored_once(stack, settings, bigquery, tmp_path):
    from google.cloud import bigquery as bq

    table = f"log_restart_{uuid.uuid4().hex[:8]}"
    bigquery.create_table(bq.Table(f"{settings.project_id}.{settings.dataset}.{table}", schema=bigquery_schema()))
    sink = StorageWriteSink(
        write_client(settings), f"projects/{settings.project_id}/datasets/{settings.dataset}/tables/{table}", bigquery
    )
    spool = LogSpool(tmp_path, 1 << 20)
    now = datetime.now(UTC)
    rows = [
        InferenceLogRow(request_id=uuid.uuid4().hex, created_at=now, model="noop", status="ok", http_status=200)
        for _ in range(5)
    ]
    segment = spool.append([row.to_json() for row in rows])
    # The segment's first append is committed, and then the emulator restarts before its answer arrives:
    # the stream and the answer are gone, the rows are in the table.
    stream = sink.open_stream()
    segment.set_target(stream, 0)
    sink.append(segment.rows(), stream, 0)
    restart(stack, "bigquery")
    log_writer = InferenceLogWriter(sink, spool, spool_interval=60)
    deadline = time.monotonic() + 60
    while not log_writer.send_spooled():
        assert time.monotonic() < deadline, "the segment was never settled"
        time.sleep(0.5)
    log_writer.close()
    ids = [row.request_id for row in rows]
    counts = {
        row["request_id"]: row["copies"]
        for row in bigquery.query(
            f"SELECT request_id, COUNT(*) AS copies FROM `{settings.project_id}.{settings.dataset}.{table}` GROUP BY 1"
        ).result()
    }
    assert counts == dict.fromkeys(ids, 1)
    assert list(tmp_path.glob("*.jsonl")) == []
    bigquery.delete_table(f"{settings.project_id}.{settings.dataset}.{table}")
