"""Async jobs and Idempotency-Key over HTTP, against the real stack's Pub/Sub, Redis and workers."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
import requests

from tests.conftest import TEST_API_KEYS, open_hold

pytestmark = pytest.mark.stack
OTHER_KEY = {"Authorization": f"Bearer {TEST_API_KEYS[1]}"}
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
TIMES = ("created_at", "started_at", "finished_at")


def body(prompt: str, **parameters) -> dict:
    return {"instances": [{"prompt": prompt}], "parameters": {"width": 64, "height": 64, **parameters}}


def submit(stack, model: str, payload: dict, headers: dict) -> requests.Response:
    return requests.post(f"{stack.api_url}/v1/models/{model}/jobs", json=payload, headers=headers, timeout=30)


def poll(
    stack, location: str, headers: dict, timeout: float = 20.0, until: set[str] = TERMINAL
) -> tuple[dict, list[dict]]:
    """Reads the job until its status is one of `until` (finished); returns the last view and every view seen."""
    seen = []
    deadline = time.monotonic() + timeout
    with requests.Session() as session:
        while time.monotonic() < deadline:
            view = session.get(f"{stack.api_url}{location}", headers=headers, timeout=10).json()
            seen.append(view)
            if view["status"] in until:
                return view, seen
            time.sleep(0.005)
    raise AssertionError(f"job not {'/'.join(sorted(until))} in {timeout}s: {seen[-1]}")


def held_job(stack, headers: dict, **parameters) -> tuple[requests.Response, str]:
    """A `sleep` job whose call stops after its first step until `open_hold(stack, gate)`: (its 202, gate)."""
    gate = f"job-{uuid.uuid4().hex}"
    response = submit(stack, "sleep", body(f"!hold {gate}", **parameters), headers)
    assert response.status_code == 202, response.text
    return response, gate


def test_job_is_accepted_then_runs_with_progress_and_succeeds(stack, auth_headers):
    response, gate = held_job(stack, auth_headers, seed=4)
    accepted = response.json()
    assert response.headers["Location"] == f"/v1/jobs/{accepted['id']}" == accepted["links"]["self"]
    assert accepted["status"] == "queued"
    # The call stops after its first step until the gate opens: the job is seen running whatever the machine's load.
    _, seen = poll(stack, response.headers["Location"], auth_headers, until={"running", *TERMINAL})
    assert seen[-1]["status"] == "running", seen[-1]
    open_hold(stack, gate)
    final, rest = poll(stack, response.headers["Location"], auth_headers)
    seen += rest
    assert final["status"] == "succeeded", final
    [prediction] = final["result"]["predictions"]
    assert prediction["seed"] == 4 and prediction["image_b64"]
    running = [view for view in seen if view["status"] == "running"]
    assert running and all(1 <= view["progress"]["step"] <= view["progress"]["total"] for view in running)
    assert all(view["started_at"] and view["finished_at"] is None for view in running), running
    assert all(view["started_at"] is None for view in seen if view["status"] == "queued")
    # Times as the worker saw them: its pipeline call's start, and when its answer became available.
    created, started, finished = (datetime.fromisoformat(final[name]) for name in TIMES)
    assert created <= started < finished and started.isoformat() == running[0]["started_at"]


def test_failed_job_reports_the_error(stack, auth_headers):
    response = submit(stack, "sleep", body(f"!crash {uuid.uuid4().hex}"), auth_headers)
    final, _ = poll(stack, response.headers["Location"], auth_headers)
    assert final["status"] == "failed" and final["error"]["code"] == 500 and "result" not in final


def test_another_key_cannot_see_or_cancel_a_job(stack, auth_headers):
    location = submit(stack, "noop", body("mine"), auth_headers).headers["Location"]
    assert requests.get(f"{stack.api_url}{location}", headers=OTHER_KEY, timeout=10).status_code == 404
    assert requests.delete(f"{stack.api_url}{location}", headers=OTHER_KEY, timeout=10).status_code == 404
    assert (
        requests.get(f"{stack.api_url}/v1/jobs/{uuid.uuid4().hex}", headers=auth_headers, timeout=10).status_code == 404
    )
    final, _ = poll(stack, location, auth_headers)
    assert final["status"] == "succeeded"


def test_cancelled_job_is_answered_cancelled_without_a_result(stack, auth_headers):
    # A held call occupies the stand-in GPU (one call at a time) until its gate opens: the next job stays queued.
    response, gate = held_job(stack, auth_headers)
    ahead = response.headers["Location"]
    poll(stack, ahead, auth_headers, until={"running", *TERMINAL})
    location = submit(stack, "sleep", body(f"cancel me {uuid.uuid4().hex}"), auth_headers).headers["Location"]
    try:
        assert requests.get(f"{stack.api_url}{location}", headers=auth_headers, timeout=10).json()["status"] == "queued"
        cancelled = requests.delete(f"{stack.api_url}{location}", headers=auth_headers, timeout=10)
    finally:
        open_hold(stack, gate)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    final, _ = poll(stack, location, auth_headers)
    assert final["status"] == "cancelled" and "result" not in final
    # The worker honoured it: its stored reply for the request says cancelled.
    import redis

    from contract.stores.results import ResultStore

    store = ResultStore(redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"]), 60)
    job_id = location.rsplit("/", 1)[1]
    deadline = time.monotonic() + 15
    while (reply := store.get(job_id)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reply is not None and reply.status == "cancelled"
    assert poll(stack, ahead, auth_headers)[0]["status"] == "succeeded"


def test_a_finished_job_cannot_be_cancelled(stack, auth_headers):
    location = submit(stack, "noop", body("done"), auth_headers).headers["Location"]
    poll(stack, location, auth_headers)
    assert requests.delete(f"{stack.api_url}{location}", headers=auth_headers, timeout=10).status_code == 409


def test_prefer_respond_async_turns_predict_into_a_job(stack, auth_headers):
    response = requests.post(
        f"{stack.api_url}/v1/models/noop:predict",
        json=body(f"async {uuid.uuid4().hex}"),
        headers={**auth_headers, "Prefer": "respond-async"},
        timeout=30,
    )
    assert response.status_code == 202 and response.headers["Location"].startswith("/v1/jobs/")
    final, _ = poll(stack, response.headers["Location"], auth_headers)
    assert final["status"] == "succeeded"


def test_same_idempotency_key_and_body_gives_the_same_response(stack, auth_headers):
    headers = {**auth_headers, "Idempotency-Key": uuid.uuid4().hex}
    payload = body(f"idem {uuid.uuid4().hex}")  # no seed: only the idempotency record can repeat it
    first = requests.post(f"{stack.api_url}/v1/models/noop:predict", json=payload, headers=headers, timeout=30)
    again = requests.post(f"{stack.api_url}/v1/models/noop:predict", json=payload, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["Idempotent-Replayed"] == "true"


def test_concurrent_duplicates_with_one_idempotency_key_run_once(stack, auth_headers):
    headers = {**auth_headers, "Idempotency-Key": uuid.uuid4().hex}
    payload = body(f"idem race {uuid.uuid4().hex}")
    barrier = threading.Barrier(6)

    def call(_):
        barrier.wait()
        return requests.post(f"{stack.api_url}/v1/models/sleep:predict", json=payload, headers=headers, timeout=30)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(call, range(6)))
    assert all(response.status_code == 200 for response in responses)
    assert len({response.content for response in responses}) == 1
    assert sum("Idempotent-Replayed" not in response.headers for response in responses) == 1


def test_idempotency_key_reused_with_another_body_is_422(stack, auth_headers):
    headers = {**auth_headers, "Idempotency-Key": uuid.uuid4().hex}
    url = f"{stack.api_url}/v1/models/noop:predict"
    assert requests.post(url, json=body("one"), headers=headers, timeout=30).status_code == 200
    reused = requests.post(url, json=body("two"), headers=headers, timeout=30)
    assert reused.status_code == 422 and reused.json()["error"]["field"] == "Idempotency-Key"


def test_idempotency_keys_are_scoped_to_the_api_key(stack, auth_headers):
    idem = uuid.uuid4().hex
    url = f"{stack.api_url}/v1/models/noop:predict"
    mine = requests.post(url, json=body("one"), headers={**auth_headers, "Idempotency-Key": idem}, timeout=30)
    theirs = requests.post(url, json=body("two"), headers={**OTHER_KEY, "Idempotency-Key": idem}, timeout=30)
    assert mine.status_code == theirs.status_code == 200


def test_the_job_list_shows_only_the_callers_jobs_newest_first_in_pages(stack, auth_headers):
    mine = [submit(stack, "noop", body(f"listed {uuid.uuid4().hex}"), auth_headers).json()["id"] for _ in range(3)]
    theirs = submit(stack, "noop", body(f"not listed {uuid.uuid4().hex}"), OTHER_KEY).json()["id"]
    with requests.Session() as session:
        session.headers.update(auth_headers)

        def page(**params) -> dict:
            response = session.get(f"{stack.api_url}/v1/jobs", params=params, timeout=10)
            assert response.status_code == 200, response.text
            return response.json()

        first = page(limit=2)
        assert [job["id"] for job in first["jobs"]] == mine[:0:-1] and first["next_cursor"]
        second = page(limit=2, cursor=first["next_cursor"])
        assert second["jobs"][0]["id"] == mine[0]
        everything = [job["id"] for job in page(limit=100)["jobs"]]
        assert set(mine) <= set(everything) and theirs not in everything
        for job_id in mine:
            poll(stack, f"/v1/jobs/{job_id}", auth_headers)
        succeeded = page(limit=100, state="succeeded")["jobs"]
        assert {job["status"] for job in succeeded} == {"succeeded"} and set(mine) <= {job["id"] for job in succeeded}
        assert all("result" not in job for job in succeeded)  # results are read one job at a time
        assert page(limit=100, state="queued", cursor=f"1_{mine[0]}")["jobs"] == []  # nothing is older than 1970
        for params, field in [({"limit": "0"}, "limit"), ({"limit": "ten"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "\u00b9"}, "limit"),
                              ({"state": "done"}, "state"), ({"cursor": "page-2"}, "cursor")]:  # fmt: skip
            refused = session.get(f"{stack.api_url}/v1/jobs", params=params, timeout=10)
            assert refused.status_code == 422 and refused.json()["error"]["field"] == field, (params, refused.text)
