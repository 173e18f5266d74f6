"""A dead or stalled worker's requests are re-dispatched by the watchdog, and a request nobody ran ends at its
deadline, against the real processes. `sleep-long-ack` has a 60 s ack deadline: within these tests the broker
cannot redeliver a dead worker's request, so an answer before then is the watchdog's doing."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis
import yaml

from api_server.process.app import create_app
from chaos.scenarios import ChaosContext, run_scenario
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.settings import Settings
from contract.stores.results import ResultStore
from emulators.bootstrap import bootstrap_pubsub
from emulators.processes import ProcessRegistry, redis_ok
from emulators.stack import start_redis
from tests.conftest import query_rows
from tests.integration.test_worker_faults import assert_answered_in_time, keep_sending

pytestmark = pytest.mark.stack
LONG_ACK = "sleep-long-ack"
ACK_DEADLINE_SECONDS = 60  # sleep-long-ack's, in the local catalog


@pytest.fixture
def ctx(stack, settings, auth_headers) -> ChaosContext:
    return ChaosContext.for_stack(stack, settings, auth_headers, row_wait_seconds=60)


def rows_of(bigquery, settings, request_ids) -> list[dict]:
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    ids = ", ".join(f"'{request_id}'" for request_id in request_ids)
    sql = f"SELECT request_id, status, worker_id, attempt FROM {table} WHERE request_id IN ({ids})"
    return query_rows(bigquery, sql, len(request_ids))


def test_a_killed_workers_held_requests_are_answered_by_the_other_once(ctx, extra_worker, bigquery, settings):
    victim = extra_worker("synthetic")
    pid = ctx.registry.pid(victim)
    fault = (2, lambda c: c.kill_worker(victim, holding=True))
    result = run_scenario(ctx, "worker SIGKILL", LONG_ACK, 12, 5, [fault])
    assert result.passed and result.ok == result.sent, result  # one row each, none doubled, all answered
    held = ctx.kills[0][1]
    assert held, "the kill caught no request in the victim's hands"
    assert max(result.recovery_seconds) < ACK_DEADLINE_SECONDS, result.recovery_seconds
    for row in rows_of(bigquery, settings, held):
        assert row["status"] == "ok" and row["attempt"] == 2, row
        assert not row["worker_id"].endswith(f"-{pid}"), row


def test_a_stalled_holder_that_finishes_late_adds_no_second_answer(stack, worker_client, extra_worker, settings):
    victim = extra_worker("synthetic")
    registry = ProcessRegistry(stack.stack_dir)
    pid = registry.pid(victim)
    ctx = ChaosContext.for_stack(stack, settings, {})
    sent = [worker_client.send(LONG_ACK, f"stall {i}", seed=i, timeout=120) for i in range(48)]
    held: set[str] = set()
    while not held:  # a moment the victim holds unanswered requests, found with it stopped
        ctx.signal(victim, signal.SIGSTOP)
        held = ctx.held_unanswered(pid)
        if not held:
            ctx.signal(victim, signal.SIGCONT)
            time.sleep(0.01)
    # While it is stopped its holder leases lapse and the watchdog hands its requests to the other worker.
    replies = worker_client.wait(sorted(held), timeout=ACK_DEADLINE_SECONDS - 10)
    ctx.signal(victim, signal.SIGCONT)
    # Awake again, the victim finishes what it held, finds each answer stored and acks without replying.
    lines = [f"request {request_id} was answered elsewhere first" for request_id in held]
    deadline = time.monotonic() + 30
    while True:
        late = registry.log_path(victim).read_text()
        if all(line in late for line in lines):
            break
        assert time.monotonic() < deadline, late[-2000:]
        time.sleep(0.2)
    store = ResultStore(redis.Redis.from_url(settings.redis_url), 60)
    for request_id in held:
        assert [received.reply for received in worker_client.replies[request_id]] == [replies[request_id]]
        assert replies[request_id].status == "ok" and replies[request_id].attempt == 2
        assert store.get(request_id) == replies[request_id]  # the bytes the client got are the ones kept
    assert {reply.status for reply in worker_client.wait(sent, timeout=60).values()} == {"ok"}


def test_with_redis_down_the_brokers_redelivery_still_answers_once(stack, worker_client, extra_worker):
    # The kill must catch the victim holding a request (what the test is about). When it does not (its call of
    # 200 ms answered, its next messages not yet pulled: a race the traffic's timing decides), it is tried again with
    # a new victim; every request of every try must still be answered once, in time, with the same images.
    for _ in range(3):
        sent, replies = _kill_a_worker_with_redis_down(stack, worker_client, extra_worker)
        for request_id in sent:  # a request run twice (no store to answer from) still gets the same images
            answers = {
                r.reply.model_dump_json(include={"status", "predictions"}) for r in worker_client.replies[request_id]
            }
            assert len(answers) == 1, request_id
        if any(reply.attempt >= 2 for reply in replies.values()):
            return
    pytest.fail("three kills in a row hit no request in flight")


def _kill_a_worker_with_redis_down(stack, worker_client, extra_worker) -> tuple[list[str], dict]:
    victim = extra_worker("synthetic")
    registry = ProcessRegistry(stack.stack_dir)
    pid = registry.pid(victim)
    registry.stop("redis")
    killed = threading.Event()

    def kill_in_stride() -> None:
        # Killed once it has answered a full batch's worth under the traffic (past its first, possibly partial,
        # pull), however slowly a busy machine brought it its first messages; the traffic stops with the kill.
        give_up = time.monotonic() + 120
        while worker_client.answered_by(f"-{pid}") < 8 and time.monotonic() < give_up:
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed.set()

    try:
        killer = threading.Thread(target=kill_in_stride, daemon=True)
        killer.start()
        sent = keep_sending(worker_client, seconds=0, concurrency=24, until=killed)
        killer.join()
    finally:
        start_redis(stack, registry)
        registry.wait_until("redis", lambda: redis_ok(stack.redis_port), timeout=15)
    return sent, assert_answered_in_time(worker_client, sent)


def test_a_job_nobody_runs_ends_expired_with_its_row_at_its_deadline(stack, settings, auth_headers, bigquery, tmp_path):
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    raw["models"]["unserved"] = {**raw["models"]["sd15-txt2img"], "weights_path": "unserved/1"}
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    bootstrap_pubsub(settings, ModelCatalog.from_yaml(path))  # a queue no worker pulls
    app = create_app(
        Settings.from_env({**stack.service_env(), "MAAS_CATALOG_PATH": str(path), "MAAS_JOB_DEADLINE_SECONDS": "3"})
    )
    try:
        body = {"instances": [{"prompt": "nobody runs this"}], "parameters": {"width": 64, "height": 64}}
        response = app.test_client().post(
            "/v1/models/unserved:predict", json=body, headers={**auth_headers, "Prefer": "respond-async"}
        )
        assert response.status_code == 202
        job_id = response.get_json()["id"]
        # Nobody asks about the job: the watchdog answers it `expired` at its deadline and its row is written
        # then (the API's own fallback would wait 30 s past the deadline and name no worker).
        table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
        sql = f"SELECT status, error_kind, endpoint, worker_id FROM {table} WHERE request_id = '{job_id}'"
        rows = query_rows(bigquery, sql, 1, timeout=20)
    finally:
        app.extensions["maas"].close()
    assert len(rows) == 1 and rows[0]["status"] == "expired" and rows[0]["error_kind"] == "expired", rows
    assert rows[0]["endpoint"] == "job" and rows[0]["worker_id"], rows


class LosingPublisher:
    """A publisher whose request messages never reach the queue: the copy a worker pulled and died with before
    taking it (no holder lease yet), which the emulator was seen never to deliver again (issue 44)."""

    def __init__(self, real) -> None:
        self._real = real

    def topic_path(self, project: str, topic: str) -> str:
        return self._real.topic_path(project, topic)

    def publish(self, topic: str, data: bytes, **attributes):
        from concurrent.futures import Future

        lost: Future = Future()
        lost.set_result("lost")
        return lost


def test_a_request_no_worker_takes_is_published_again_and_answered(stack, settings):
    """The API keeps the request (as it does every one) but its message is lost before any worker takes it: the
    watchdog publishes it again once it has gone untaken for twice the model's ack deadline, and a worker answers
    it long before its deadline (a job's: 15 minutes)."""
    from google.cloud import pubsub_v1

    from api_server.predict.dispatch import InferenceDispatcher
    from contract.generation import GenerationParameters
    from contract.messages import InferenceRequest, RequestInstance
    from contract.stores.inflight import InflightStore, RequestKeeper

    client = redis.Redis.from_url(settings.redis_url)
    spec = stack.catalog().get("sleep")  # a local model: the stack's catalog, not production's
    dispatcher = InferenceDispatcher(
        LosingPublisher(pubsub_v1.PublisherClient()), None, settings.project_id, RequestKeeper(InflightStore(client))
    )
    request = InferenceRequest(
        request_id=f"lost-{os.getpid()}-{time.time_ns()}",
        model="sleep",
        model_version=spec.version,
        instances=[RequestInstance(prompt="a copy lost with its worker")],
        parameters=GenerationParameters(seed=1, num_inference_steps=2, guidance_scale=7.5, width=64, height=64),
    )
    dispatcher.submit(request, spec, int((time.time() + 900) * 1000), "normal")
    results = ResultStore(client, 60)
    # Well past twice the ack deadline and well before the deadline; polled, not slept through.
    give_up = time.monotonic() + 6 * spec.ack_deadline_seconds
    reply = None
    while reply is None and time.monotonic() < give_up:
        reply = results.get(request.request_id)
        time.sleep(0.5)
    assert reply is not None, "nobody ran the request whose message was lost"
    assert reply.status == "ok", reply
