"""The result cache and request coalescing over HTTP, against the real stack's Redis and workers."""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import TEST_API_KEYS

pytestmark = pytest.mark.stack


def seeded(prompt: str, seed: int = 3) -> dict:
    return {"instances": [{"prompt": prompt}], "parameters": {"seed": seed, "width": 64, "height": 64}}


def predict(stack, model: str, body: dict, headers: dict, **extra) -> requests.Response:
    return requests.post(
        f"{stack.api_url}/v1/models/{model}:predict", json=body, headers={**headers, **extra}, timeout=60
    )


def test_seeded_request_is_a_miss_then_a_hit_with_the_same_bytes(stack, auth_headers):
    body = seeded(f"cache {uuid.uuid4().hex}")
    first = predict(stack, "noop", body, auth_headers)
    second = predict(stack, "noop", body, auth_headers)
    assert first.status_code == second.status_code == 200, first.text
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("miss", "hit")
    assert second.content == first.content
    # The body names the request that ran the model; the header names this one.
    assert second.headers["X-Request-Id"] != first.headers["X-Request-Id"]


def test_the_cache_is_shared_between_api_keys(stack, auth_headers):
    body = seeded(f"shared {uuid.uuid4().hex}")
    first = predict(stack, "noop", body, auth_headers)
    other = predict(stack, "noop", body, {"Authorization": f"Bearer {TEST_API_KEYS[1]}"})
    assert other.headers["X-Cache"] == "hit" and other.content == first.content


def test_no_cache_runs_the_model_again(stack, auth_headers):
    body = seeded(f"bypass {uuid.uuid4().hex}")
    first = predict(stack, "noop", body, auth_headers)
    fresh = predict(stack, "noop", body, auth_headers, **{"Cache-Control": "no-cache"})
    assert fresh.status_code == 200 and fresh.headers["X-Cache"] == "miss"
    assert fresh.json()["request_id"] != first.json()["request_id"]
    assert fresh.json()["predictions"] == first.json()["predictions"]


def test_a_different_parameter_is_a_different_entry(stack, auth_headers):
    prompt = f"params {uuid.uuid4().hex}"
    predict(stack, "noop", seeded(prompt, seed=1), auth_headers)
    other = predict(stack, "noop", seeded(prompt, seed=2), auth_headers)
    assert other.headers["X-Cache"] == "miss"


def test_unseeded_requests_are_not_cached(stack, auth_headers):
    body = {"instances": [{"prompt": f"random {uuid.uuid4().hex}"}]}
    first, second = (predict(stack, "noop", body, auth_headers) for _ in range(2))
    assert "X-Cache" not in first.headers and "X-Cache" not in second.headers
    assert first.json()["request_id"] != second.json()["request_id"]


def test_identical_concurrent_requests_run_one_inference(stack, auth_headers):
    body = seeded(f"coalesce {uuid.uuid4().hex}")
    barrier = threading.Barrier(8)

    def call(_):
        barrier.wait()
        return predict(stack, "sleep", body, auth_headers)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(call, range(8)))
    assert all(response.status_code == 200 for response in responses)
    assert len({response.content for response in responses}) == 1  # one request id, one set of timings
    assert sorted(response.headers["X-Cache"] for response in responses) == ["hit"] * 7 + ["miss"]


def test_identical_requests_in_two_api_processes_run_one_inference(stack, auth_headers):
    """The stack's gunicorn process and an app in this test process coordinate through Redis alone."""
    from api_server.process.app import create_app
    from api_server.process.state import app_state
    from contract.settings import Settings

    app = create_app(Settings.from_env(stack.service_env()))
    try:
        body = seeded(f"two processes {uuid.uuid4().hex}")
        barrier = threading.Barrier(2)

        def over_http():
            barrier.wait()
            return predict(stack, "sleep", body, auth_headers)

        def in_process():
            barrier.wait()
            return app.test_client().post("/v1/models/sleep:predict", json=body, headers=auth_headers)

        with ThreadPoolExecutor(2) as pool:
            remote, local = pool.submit(over_http), pool.submit(in_process)
            remote, local = remote.result(), local.result()
        assert remote.status_code == local.status_code == 200
        assert remote.content == local.data
        assert sorted([remote.headers["X-Cache"], local.headers["X-Cache"]]) == ["hit", "miss"]
    finally:
        app_state(app).close()


def test_metrics_count_cache_hits_and_coalesced_requests(stack, auth_headers):
    body = seeded(f"metrics {uuid.uuid4().hex}")
    predict(stack, "noop", body, auth_headers)
    predict(stack, "noop", body, auth_headers)
    text = requests.get(f"{stack.api_url}/metrics", timeout=5).text
    assert 'maas_api_cache_total{result="hit"}' in text
    assert "maas_api_coalesced_total" in text
    assert 'maas_api_requests_total{method="POST",route="/v1/models/<model>:predict",status="200"}' in text
    assert "maas_api_request_seconds_bucket" in text and "maas_api_inflight_waits" in text


@pytest.fixture
def redis_process(stack):
    """Stops the stack's Redis by PID and starts it again with the same command line."""
    from emulators.processes import ProcessRegistry, redis_ok

    registry = ProcessRegistry(stack.stack_dir)

    def start():
        if redis_ok(stack.redis_port):
            return
        try:
            from emulators.stack import start_redis
        except ImportError:  # before emulators/stack.py had it: the same command line
            argv = ["redis-server", "--port", str(stack.redis_port), "--bind", "127.0.0.1"]
            registry.start(
                "redis", [*argv, "--save", "", "--appendonly", "no"], dict(os.environ), stack.stack_dir / "data"
            )
        else:
            start_redis(stack, registry)
        registry.wait_until("redis", lambda: redis_ok(stack.redis_port), timeout=15)

    yield registry, start
    start()


def test_api_serves_without_redis_and_recovers_when_it_returns(stack, auth_headers, redis_process):
    registry, start = redis_process
    body = seeded(f"redis down {uuid.uuid4().hex}")
    registry.stop("redis")
    try:
        for _ in range(2):
            response = predict(stack, "noop", body, auth_headers)
            assert response.status_code == 200, response.text
            assert response.headers["X-Cache"] == "miss"
        assert "maas_api_redis_up 0.0" in requests.get(f"{stack.api_url}/metrics", timeout=5).text
    finally:
        start()
    deadline = time.monotonic() + 15
    while True:  # recovers by itself: the next lookups reach Redis again and the cache fills
        hits = [predict(stack, "noop", body, auth_headers).headers["X-Cache"] for _ in range(2)]
        if hits[-1] == "hit" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert hits[-1] == "hit"
