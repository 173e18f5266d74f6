"""Every outcome a request can have, driven over HTTP against the real stack, and checked against the one table
(`contract/outcomes.py`): the HTTP status, the log row's status and error kind in BigQuery, the job's state.

A catalog model with a queue and no worker of the stack's stands in for the model; a scripted worker here
pulls its requests like a worker would and answers each the way its prompt asks (`reply:expired`, ...).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import redis
import yaml
from google.api_core import exceptions

from api_server.process.app import create_app
from api_server.process.state import app_state
from contract import google_clients, naming
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.messages import InferenceReply, InferenceRequest, Payload, Prediction
from contract.outcomes import Outcome
from contract.settings import Settings, api_key_digest
from contract.stores.results import ResultStore
from emulators.bootstrap import bootstrap_pubsub
from tests.conftest import TEST_API_KEYS, png_b64, query_rows

pytestmark = pytest.mark.stack
MODEL = "outcomes-txt2img"
UNQUEUED = "outcomes-unqueued"  # in the API's catalog, but its topic was never made: the queue is unavailable
LIMITED_KEY = "outcomes-limited-key"  # one request a minute
KEY = TEST_API_KEYS[0]
AUTH = {"Authorization": f"Bearer {KEY}"}
# The model's request timeout here: long enough that an answered request is answered in it on a loaded machine (the
# scripted worker is a thread of the test process); the hand-over test shortens it so that nobody's answer makes a job.
WAIT_SECONDS = 60
HAND_OVER_SECONDS = 6


class ScriptedWorker:
    """Pulls the model's requests and stores the reply each prompt asks for: `reply:<status>[:<kind>][:slow]`;
    `reply:none` is never answered."""

    def __init__(self, settings: Settings) -> None:
        self._subscriber = google_clients.subscriber_client()
        self._subscription = self._subscriber.subscription_path(settings.project_id, naming.worker_subscription(MODEL))
        self._results = ResultStore(redis.Redis.from_url(settings.redis_url), 600)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                pulled = self._subscriber.pull(
                    request={"subscription": self._subscription, "max_messages": 10}, timeout=1, retry=None
                )
            except exceptions.DeadlineExceeded:
                continue
            except exceptions.GoogleAPICallError:
                time.sleep(0.2)
                continue
            if pulled.received_messages:
                self._subscriber.acknowledge(
                    request={
                        "subscription": self._subscription,
                        "ack_ids": [m.ack_id for m in pulled.received_messages],
                    }
                )
            for item in pulled.received_messages:
                request = InferenceRequest.model_validate_json(item.message.data)
                script = request.instances[0].prompt.split(" ")[0].split(":")[1:]
                if script[0] != "none":
                    delay = 1.5 if "slow" in script else 0.0
                    threading.Timer(delay, self._results.put, [self._reply(request, script)]).start()

    @staticmethod
    def _reply(request: InferenceRequest, script: list[str]) -> InferenceReply:
        status, kind = script[0], (script[1] if len(script) > 1 and script[1] != "slow" else None)
        reply = InferenceReply(
            request_id=request.request_id,
            model=request.model,
            model_version=request.model_version,
            status=status,
            error_kind=kind or (None if status == "ok" else status),
            error=None if status == "ok" else f"scripted {status}",
            worker_id="scripted-worker",
            attempt=1,
        )
        if status == "ok":
            params = request.parameters
            reply.predictions = [
                Prediction(image=Payload(b64=png_b64()), seed=params.seed, width=params.width, height=params.height)
            ]
        return reply

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._subscriber.close()


@pytest.fixture(scope="module")
def outcomes_app(stack, settings, tmp_path_factory):
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    raw["models"][MODEL] = {**raw["models"]["sd15-txt2img"], "weights_path": "outcomes/1"}
    path = tmp_path_factory.mktemp("catalog") / "queued.yaml"
    path.write_text(yaml.safe_dump(raw))
    bootstrap_pubsub(settings, ModelCatalog.from_yaml(path))
    raw["models"][UNQUEUED] = {**raw["models"][MODEL], "weights_path": "unqueued/1"}
    path = path.with_name("models.yaml")
    path.write_text(yaml.safe_dump(raw))
    env = {
        **stack.service_env(),
        "MAAS_CATALOG_PATH": str(path),
        "MAAS_API_KEYS": f"{KEY},{LIMITED_KEY}",
        "MAAS_KEY_LIMITS": f"{api_key_digest(LIMITED_KEY)}=1/0",
        "MAAS_LOG_SPOOL_DIR": str(tmp_path_factory.mktemp("spool")),
    }
    app = create_app(Settings.from_env(env))
    # The catalog refuses a timeout this short (ack deadlines), so it is set on the loaded entries.
    catalog = app_state(app).catalog
    for name in (MODEL, UNQUEUED):
        catalog.models[name] = catalog.models[name].model_copy(update={"request_timeout_seconds": WAIT_SECONDS})
    worker = ScriptedWorker(settings)
    yield app
    worker.stop()
    app_state(app).close()


def body(script: str, seed: int | None = None) -> dict:
    parameters = {"width": 64, "height": 64, "num_inference_steps": 2}
    if seed is not None:
        parameters["seed"] = seed
    return {"instances": [{"prompt": f"reply:{script} {uuid.uuid4().hex}"}], "parameters": parameters}


@dataclass
class Seen:
    outcome: Outcome
    endpoint: str
    http_status: int
    request_id: str
    job_state: str | None = None
    job_error_code: int | None = None


def wait_for_job(client, location: str) -> dict:
    deadline = time.monotonic() + 30
    while (job := client.get(location, headers=AUTH).get_json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    return job


@pytest.fixture(scope="module")
def seen(outcomes_app, settings, bigquery) -> dict[tuple[Outcome, str], tuple[Seen, dict]]:
    """Each outcome reached once per endpoint it can happen on, with the log row BigQuery holds for it."""
    client = outcomes_app.test_client()
    url, jobs_url = f"/v1/models/{MODEL}:predict", f"/v1/models/{MODEL}/jobs"
    found: list[Seen] = []

    def sync(outcome: Outcome, response) -> None:
        found.append(Seen(outcome, "sync", response.status_code, response.headers["X-Request-Id"]))

    def job(outcome: Outcome, response) -> None:
        assert response.status_code == 202, response.get_data(as_text=True)
        final = wait_for_job(client, response.headers["Location"])
        error_code = final.get("error", {}).get("code")
        found.append(Seen(outcome, "job", 202, final["id"], final["status"], error_code))

    sync(Outcome.OK, client.post(url, json=body("ok"), headers=AUTH))
    cached = body("ok", seed=11)
    client.post(url, json=cached, headers=AUTH)
    sync(Outcome.CACHE_HIT, client.post(url, json=cached, headers=AUTH))
    job(Outcome.CACHE_HIT, client.post(jobs_url, json=cached, headers=AUTH))
    together = body("ok:slow", seed=12)
    with ThreadPoolExecutor(2) as pool:
        pair = list(pool.map(lambda _: outcomes_app.test_client().post(url, json=together, headers=AUTH), range(2)))
    [follower] = [response for response in pair if response.headers["X-Request-Id"] != pair[0].get_json()["request_id"]]
    sync(Outcome.COALESCED, follower)
    repeated, idempotent = body("ok"), {**AUTH, "Idempotency-Key": uuid.uuid4().hex}
    client.post(url, json=repeated, headers=idempotent)
    sync(Outcome.REPLAY, client.post(url, json=repeated, headers=idempotent))
    sync(Outcome.BAD_INPUT, client.post(url, json={"instances": [{"prompt": ""}]}, headers=AUTH))
    sync(Outcome.UNAUTHORIZED, client.post(url, json=body("ok"), headers={"Authorization": "Bearer nope"}))
    limited = {"Authorization": f"Bearer {LIMITED_KEY}"}
    client.post(url, json=body("ok"), headers=limited)
    sync(Outcome.RATE_LIMITED, client.post(url, json=body("ok"), headers=limited))
    sync(Outcome.UNAVAILABLE, client.post(f"/v1/models/{UNQUEUED}:predict", json=body("ok"), headers=AUTH))
    for outcome, script in [
        (Outcome.OK, "ok"),
        (Outcome.EXPIRED, "expired"),
        (Outcome.CANCELLED, "cancelled"),
        (Outcome.DEAD_LETTERED, "error:dead_lettered"),
        (Outcome.WORKER_ERROR, "error:inference_failed"),
    ]:
        if outcome is not Outcome.OK:
            sync(outcome, client.post(url, json=body(script), headers=AUTH))
        job(outcome, client.post(jobs_url, json=body(script), headers=AUTH))
    app_state(outcomes_app).job_log.finish_ended()

    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    ids = ", ".join(f"'{item.request_id}'" for item in found)
    sql = f"SELECT request_id, status, error_kind, http_status, endpoint FROM {table} WHERE request_id IN ({ids})"
    rows = {row["request_id"]: row for row in query_rows(bigquery, sql, len(found), timeout=30)}
    assert len(rows) == len(found)
    return {(item.outcome, item.endpoint): (item, rows[item.request_id]) for item in found}


def test_every_outcome_maps_once_to_its_http_status_log_status_error_kind_and_job_state(seen):
    reached = {outcome for outcome, _ in seen}
    issue_list = {
        Outcome.OK, Outcome.CACHE_HIT, Outcome.COALESCED, Outcome.REPLAY, Outcome.BAD_INPUT, Outcome.UNAUTHORIZED,
        Outcome.RATE_LIMITED, Outcome.UNAVAILABLE, Outcome.EXPIRED, Outcome.CANCELLED, Outcome.DEAD_LETTERED,
        Outcome.WORKER_ERROR,
    }  # fmt: skip
    assert issue_list <= reached
    for (outcome, endpoint), (item, row) in seen.items():
        spec = outcome.spec
        assert (item.http_status, row["http_status"]) == (spec.http_status if endpoint == "sync" else 202,) * 2, item
        assert (row["status"], row["error_kind"], row["endpoint"]) == (spec.log_status, spec.error_kind, endpoint), item
        if endpoint == "job":
            assert item.job_state == spec.job_state, item
            assert item.job_error_code == (None if outcome.answered else spec.http_status), item


def test_a_sync_expired_and_a_job_expired_log_the_same_status(seen):
    for outcome in (Outcome.EXPIRED, Outcome.CANCELLED):
        sync_row, job_row = seen[(outcome, "sync")][1], seen[(outcome, "job")][1]
        assert sync_row["status"] == job_row["status"] == outcome.spec.log_status
        assert sync_row["error_kind"] == job_row["error_kind"] == outcome.spec.error_kind


def test_job_endpoints_answer_a_cached_body_with_a_job_that_has_already_succeeded(outcomes_app):
    client = outcomes_app.test_client()
    cached = body("ok", seed=21)
    first = client.post(f"/v1/models/{MODEL}:predict", json=cached, headers=AUTH)
    assert first.status_code == 200
    # The synchronous endpoint keeps its cache hit: 200 with the predictions.
    again = client.post(f"/v1/models/{MODEL}:predict", json=cached, headers=AUTH)
    assert (again.status_code, again.headers["X-Cache"]) == (200, "hit")
    for path, headers in [
        (f"/v1/models/{MODEL}/jobs", AUTH),
        (f"/v1/models/{MODEL}:predict", {**AUTH, "Prefer": "respond-async"}),
    ]:
        response = client.post(path, json=cached, headers=headers)
        accepted = response.get_json()
        assert (response.status_code, response.headers["X-Cache"], accepted["status"]) == (202, "hit", "succeeded")
        assert response.headers["Location"] == accepted["links"]["self"] == f"/v1/jobs/{accepted['id']}"
        job = client.get(response.headers["Location"], headers=AUTH).get_json()
        assert job["status"] == "succeeded"
        assert job["result"]["predictions"] == first.get_json()["predictions"]


def test_a_sync_request_turned_into_a_job_says_how_to_follow_it(outcomes_app):
    client = outcomes_app.test_client()
    catalog = app_state(outcomes_app).catalog
    loaded = catalog.models[MODEL]
    catalog.models[MODEL] = loaded.model_copy(update={"request_timeout_seconds": HAND_OVER_SECONDS})
    try:
        response = client.post(f"/v1/models/{MODEL}:predict", json=body("none"), headers=AUTH)
    finally:
        catalog.models[MODEL] = loaded
    assert response.status_code == 202
    accepted = response.get_json()
    location = f"/v1/jobs/{accepted['id']}"
    assert response.headers["Location"] == accepted["links"]["self"] == location
    assert f"GET {location}" in accepted["message"] and "DELETE" in accepted["message"]
    assert client.get(location, headers=AUTH).get_json()["status"] == "queued"


def test_cancelling_a_job_twice_is_409_like_any_finished_job(outcomes_app):
    client = outcomes_app.test_client()
    location = client.post(f"/v1/models/{MODEL}/jobs", json=body("none"), headers=AUTH).headers["Location"]
    first = client.delete(location, headers=AUTH)
    assert (first.status_code, first.get_json()["status"]) == (200, "cancelled")
    again = client.delete(location, headers=AUTH)
    assert again.status_code == 409 and "cancelled" in again.get_json()["error"]["message"]
