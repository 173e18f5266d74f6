"""Batch jobs under faults: the API process feeding a batch is killed, and a worker holding batch lines is killed;
every custom_id is still answered exactly once, with one log row per inference."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest
import redis

from contract import naming
from emulators.processes import ProcessRegistry
from tests.conftest import query_rows
from tests.e2e.test_batches import create, line, output, wait
from tests.integration.test_api_orphans import gunicorn_worker

pytestmark = pytest.mark.stack
LINES = 400


def test_the_feeding_api_and_a_worker_killed_mid_batch_answer_every_custom_id_once_with_one_row_each(
    stack, settings, bigquery, auth_headers, extra_worker
):
    registry = ProcessRegistry(stack.stack_dir)
    extra = extra_worker("synthetic")
    prefix = f"fault-{uuid.uuid4().hex[:6]}"
    lines = [line(f"{prefix}-{index}", model="sleep", seed=index) for index in range(LINES)]
    batch = create(stack, auth_headers, requests=lines)
    # Feeding is bounded (MAAS_BATCH_MAX_IN_FLIGHT per model), so the feeder is still reading the file here.
    running = wait(stack, auth_headers, batch["id"], until=lambda view: view["request_counts"]["succeeded"] >= 40)
    assert running["request_counts"]["total"] < LINES, running
    os.kill(gunicorn_worker(registry.pid("api")), signal.SIGKILL)  # gunicorn starts another; the lease lapses
    resumed = wait(stack, auth_headers, batch["id"], timeout=60,
                   until=lambda view: view["request_counts"]["succeeded"] >= running["request_counts"]["total"] + 40)  # fmt: skip
    assert resumed["status"] == "in_progress"
    victim = f"{socket.gethostname()}-{registry.pid(extra)}"  # the worker's id, as its holder leases name it
    client = redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"])
    _held_by(client, batch["id"], victim)  # it holds some lines now
    # Frozen before the lines it holds are read, so none of them is finished between the reading and the kill.
    os.kill(registry.pid(extra), signal.SIGSTOP)
    held = _held_by(client, batch["id"], victim)
    os.kill(registry.pid(extra), signal.SIGKILL)  # with these lines in its hands: the stack's worker answers them
    final = wait(stack, auth_headers, batch["id"], timeout=120)
    assert final["status"] == "completed", final
    assert final["request_counts"] == {"total": LINES, "succeeded": LINES, "failed": 0, "cancelled": 0, "expired": 0}
    results = output(stack, auth_headers, batch["id"], "results")
    assert sorted(item["custom_id"] for item in results) == sorted(item["custom_id"] for item in lines)
    assert output(stack, auth_headers, batch["id"], "errors") == []

    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    sql = f"SELECT request_id, custom_id, worker_id FROM {table} WHERE batch_job_id = '{batch['id']}'"
    rows = query_rows(bigquery, sql, expected=LINES, timeout=30)
    time.sleep(2)  # a second copy would be written within the log writer's next rounds
    rows = query_rows(bigquery, sql, expected=LINES)
    assert len(rows) == LINES and len({row["custom_id"] for row in rows}) == LINES
    answered_by = {row["request_id"]: row["worker_id"] for row in rows}
    # A line it held may have been answered by it just before it froze (its reply already out): every held line
    # is answered once, and those it had not answered by another worker.
    assert all(answered_by[request_id] is not None for request_id in held)
    assert any(answered_by[request_id] != victim for request_id in held)


def _held_by(client: redis.Redis, batch_id: str, worker: str, timeout: float = 30) -> list[str]:
    """The batch's lines in flight that `worker` holds now (waits until it holds some)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = [key.decode() for key in client.hkeys(f"maas:batch:{batch_id}:pending")]
        holders = client.mget([naming.holder_key(request_id) for request_id in pending]) if pending else []
        held = [request_id for request_id, holder in zip(pending, holders, strict=True) if holder == worker.encode()]
        if held:
            return held
        time.sleep(0.02)
    raise AssertionError(f"{worker} held none of the batch's lines in {timeout}s")
