"""Model versions on the real stack: split routing, pinning, the runtime split, shadow traffic, automatic rollback.

The synthetic versioned models live in contract/models.local.yaml (`canary` 90/10, `canary-sticky`, `shadowed`
with a 5 s shadow, `shadowed-once` with a fast one, `fallback` whose version 2 takes every request and fails it,
`rollback-bad` whose canary fails every request, `rollback-jobs` the same reached through jobs, `rollback-good`). The 90/10 proportion
is checked over 1,000 request ids in-process (tests/unit/test_model_versions.py: the version is a pure
function of the id); here a smaller real batch checks that the API applies that function and that every
response, log row and cache entry carries the version it used.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests
import yaml

from api_server.process.app import create_app
from api_server.process.state import app_state
from api_server.versions.traffic import choose_version
from contract import naming
from contract.settings import Settings, api_key_digest
from contract.stores.results import ResultStore
from emulators.processes import ProcessRegistry, redis_ok
from emulators.stack import start_redis
from tests.conftest import TEST_ADMIN_KEY, TEST_API_KEYS, query_rows

pytestmark = pytest.mark.stack
ADMIN = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}
# A single-version synthetic entry (contract/models.local.yaml's `noop`), as a base for versioned test entries.
NARROWABLE = {
    key: value
    for key, value in yaml.safe_load(Path(naming.__file__).with_name("models.local.yaml").read_text())["models"][
        "noop"
    ].items()
    if key != "version"
}
# Bounds a hang only: each process re-reads the splits every MAAS_TRAFFIC_REFRESH_SECONDS (0.5 s), and how soon a
# change is in force on a busy machine is no test's business (docs/guides/versions-and-rollouts.md states it).
IN_FORCE_SECONDS = 60.0


def body(prompt: str | None = None, seed: int | None = None) -> dict:
    parameters: dict = {"width": 64, "height": 64}
    if seed is not None:
        parameters["seed"] = seed
    return {"instances": [{"prompt": prompt or f"versions {uuid.uuid4().hex}"}], "parameters": parameters}


def predict(stack, model: str, headers: dict, version: str | None = None, **kwargs) -> requests.Response:
    path = f"/v1/models/{model}/versions/{version}:predict" if version else f"/v1/models/{model}:predict"
    return requests.post(f"{stack.api_url}{path}", json=body(**kwargs), headers=headers, timeout=40)


def model_info(stack, model: str, headers: dict) -> dict:
    response = requests.get(f"{stack.api_url}/v1/models/{model}", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def second_api(stack, tmp_path_factory):
    """A second API process's state (an app of its own, on the same Redis): a split must reach it too."""
    env = {**stack.service_env(), "MAAS_LOG_SPOOL_DIR": str(tmp_path_factory.mktemp("spool"))}
    app = create_app(Settings.from_env(env))
    yield app
    app_state(app).close()


def table(settings, name: str) -> str:
    return f"`{settings.project_id}.{settings.dataset}.{name}`"


def test_the_split_picks_the_version_and_response_row_and_cache_carry_it(stack, auth_headers, settings, bigquery):
    info = model_info(stack, "canary", auth_headers)
    assert info["versions"] == ["1", "2"] and info["stable_version"] == "1"
    assert info["traffic"]["traffic"] == {"1": 90, "2": 10} and info["traffic"]["source"] == "catalog"
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: predict(stack, "canary", auth_headers), range(40)))
    versions = {}
    for answer in answers:
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        assert reply["model_version"] == choose_version({"1": 90, "2": 10}, reply["request_id"])
        versions[reply["request_id"]] = reply["model_version"]
    # A job gets its version the same way, and carries it.
    job = requests.post(f"{stack.api_url}/v1/models/canary/jobs", json=body(), headers=auth_headers, timeout=10)
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    view = requests.get(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10).json()
    assert view["model_version"] == choose_version({"1": 90, "2": 10}, job_id)
    # Pinned: always its version, whatever the split; an unknown version is a 404.
    pinned = [predict(stack, "canary", auth_headers, version="2").json() for _ in range(3)]
    assert {reply["model_version"] for reply in pinned} == {"2"}
    versions.update({reply["request_id"]: "2" for reply in pinned})
    missing = predict(stack, "canary", auth_headers, version="9")
    assert missing.status_code == 404 and "no version '9'" in missing.json()["error"]["message"]
    # The cache key carries the version: the same seeded body on the other version is a miss.
    seed, prompt = 7, f"cache {uuid.uuid4().hex}"
    first = predict(stack, "canary", auth_headers, version="1", prompt=prompt, seed=seed)
    other = predict(stack, "canary", auth_headers, version="2", prompt=prompt, seed=seed)
    again = predict(stack, "canary", auth_headers, version="2", prompt=prompt, seed=seed)
    assert [r.headers["X-Cache"] for r in (first, other, again)] == ["miss", "miss", "hit"]
    assert again.json()["model_version"] == "2"
    cache = redis.Redis.from_url(settings.redis_url)
    assert cache.keys("maas:cache:v1:canary:1:*") and cache.keys("maas:cache:v1:canary:2:*")
    ids = ", ".join(f"'{request_id}'" for request_id in versions)
    sql = f"SELECT request_id, model_version FROM {table(settings, 'inference_log')} WHERE request_id IN ({ids})"
    rows = query_rows(bigquery, sql, len(versions), timeout=60)
    assert {row["request_id"]: row["model_version"] for row in rows} == versions


def test_sticky_by_api_key_keeps_each_key_on_one_version(stack):
    for key in (*TEST_API_KEYS, TEST_ADMIN_KEY):
        headers = {"Authorization": f"Bearer {key}"}
        seen = {predict(stack, "canary-sticky", headers).json()["model_version"] for _ in range(5)}
        assert len(seen) == 1, (key, seen)


def test_the_runtime_split_is_admin_only_validated_in_force_everywhere_and_audited(
    stack, auth_headers, second_api, settings, bigquery
):
    url = f"{stack.api_url}/v1/models/canary/traffic"
    refused = requests.put(url, json={"traffic": {"1": 0, "2": 100}}, headers=auth_headers, timeout=10)
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    assert requests.delete(url, headers=auth_headers, timeout=10).status_code == 403
    for bad, field in (
        ({"traffic": {"1": 50, "2": 40}}, "traffic"),
        ({"traffic": {"1": 50, "3": 50}}, "traffic"),
        ({"traffic": {"1": 100}, "shadow": {"version": "1", "percent": 5}}, "shadow.version"),
        ({"traffic": {"1": 100}, "shadow": {"version": "2", "percent": 0}}, "shadow.percent"),
    ):
        answer = requests.put(url, json=bad, headers=ADMIN, timeout=10)
        assert answer.status_code == 422 and answer.json()["error"]["field"] == field, answer.text
    single = requests.put(
        f"{stack.api_url}/v1/models/noop/traffic", json={"traffic": {"1": 100}}, headers=ADMIN, timeout=10
    )
    assert single.status_code == 409 and "one version" in single.json()["error"]["message"]
    reason = f"canary to 100% {uuid.uuid4().hex}"
    put = requests.put(url, json={"traffic": {"1": 0, "2": 100}, "reason": reason}, headers=ADMIN, timeout=10)
    assert put.status_code == 200, put.text
    started = time.monotonic()
    try:
        wait_for_split(stack, second_api, {"1": 0, "2": 100}, started)
        assert {predict(stack, "canary", auth_headers).json()["model_version"] for _ in range(5)} == {"2"}
        # Redis down: each process keeps the last split it saw.
        registry = ProcessRegistry(stack.stack_dir)
        registry.stop("redis")
        try:
            assert {predict(stack, "canary", auth_headers).json()["model_version"] for _ in range(5)} == {"2"}
            assert app_state(second_api).rollouts.splits.refresh() is False
            assert app_state(second_api).rollouts.splits.split("canary").traffic == {"1": 0, "2": 100}
        finally:
            start_redis(stack, registry)
            registry.wait_until("redis", lambda: redis_ok(stack.redis_port), timeout=15)
    finally:
        deleted = requests.delete(url, headers=ADMIN, timeout=10)
    assert deleted.status_code == 200 and deleted.json()["source"] == "catalog"
    wait_for_split(stack, second_api, {"1": 90, "2": 10}, time.monotonic())
    sql = (
        f"SELECT action, actor, from_split, to_split, reason FROM {table(settings, 'rollout_audit')} "
        f"WHERE model = 'canary' AND reason = '{reason}'"
    )
    (audit,) = query_rows(bigquery, sql, 1, timeout=30)
    assert audit["action"] == "set" and '"2": 100.0' in audit["to_split"] and '"2": 10' in audit["from_split"]
    resets = query_rows(bigquery, f"SELECT actor FROM {table(settings, 'rollout_audit')} WHERE action = 'reset'", 1)
    assert resets and resets[0]["actor"]


def wait_for_split(stack, second_api, traffic: dict, started: float) -> None:
    """Both API processes apply `traffic`: the second, which no PUT reached, by its own refresh from Redis."""
    second = app_state(second_api).rollouts.splits
    while True:
        first_ok = model_info(stack, "canary", ADMIN)["traffic"]["traffic"] == traffic
        if first_ok and second.split("canary").traffic == traffic:
            print(f"split {traffic} in force on both API processes after {time.monotonic() - started:.3f}s")
            return
        assert time.monotonic() - started < IN_FORCE_SECONDS, "the split never came in force on both processes"
        time.sleep(0.05)


def test_shadow_traffic_adds_no_latency_and_is_logged_but_never_billed(stack, settings, bigquery):
    """The caller never waits for its shadow copy: checked by order, not by the caller's latency. The shadow runs
    5 s on a worker of its own and its reply is stored before it is published, so a caller who had waited for it
    would find it stored when answered; none does."""
    headers = {"Authorization": f"Bearer {TEST_API_KEYS[1]}"}
    results = ResultStore(redis.Redis.from_url(settings.redis_url), ttl_seconds=60)
    answers = []
    for _ in range(3):
        answer = predict(stack, "shadowed", headers)
        assert answer.status_code == 200, answer.text
        shadow_stored = results.get(f"{answer.json()['request_id']}-shadow") is not None
        answers.append((answer, shadow_stored))
    for answer, shadow_stored in answers:
        assert answer.json()["model_version"] == "1"
        assert not shadow_stored, "the caller was answered after its shadow copy: it waited for the 5 s shadow"
    primary = [answer.json()["request_id"] for answer, _ in answers]
    ids = ", ".join(f"'{request_id}'" for request_id in primary)
    sql = (
        f"SELECT shadow_of, model_version, status, endpoint, inference_ms FROM {table(settings, 'inference_log')} "
        f"WHERE shadow_of IN ({ids})"
    )
    rows = query_rows(bigquery, sql, 3, timeout=60)
    assert sorted(row["shadow_of"] for row in rows) == sorted(primary)
    assert {(row["model_version"], row["status"], row["endpoint"]) for row in rows} == {("2", "ok", "shadow")}
    assert min(row["inference_ms"] for row in rows) >= 5000
    # The callers' own rows are in (the log is written in batches), so the billing view can be read.
    own = f"SELECT request_id FROM {table(settings, 'inference_log')} WHERE request_id IN ({ids})"
    assert len(query_rows(bigquery, own, 3, timeout=60)) == 3
    billed = query_rows(
        bigquery, f"SELECT SUM(requests) AS n FROM {table(settings, 'billing_by_api_key_daily')} "
        "WHERE model = 'shadowed'", 1,
    )  # fmt: skip
    assert billed[0]["n"] == 3


def test_a_failing_canary_is_rolled_back_within_its_window_and_a_healthy_one_is_left_alone(
    stack, auth_headers, second_api, settings, bigquery
):
    started = time.monotonic()
    sent = 0
    # The guard needs 5 calls of each version in its 60 s window; it checks every 2 s.
    while model_info(stack, "rollback-bad", auth_headers)["traffic"]["traffic"]["2"] != 0:
        # Bounds a hang only: the guard acts once its 60 s window holds 5 calls of each version, however slowly
        # a busy machine sends them.
        assert time.monotonic() - started < 300, "the failing canary was never rolled back"
        if sent < 40:
            # The canary's failures reach the guard, not the callers: the stable version answers them.
            bad = predict(stack, "rollback-bad", auth_headers)
            assert bad.status_code == 200 and bad.json()["model_version"] == "1", bad.text
            predict(stack, "rollback-good", auth_headers)
            sent += 1
        else:
            time.sleep(0.2)
    print(f"failing canary rolled back {time.monotonic() - started:.1f}s after its first request ({sent} pairs sent)")
    info = model_info(stack, "rollback-bad", auth_headers)["traffic"]
    assert info["traffic"] == {"1": 100, "2": 0} and info["set_by"] == "rollback-guard"
    assert {predict(stack, "rollback-bad", auth_headers).json()["model_version"] for _ in range(3)} == {"1"}
    # The healthy canary, with enough calls of each version in the window, is left alone by the guard (run
    # here, now, on the second process, so the check surely happened after those calls).
    observations = app_state(second_api).rollouts.observations
    while min(observations.window("rollback-good", version, 60).requests for version in ("1", "2")) < 5:
        predict(stack, "rollback-good", auth_headers)
    assert "rollback-good" not in app_state(second_api).rollback_guard.check()
    good = model_info(stack, "rollback-good", auth_headers)["traffic"]
    assert good["traffic"] == {"1": 50, "2": 50} and good["source"] == "catalog"
    sql = f"SELECT actor, reason FROM {table(settings, 'rollout_audit')} WHERE model = 'rollback-bad' AND action = 'rollback'"
    (audit,) = query_rows(bigquery, sql, 1, timeout=30)
    assert audit["actor"] == "rollback-guard" and "error rate" in audit["reason"]
    requests.delete(f"{stack.api_url}/v1/models/rollback-bad/traffic", headers=ADMIN, timeout=10)


def test_a_version_that_narrows_what_a_request_may_ask_is_refused_at_load(stack, tmp_path):
    """A canary with `max_width: 128` under a stable 1024 would 422 requests the stable serves: refused at load,
    naming the model, the version and the field, so the split can never change a request's fate."""
    overlay = tmp_path / "narrow.yaml"
    narrowing = {"limits": {"max_inference_steps": 50, "max_width": 128, "max_height": 1024}}
    overlay.write_text(yaml.safe_dump({"models": {"narrow-canary": {
        **NARROWABLE, "versions": {"1": {}, "2": narrowing}, "traffic": {"1": 90, "2": 10},
    }}}))  # fmt: skip
    env = {**stack.service_env(), "MAAS_CATALOG_OVERLAY": str(overlay), "MAAS_LOG_SPOOL_DIR": str(tmp_path / "spool")}
    app = None
    with pytest.raises(ValueError) as refused:
        app = create_app(Settings.from_env(env))
    if app is not None:
        app_state(app).close()
    message = str(refused.value)
    assert "narrow-canary: version '2' sets limits.max_width to 128" in message
    assert "stable version '1' has 1024" in message


def shadow_copies_sent(stack) -> float:
    """The API's count of shadow copies sent for `shadowed-once` (its /metrics; the local stack runs one API
    process)."""
    text = requests.get(f"{stack.api_url}/metrics", timeout=10).text
    prefix = 'maas_api_shadow_copies_total{model="shadowed-once",result="sent"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_one_shadow_copy_per_inference_the_primary_runs(stack, settings, bigquery):
    """Cache hits, coalesced callers and Idempotency-Key replays run no inference, so they send no shadow copy."""
    headers = {"Authorization": f"Bearer {TEST_API_KEYS[1]}"}
    url = f"{stack.api_url}/v1/models/shadowed-once:predict"
    before = shadow_copies_sent(stack)
    seeded = body(prompt=f"shadow once {uuid.uuid4().hex}", seed=11)
    with ThreadPoolExecutor(4) as pool:
        identical = list(pool.map(lambda _: requests.post(url, json=seeded, headers=headers, timeout=40), range(4)))
    identical.append(requests.post(url, json=seeded, headers=headers, timeout=40))
    assert all(answer.status_code == 200 for answer in identical), [a.text for a in identical]
    ran = [answer.json()["request_id"] for answer in identical if answer.headers["X-Cache"] == "miss"]
    assert len(ran) == 1, [answer.headers["X-Cache"] for answer in identical]
    keyed, key = body(), {**headers, "Idempotency-Key": f"shadow-{uuid.uuid4().hex}"}
    repeats = [requests.post(url, json=keyed, headers=key, timeout=40) for _ in range(3)]
    assert [answer.status_code for answer in repeats] == [200, 200, 200]
    assert [answer.headers.get("Idempotent-Replayed") for answer in repeats] == [None, "true", "true"]
    ran.append(repeats[0].json()["request_id"])
    assert shadow_copies_sent(stack) - before == len(ran)
    callers = [answer.json()["request_id"] for answer in identical + repeats]
    ids = ", ".join(f"'{request_id}'" for request_id in callers)
    sql = f"SELECT shadow_of FROM {table(settings, 'inference_log')} WHERE shadow_of IN ({ids})"
    rows = query_rows(bigquery, sql, len(ran), timeout=60)
    assert sorted(row["shadow_of"] for row in rows) == sorted(ran)


def test_a_request_the_canary_fails_is_answered_by_the_stable_version_and_logged_with_both(
    stack, auth_headers, settings, bigquery
):
    """`fallback` sends every request to version 2, which fails it; version 1 (stable) answers, once."""
    answers = [predict(stack, "fallback", auth_headers) for _ in range(4)]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["model_version"] == "1" and answer.json()["predictions"]
    # The cache key names version 2: version 1's answer is not kept under it, so a repeat asks again.
    prompt = f"fallback seeded {uuid.uuid4().hex}"
    seeded = [predict(stack, "fallback", auth_headers, prompt=prompt, seed=5) for _ in range(2)]
    assert [(a.status_code, a.headers["X-Cache"], a.json()["model_version"]) for a in seeded] == [
        (200, "miss", "1")
    ] * 2
    answers += seeded
    # Pinned to the failing version: the caller asked for it, so its error is the answer.
    pinned = predict(stack, "fallback", auth_headers, version="2")
    assert pinned.status_code == 500 and "configured to fail" in pinned.json()["error"]["message"]
    served = [answer.json()["request_id"] for answer in answers]
    callers = [*served, pinned.json()["error"]["request_id"]]
    ids = ", ".join(f"'{request_id}', '{request_id}-fallback'" for request_id in callers)
    sql = (
        f"SELECT request_id, model_version, status, http_status, fallback_from, fallback_error, worker_id "
        f"FROM {table(settings, 'inference_log')} WHERE request_id IN ({ids})"
    )
    rows = {row["request_id"]: row for row in query_rows(bigquery, sql, len(callers), timeout=60)}
    assert sorted(rows) == sorted(callers)  # one row per caller, none for the stable version's attempt
    for request_id in served:
        row = rows[request_id]
        assert (row["model_version"], row["status"], row["http_status"], row["fallback_from"]) == ("1", "ok", 200, "2")
        assert "configured to fail" in row["fallback_error"] and row["worker_id"]
    assert (rows[callers[-1]]["model_version"], rows[callers[-1]]["fallback_from"]) == ("2", None)
    # The callers are billed for what they got: every fallback succeeded; only the pinned call failed.
    (billed,) = query_rows(
        bigquery,
        f"SELECT SUM(requests) AS requests, SUM(succeeded) AS succeeded "
        f"FROM {table(settings, 'billing_by_api_key_daily')} "
        f"WHERE model = 'fallback' AND api_key_id = '{api_key_digest(TEST_API_KEYS[0])[:12]}'",
        1,
    )
    assert (billed["requests"], billed["succeeded"]) == (len(callers), len(served))


def test_a_job_the_canary_fails_is_answered_by_the_stable_version(stack, settings, bigquery):
    """A job is answered by the stable version too: its view, its result and its one row follow that attempt."""
    headers = {"Authorization": f"Bearer {TEST_API_KEYS[1]}"}  # not the key whose bill the sync test reads
    job = requests.post(f"{stack.api_url}/v1/models/fallback/jobs", json=body(), headers=headers, timeout=10)
    assert job.status_code == 202, job.text
    job_id, started = job.json()["id"], time.monotonic()
    while (view := requests.get(f"{stack.api_url}/v1/jobs/{job_id}", headers=headers, timeout=10).json())["status"] in (
        "queued",
        "running",
    ):
        assert time.monotonic() - started < 90, view  # the job's own deadline is 30 s: this bounds a hang only
        time.sleep(0.2)
    assert (view["status"], view["model_version"]) == ("succeeded", "1"), view
    assert view["result"]["predictions"][0]["image_b64"]
    sql = (
        f"SELECT request_id, model_version, status, endpoint, fallback_from, fallback_error "
        f"FROM {table(settings, 'inference_log')} WHERE request_id IN ('{job_id}', '{job_id}-fallback')"
    )
    (row,) = query_rows(bigquery, sql, 1, timeout=60)
    assert (row["request_id"], row["model_version"], row["status"], row["endpoint"], row["fallback_from"]) == (
        job_id, "1", "ok", "job", "2",
    )  # fmt: skip
    assert "configured to fail" in row["fallback_error"]


def test_a_canary_failing_only_through_jobs_is_rolled_back(stack, auth_headers, settings, bigquery):
    """Jobs are observed when they end (a fallback's failed first attempt when it fails): `rollback-jobs`'s
    canary fails every job and is taken to 0%."""
    url = f"{stack.api_url}/v1/models/rollback-jobs/jobs"
    started, submitted = time.monotonic(), []
    try:
        while model_info(stack, "rollback-jobs", auth_headers)["traffic"]["traffic"]["2"] != 0:
            assert time.monotonic() - started < 300, "the canary failing every job was never rolled back"  # a hang
            if len(submitted) < 60:
                job = requests.post(url, json=body(), headers=auth_headers, timeout=10)
                assert job.status_code == 202, job.text
                submitted.append(job.json()["id"])
            else:
                time.sleep(0.2)
        info = model_info(stack, "rollback-jobs", auth_headers)["traffic"]
        assert info["traffic"] == {"1": 100, "2": 0} and info["set_by"] == "rollback-guard"
        sql = (
            f"SELECT reason FROM {table(settings, 'rollout_audit')} "
            "WHERE model = 'rollback-jobs' AND action = 'rollback'"
        )
        (audit,) = query_rows(bigquery, sql, 1, timeout=30)
        assert "error rate" in audit["reason"]
    finally:
        requests.delete(f"{stack.api_url}/v1/models/rollback-jobs/traffic", headers=ADMIN, timeout=10)
