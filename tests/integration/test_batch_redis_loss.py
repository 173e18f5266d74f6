"""A batch whose Redis keys are lost in a Redis restart (no persistence) is restored from its GCS copy and part files,
and every custom_id is still answered exactly once, with one log row each."""

from __future__ import annotations

import uuid

import pytest
import redis

from tests.conftest import query_rows
from tests.e2e.test_batches import create, line, output, wait

pytestmark = pytest.mark.stack
LINES = 200


def test_a_batch_redis_lost_in_a_restart_is_restored_from_gcs_and_answers_every_custom_id_once(
    stack, settings, bigquery, auth_headers
):
    from emulators.stack import restart

    prefix = f"redis-{uuid.uuid4().hex[:6]}"
    lines = [line(f"{prefix}-{index}", model="sleep", seed=index) for index in range(LINES)]
    batch = create(stack, auth_headers, requests=lines)
    wait(stack, auth_headers, batch["id"], until=lambda view: view["request_counts"]["succeeded"] >= 40)
    restart(stack, "redis")  # no persistence: every batch key is gone, the GCS copy and part files are not
    try:
        final = wait(stack, auth_headers, batch["id"], timeout=120)
    except AssertionError as exc:
        client = redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"])
        key = f"maas:batch:{batch['id']}"
        state = {
            "record": client.hgetall(key),
            "lease": client.get(f"{key}:lease"),
            "pending": client.hlen(f"{key}:pending"),
            "publishing": client.hlen(f"{key}:publishing"),
            "answered": sum(
                1 for rid in client.hkeys(f"{key}:pending") if client.exists(f"maas:result:{rid.decode()}")
            ),
        }
        raise AssertionError(f"{exc}; Redis: {state}") from None
    assert final["status"] == "completed", final
    counts = final["request_counts"]
    assert counts == {"total": LINES, "succeeded": LINES, "failed": 0, "cancelled": 0, "expired": 0}
    results = output(stack, auth_headers, batch["id"], "results")
    assert sorted(item["custom_id"] for item in results) == sorted(item["custom_id"] for item in lines)
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    sql = f"SELECT custom_id FROM {table} WHERE batch_job_id = '{batch['id']}'"
    rows = query_rows(bigquery, sql, expected=LINES, timeout=30)
    assert sorted(row["custom_id"] for row in rows) == sorted(item["custom_id"] for item in lines)
