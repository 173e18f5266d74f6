"""Per-key rate and concurrency limits against the stack's real Redis: two apps stand for two API instances."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from api_server.core import metrics
from api_server.core.redis_state import RedisState, api_redis_client
from api_server.predict.limits import KeyLimits, RequestLimiter
from api_server.process.app import create_app
from api_server.process.state import app_state
from contract.settings import Settings, api_key_digest
from tests.conftest import query_rows

pytestmark = pytest.mark.stack
LEASE_SECONDS = 3.0  # a crashed holder's slot lease
RATE_KEY, CONCURRENCY_KEY, VIP_KEY = "limits-rate-key", "limits-concurrency-key", "limits-vip-key"


@pytest.fixture(scope="module")
def two_instances(stack, tmp_path_factory):
    env = {
        **stack.service_env(),
        "MAAS_API_KEYS": f"{RATE_KEY},{CONCURRENCY_KEY},{VIP_KEY}",
        "MAAS_RATE_LIMIT_PER_MINUTE": "3",
        "MAAS_KEY_LIMITS": f"{api_key_digest(CONCURRENCY_KEY)}=0/2,{api_key_digest(VIP_KEY)}=0/0",
    }
    apps = [
        create_app(Settings.from_env({**env, "MAAS_LOG_SPOOL_DIR": str(tmp_path_factory.mktemp("spool"))}))
        for _ in range(2)
    ]
    yield apps
    for app in apps:
        app_state(app).close()


def predict(app, key: str):
    return app.test_client().post(
        "/v1/models/noop:predict",
        json={"instances": [{"prompt": f"limits {uuid.uuid4().hex}"}], "parameters": {"width": 64, "height": 64}},
        headers={"Authorization": f"Bearer {key}"},
    )


def test_the_rate_limit_holds_across_api_instances_and_the_429_is_logged(two_instances, settings, bigquery):
    first, second = two_instances
    answers = [predict(app, RATE_KEY) for app in (first, second, first)]
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    refused = predict(second, RATE_KEY)
    assert refused.status_code == 429
    # 3 a minute: the next token comes within 20 s.
    assert 1 <= int(refused.headers["Retry-After"]) <= 20
    error = refused.get_json()["error"]
    assert error["code"] == 429 and "rate limit" in error["message"]
    request_id = refused.headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=30)
    assert (rows[0]["http_status"], rows[0]["error_kind"], rows[0]["status"]) == (429, "rate_limited", "rejected")


def test_a_key_with_an_override_is_not_limited(two_instances):
    statuses = {predict(two_instances[index % 2], VIP_KEY).status_code for index in range(5)}
    assert statuses == {200}


def test_the_concurrency_limit_counts_requests_held_by_another_instance(two_instances):
    first, second = two_instances
    limiter = app_state(first).limiter
    digest = api_key_digest(CONCURRENCY_KEY)
    held = [limiter.admit(digest[:12], digest, hold_seconds=60) for _ in range(2)]
    refused = predict(second, CONCURRENCY_KEY)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert "concurrent" in refused.get_json()["error"]["message"]
    limiter.release(held[0])
    assert predict(second, CONCURRENCY_KEY).status_code == 200
    limiter.release(held[1])
    # Every finished request gave its slot back.
    assert [predict(second, CONCURRENCY_KEY).status_code for _ in range(3)] == [200, 200, 200]


def test_a_crashed_holders_slot_frees_itself_after_its_lease(stack):
    client = redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"])
    limiter = RequestLimiter(RedisState(client), KeyLimits(0, 1), lease_margin_seconds=0)
    key_id = uuid.uuid4().hex[:12]
    # A lease long enough that the refusal below is surely asked within it, even on a machine that stalls.
    limiter.admit(key_id, "digest", hold_seconds=LEASE_SECONDS)  # never released: its process "died"
    with pytest.raises(Exception, match="concurrent"):
        limiter.admit(key_id, "digest", hold_seconds=LEASE_SECONDS)
    time.sleep(LEASE_SECONDS + 0.1)
    limiter.release(limiter.admit(key_id, "digest", hold_seconds=LEASE_SECONDS))


def test_limits_fail_open_while_redis_is_unreachable():
    dead = api_redis_client("redis://127.0.0.1:1/0")
    limiter = RequestLimiter(RedisState(dead, retry_seconds=60), KeyLimits(1, 1))
    unenforced = metrics.LIMIT_DECISIONS.labels("unenforced")
    before = unenforced._value.get()
    for _ in range(3):
        limiter.release(limiter.admit("fail-open", "digest", hold_seconds=1))
    assert unenforced._value.get() == before + 3
    assert metrics.REDIS_UP._value.get() == 0
    metrics.REDIS_UP.set(1)
