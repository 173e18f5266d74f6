"""An API process that dies with requests in flight: the SDK's retries take the first requests' answers (no second
inference), and every inference the workers ran ends with exactly one log row, written by whoever adopts it.

Against the stack's real processes and Redis: the API's gunicorn worker is SIGKILLed by its PID (its master starts
another, as in production a new instance takes the traffic), and the rows are read back from the BigQuery emulator.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
import yaml
from google.api_core import exceptions

from api_server.core.auth import Caller
from api_server.core.redis_state import RedisState
from api_server.inference_log.job_rows import NO_ANSWER_HTTP_STATUS, JobLogFinisher
from api_server.inference_log.writer import InferenceLogRow
from api_server.jobs.service import JobStore
from api_server.predict.cache import cache_key
from api_server.predict.flights import FlightPolicy, ResponseRecord, Role, SharedFlights, StillRunningError
from api_server.process.app import create_app
from contract import google_clients, naming
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.messages import Attr, InferenceReply, Payload, Prediction
from contract.settings import Settings
from contract.stores.inflight import InflightStore
from contract.stores.results import ResultStore
from emulators.bootstrap import bootstrap_pubsub
from emulators.processes import ProcessRegistry, http_ok
from tests.conftest import TEST_API_KEYS, png_b64, query_rows

pytestmark = pytest.mark.stack

# Served by the `synthetic` worker, which is frozen while the calls are published: they are all in flight when
# the API dies, and run once it is gone.
MODEL, MODEL_WORKER = "sleep", "worker-synthetic"
CALLS = 6
# The Redis database of the tests that race process stand-ins (the stack's services use their URL's, 0).
ISOLATED_DB = 9


@pytest.fixture
def client(stack) -> redis.Redis:
    return redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"])


@pytest.fixture
def isolated(stack) -> redis.Redis:
    """The stack's Redis server, in a database of the tests' own: the stack's API adopts every orphan it finds in
    its database once a second, so the races between process stand-ins would have one more contender there."""
    served = redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"]).connection_pool.connection_kwargs
    database = redis.Redis(host=served["host"], port=served["port"], db=ISOLATED_DB)
    database.flushdb()
    return database


def gunicorn_worker(master: int) -> int:
    """The one gunicorn worker process of the API's master (the stack runs one)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == master:
            children.append(int(stat.parent.name))
    assert len(children) == 1, f"expected one gunicorn worker under {master}, found {children}"
    return children[0]


def kept_requests_of(client: redis.Redis, model: str, known: set[bytes]) -> list[str]:
    """Requests the API published for `model` and keeps in flight, other than `known`."""
    found = []
    for raw in client.zrange(naming.INFLIGHT_DEADLINES_KEY, 0, -1):
        attributes = client.hget(naming.inflight_key(raw.decode()), "attributes")
        if raw not in known and attributes and json.loads(attributes).get(Attr.MODEL) == model:
            found.append(raw.decode())
    return found


def drain_replies(subscriber, subscription: str) -> list[InferenceReply]:
    """Every reply published to the replies topic since the subscription was made."""
    replies, empty = [], 0
    while empty < 2:
        try:
            response = subscriber.pull(request={"subscription": subscription, "max_messages": 100}, timeout=10)
        except exceptions.DeadlineExceeded:
            response = None
        if response is None or not response.received_messages:
            empty += 1
            continue
        subscriber.acknowledge(
            request={"subscription": subscription, "ack_ids": [m.ack_id for m in response.received_messages]}
        )
        replies += [InferenceReply.model_validate_json(m.message.data) for m in response.received_messages]
    return replies


def test_an_api_process_killed_mid_request_answers_each_call_once_with_one_inference_and_one_row(
    stack, settings, bigquery, client
):
    from maas_client import Client

    subscriber = google_clients.subscriber_client()
    replies_sub = subscriber.subscription_path(settings.project_id, f"test-orphans-{uuid.uuid4().hex[:12]}")
    subscriber.create_subscription(
        request={"name": replies_sub, "topic": f"projects/{settings.project_id}/topics/{naming.REPLIES_TOPIC}"}
    )
    registry = ProcessRegistry(stack.stack_dir)
    victim, model_worker = gunicorn_worker(registry.pid("api")), registry.pid(MODEL_WORKER)
    known = set(client.zrange(naming.INFLIGHT_DEADLINES_KEY, 0, -1))
    base_seed = random.randrange(1_000_000, 2_000_000_000)
    seeds = [base_seed + index for index in range(CALLS)]
    started = time.time()

    def call(seed: int):
        with Client(stack.api_url, TEST_API_KEYS[0]) as sdk:
            return sdk.predict(MODEL, f"orphan probe {seed}", seed=seed)

    os.killpg(model_worker, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(CALLS) as pool:
            futures = [pool.submit(call, seed) for seed in seeds]
            deadline = time.monotonic() + 60
            while len(kept_requests_of(client, MODEL, known)) < CALLS and time.monotonic() < deadline:
                time.sleep(0.02)
            try:
                published = kept_requests_of(client, MODEL, known)
                assert len(published) == CALLS, "the calls were never published"
                os.kill(victim, signal.SIGKILL)  # every call in flight: published, and its worker frozen
            finally:
                os.killpg(model_worker, signal.SIGCONT)  # before the pool waits for its calls, whatever happened
            results = [future.result(timeout=300) for future in futures]
    finally:
        os.killpg(model_worker, signal.SIGCONT)
        registry.wait_until("api", lambda: http_ok(f"{stack.api_url}/readyz", timeout=3), timeout=120)

    # Each call answered once, with its own images.
    assert [result.predictions[0].seed for result in results] == seeds

    # One inference per call: the workers' replies (each request id once: a stored answer may be re-sent).
    try:
        replies = [r for r in drain_replies(subscriber, replies_sub) if r.model == MODEL and r.predictions]
    finally:
        subscriber.delete_subscription(request={"subscription": replies_sub})
    inferences = {seed: set() for seed in seeds}
    for reply in replies:
        if reply.predictions[0].seed in inferences:
            inferences[reply.predictions[0].seed].add(reply.request_id)
    assert all(len(ran) == 1 for ran in inferences.values()), inferences
    ran = {request_id for ran_for_seed in inferences.values() for request_id in ran_for_seed}
    # The answer each call got is that inference's (its body names the request that ran the model).
    assert {result.request_id for result in results} == ran

    # One row per inference (the dead process's ones written by the process that adopted them), one row per
    # request id, and the retries that took an earlier answer marked as replays (no GPU time billed twice).
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    seed_list = ", ".join(str(seed) for seed in seeds)
    sql = (
        f"SELECT request_id, seed, status, http_status, batch_id, idempotent_replay, api_instance FROM {table} "
        f"WHERE model = '{MODEL}' AND seed IN ({seed_list}) "
        f"AND created_at >= TIMESTAMP_SECONDS({int(started) - 5})"
    )
    inference_rows = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = query_rows(bigquery, sql, CALLS, timeout=5)
        inference_rows = [row for row in rows if row["batch_id"] is not None]
        if {row["request_id"] for row in inference_rows} >= ran:
            break
        time.sleep(0.5)
    request_ids = [row["request_id"] for row in rows]
    assert len(request_ids) == len(set(request_ids)), "a request was logged twice"
    assert sorted(row["request_id"] for row in inference_rows) == sorted(ran)
    assert all(row["status"] == "ok" for row in inference_rows)
    replays = [row for row in rows if row["batch_id"] is None]
    assert all(row["idempotent_replay"] for row in replays), replays
    # Written by the process that adopted them: the dead one answered nobody.
    assert all(row["http_status"] == NO_ANSWER_HTTP_STATUS for row in inference_rows), inference_rows
    assert sorted(row["request_id"] for row in inference_rows) == sorted(published)

    # The reply subscriptions the dead process waited on are deleted by whoever adopted its rows, not left a day.
    leaked = {subscriber.subscription_path(settings.project_id, naming.reply_subscription(r)) for r in published}
    deadline = time.monotonic() + 30
    while leaked and time.monotonic() < deadline:
        listed = subscriber.list_subscriptions(request={"project": f"projects/{settings.project_id}"})
        leaked &= {subscription.name for subscription in listed}
        time.sleep(0.5)
    assert not leaked


# The doubled-row side: the row of a dead process's request is adopted by exactly one of the processes that find it.


class CollectedRows:
    """Stands in for an API process's log writer: the rows it was asked to write."""

    closed = False

    def __init__(self) -> None:
        self.rows: list[InferenceLogRow] = []
        self._lock = threading.Lock()

    def write(self, row: InferenceLogRow) -> None:
        with self._lock:
            self.rows.append(row)


def keep_orphan(store: InflightStore, owner: str) -> str:
    """A published request of API process `owner`, kept with its partial row, as the dispatcher keeps it."""
    request_id = uuid.uuid4().hex
    row = InferenceLogRow(
        request_id=request_id,
        created_at=datetime.now(UTC),
        model="sleep",
        status="error",
        http_status=500,
        api_instance=owner,
        endpoint="sync",
    ).to_json()
    deadline_ms = int((time.time() + 900) * 1000)
    attributes = {Attr.REQUEST_ID: request_id, Attr.MODEL: "sleep", Attr.DEADLINE_MS: str(deadline_ms)}
    store.keep(request_id, "projects/p/topics/t", b"{}", attributes, deadline_ms, row)
    return request_id


def finishers(client: redis.Redis, processes: int) -> list[tuple[JobLogFinisher, CollectedRows]]:
    results = ResultStore(client, 600)
    made = []
    for _ in range(processes):
        rows = CollectedRows()
        made.append((JobLogFinisher(JobStore(client, results, 600), rows, inflight=InflightStore(client),
                                    results=results), rows))  # fmt: skip
    return made


def test_a_dead_processes_row_is_written_once_however_many_processes_find_it(isolated):
    store, results = InflightStore(isolated), ResultStore(isolated, 600)
    dead = f"test-dead-{uuid.uuid4().hex[:8]}"  # never beat: its liveness key does not exist
    request_ids = [keep_orphan(store, dead) for _ in range(5)]
    processes = finishers(isolated, 4)
    assert sum(finisher.finish_orphaned() for finisher, _ in processes) == 0  # unanswered yet: nothing to write
    for request_id in request_ids:
        results.put(InferenceReply(request_id=request_id, model="sleep", model_version="1", status="ok",
                                   batch_id="b1", batch_size=1, inference_ms=200.0))  # fmt: skip
    barrier = threading.Barrier(len(processes) * 2)

    def sweep(finisher: JobLogFinisher) -> int:
        barrier.wait()
        return finisher.finish_orphaned()

    with ThreadPoolExecutor(len(processes) * 2) as pool:
        written = sum(pool.map(sweep, [finisher for finisher, _ in processes] * 2))
    rows = [row for _, collected in processes for row in collected.rows if row.request_id in request_ids]
    assert written == len(rows) == len(request_ids)
    assert sorted(row.request_id for row in rows) == sorted(request_ids)
    assert all(row.status == "ok" and row.http_status == NO_ANSWER_HTTP_STATUS and row.batch_id == "b1" for row in rows)
    assert not any(isolated.exists(naming.inflight_row_key(request_id)) for request_id in request_ids)


def test_a_live_processes_row_is_its_own_and_an_adopted_one_is_not_written_again(isolated):
    store, results = InflightStore(isolated), ResultStore(isolated, 600)
    live = f"test-live-{uuid.uuid4().hex[:8]}"
    store.beat(live, 30)
    mine = keep_orphan(store, live)
    results.put(InferenceReply(request_id=mine, model="sleep", model_version="1", status="ok"))
    ((finisher, collected),) = finishers(isolated, 1)
    finisher.finish_orphaned()
    assert not [row for row in collected.rows if row.request_id == mine]  # its owner is alive: left to it
    assert store.settle_row(mine)  # the owner's write claims it
    assert not store.settle_row(mine)

    # An owner that only looked dead (stalled past its liveness) finds its row adopted: it does not write it again.
    stalled = f"test-stalled-{uuid.uuid4().hex[:8]}"
    adopted = keep_orphan(store, stalled)
    results.put(InferenceReply(request_id=adopted, model="sleep", model_version="1", status="ok"))
    assert finisher.finish_orphaned() >= 1
    assert [row.request_id for row in collected.rows].count(adopted) == 1
    assert not store.settle_row(adopted)


# The retry's side: a waiter takes over a dead holder's Idempotency-Key lease once, and adopts its request.


def keep_for_a_minute(record: ResponseRecord) -> int | None:
    return 60


POLICY = FlightPolicy(keep_for=keep_for_a_minute, lease_seconds=30, wait_seconds=10, strict=True)


def test_a_dead_holders_lease_is_taken_over_by_one_waiter_which_adopts_its_request(isolated):
    key, dead = f"maas:test:{uuid.uuid4().hex}", f"test-dead-{uuid.uuid4().hex[:8]}"
    isolated.set(f"{key}:lease", f"fp|{dead}|first-request", px=30_000)  # its process died holding it
    adopted, computed = [], []
    lock = threading.Lock()

    def adopt(ticket: str) -> ResponseRecord:
        with lock:
            adopted.append(ticket)
        time.sleep(0.3)  # waiting for the first request's answer, while the other waiters poll
        return ResponseRecord(200, b"the first request's answer")

    def compute() -> ResponseRecord:
        computed.append(1)
        return ResponseRecord(200, b"a second inference")

    processes = [SharedFlights(RedisState(isolated), f"test-api-{index}") for index in range(2)]
    barrier = threading.Barrier(6)

    def retry(flights: SharedFlights) -> tuple[ResponseRecord, Role]:
        barrier.wait()
        return flights.run(key, "fp", compute, POLICY, ticket=uuid.uuid4().hex, adopt=adopt)

    for flights in processes:
        InflightStore(isolated).beat(flights._instance, 30)  # noqa: SLF001 - the waiters' own processes are alive
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(retry, processes * 3))
    assert adopted == ["first-request"] and not computed
    assert {record.body for record, _ in answers} == {b"the first request's answer"}
    assert sorted(role for _, role in answers).count(Role.ADOPTED) == 1


def test_a_live_holders_lease_is_waited_for_not_taken_over(isolated):
    key, live = f"maas:test:{uuid.uuid4().hex}", f"test-live-{uuid.uuid4().hex[:8]}"
    InflightStore(isolated).beat(live, 30)
    isolated.set(f"{key}:lease", f"fp|{live}|running-request", px=30_000)
    flights = SharedFlights(RedisState(isolated), "test-api-waiter")
    short = FlightPolicy(keep_for=keep_for_a_minute, lease_seconds=30, wait_seconds=1.5, strict=True)
    with pytest.raises(StillRunningError):
        flights.run(key, "fp", lambda: ResponseRecord(200, b"second"), short, adopt=lambda ticket: None)
    assert isolated.get(f"{key}:lease") == f"fp|{live}|running-request".encode()


def test_an_identical_request_adopts_a_dead_processes_inference_instead_of_running_it_again(
    stack, auth_headers, client
):
    app = create_app(Settings.from_env(stack.service_env()))  # an API process of its own
    try:
        state = app.extensions["maas"]
        spec = state.serving.stable("noop")
        body = {"instances": [{"prompt": f"adopted {uuid.uuid4().hex}"}], "parameters": {"seed": 7}}
        prepared = state.serving.prepare(spec, body, "probe", Caller("probe", "probe"))
        key = cache_key(spec, prepared.params, prepared.prompts, prepared.images)
        # A process that died waiting on its request `first`, identical, which a worker has answered since.
        first, dead = uuid.uuid4().hex, f"test-dead-{uuid.uuid4().hex[:8]}"
        image = Payload(b64=png_b64(8, 8))
        ResultStore(client, 600).put(InferenceReply(
            request_id=first, model=spec.name, model_version=spec.version, status="ok",
            predictions=[Prediction(image=image, seed=7, width=8, height=8)],
        ))  # fmt: skip
        client.set(f"{key}:lease", f"|{dead}|{first}", px=60_000)
        response = app.test_client().post(f"/v1/models/{spec.name}:predict", json=body, headers=auth_headers)
    finally:
        state.close()
    assert response.status_code == 200 and response.headers["X-Cache"] == "hit", response.get_json()
    assert response.get_json()["request_id"] == first  # the dead process's inference answered it
    assert response.get_json()["predictions"][0]["image_b64"] == image.b64
    assert not client.exists(naming.result_key(response.headers["X-Request-Id"]))  # and the model did not run again


def test_a_retry_adopting_a_request_still_unanswered_after_its_wait_gets_that_request_as_a_job(
    stack, settings, auth_headers, client, tmp_path
):
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    raw["models"]["unserved-orphan"] = {
        **raw["models"]["sd15-txt2img"], "weights_path": "unserved-orphan/1", "request_timeout_seconds": 30,
        "ack_deadline_seconds": 10,
    }  # fmt: skip
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    bootstrap_pubsub(settings, ModelCatalog.from_yaml(path))  # a queue no worker pulls
    env = {**stack.service_env(), "MAAS_CATALOG_PATH": str(path), "MAAS_JOB_DEADLINE_SECONDS": "60"}
    first, retry = create_app(Settings.from_env(env)), create_app(Settings.from_env(env))  # two API processes
    headers = {**auth_headers, "Idempotency-Key": uuid.uuid4().hex}
    body = {"instances": [{"prompt": "nobody runs this"}], "parameters": {"width": 64, "height": 64}}
    known = set(client.zrange(naming.INFLIGHT_DEADLINES_KEY, 0, -1))
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(first.test_client().post, "/v1/models/unserved-orphan:predict", json=body,
                                  headers=headers)  # fmt: skip
            deadline = time.monotonic() + 30
            while not (published := kept_requests_of(client, "unserved-orphan", known)) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(published) == 1
            first.extensions["maas"].liveness.stop()  # its process is gone, as far as the others can tell
            response = retry.test_client().post("/v1/models/unserved-orphan:predict", json=body, headers=headers)
            job = retry.test_client().get(f"/v1/jobs/{published[0]}", headers=auth_headers)
            waiting.result(timeout=120)
    finally:
        first.extensions["maas"].close()
        retry.extensions["maas"].close()
    assert response.status_code == 202, response.get_json()
    assert response.headers["Location"] == f"/v1/jobs/{published[0]}"  # the first request's job, not a new one
    assert response.headers["Idempotent-Replayed"] == "true"
    assert job.status_code == 200 and job.get_json()["status"] == "queued"
    assert not client.exists(naming.inflight_key(response.headers["X-Request-Id"]))  # the retry published nothing
