"""Flows on the real processes (the emulators, Redis, worker processes; no API): a flow whose worker is SIGKILLed
in its second stage resumes there and is answered once, and a flow across two worker groups goes on from one
worker to the other through the second group's queue (the intermediate as a claim check in the bucket).

The flows are the tests' synthetic ones (tests/models.fixtures.yaml `relay`, `relay-across`); their stages run the
worker's whole path: intake, pool, device loop, the flows' finisher, checkpoints, forwards.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import redis

from contract import google_clients, naming
from contract.messages import Progress

pytestmark = pytest.mark.stack
TIMEOUT_SECONDS = 30


def wait_until(condition, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < end, f"{what} not within {timeout}s"
        time.sleep(0.05)
    return found


def kept_objects(settings, request_id: str) -> list[str]:
    bucket = google_clients.storage_client(settings).bucket(settings.payload_bucket)
    return [blob.name for blob in bucket.list_blobs(prefix=naming.flow_stage_prefix(request_id))]


def assert_nothing_kept(settings, store: redis.Redis, request_id: str) -> None:
    """The flow ended: its stages' outputs and reports are gone (removed just after the answer)."""
    wait_until(
        lambda: not store.exists(naming.flow_stages_key(request_id)) and not kept_objects(settings, request_id),
        10,
        "the flow's kept stages removed",
    )


def test_a_flow_whose_worker_is_killed_in_stage_2_resumes_there_and_is_answered_once(
    stack, settings, worker_client, extra_worker
):
    extra_worker("relay")  # two workers in the group: one dies, the other resumes the flow
    store = redis.Redis.from_url(settings.redis_url)
    request_id = worker_client.send_flow(
        stack.catalog(), "relay", "relay me", timeout=TIMEOUT_SECONDS, num_inference_steps=4
    )
    # Stage 1 finished and kept (its report in Redis, written beside stage 2's start), stage 2 running (6 s): its
    # progress names it.
    wait_until(lambda: store.hexists(naming.flow_stages_key(request_id), "0"), 15, "stage 1 kept")

    def in_stage_2():
        raw = store.get(naming.progress_key(request_id))
        return raw is not None and Progress.model_validate_json(raw).stage == "finish"

    wait_until(in_stage_2, 10, "stage 2 running")
    progress = Progress.model_validate_json(store.get(naming.progress_key(request_id)))
    finish_steps = stack.catalog().get("relay-finish").defaults.num_inference_steps  # its own: it takes no steps
    assert progress.stage_index == 1 and progress.total == 4 + finish_steps and progress.step >= 4
    holder = store.get(naming.holder_key(request_id))
    assert holder is not None and not store.exists(naming.result_key(request_id)), "stage 2 ended before the kill"
    victim = holder.decode()
    os.kill(int(victim.rsplit("-", 1)[1]), signal.SIGKILL)

    reply = worker_client.wait([request_id], timeout=TIMEOUT_SECONDS + 10)[request_id]
    assert reply.status == "ok", reply.error
    assert (reply.model, reply.model_version) == ("relay", "")
    # Stage 1 ran once, on the killed worker; stage 2 ran again on another, from stage 1's kept output.
    assert [(r.stage, r.index, r.model) for r in reply.stages] == [
        ("draft", 0, "relay-draft"), ("finish", 1, "relay-finish"),
    ]  # fmt: skip
    draft, finish = reply.stages
    assert draft.worker_id == victim and finish.worker_id != victim
    assert reply.predictions and (reply.predictions[0].width, reply.predictions[0].height) == (8, 8)
    assert_nothing_kept(settings, store, request_id)
    # Answered once: the killed worker never answered, the resumed one once. The broker may still redeliver the
    # killed worker's copy: that one gets the stored answer again (the same reply), never a third run.
    stored = json.loads(store.get(naming.result_key(request_id)))
    assert [s["stage"] for s in stored["stages"]] == ["draft", "finish"]
    assert {received.reply.model_dump_json() for received in worker_client.replies[request_id]} == {
        reply.model_dump_json()
    }


def test_a_flow_across_two_worker_groups_goes_on_worker_to_worker_with_a_claim_check(stack, settings, worker_client):
    store = redis.Redis.from_url(settings.redis_url)
    # 512x512: the draft's image, at the polish's size, is above the inline limit, so it travels as a claim check.
    request_id = worker_client.send_flow(
        stack.catalog(), "relay-across", "across", timeout=TIMEOUT_SECONDS, num_inference_steps=2, width=512, height=512
    )
    reply = worker_client.wait([request_id], timeout=TIMEOUT_SECONDS)[request_id]
    assert reply.status == "ok", reply.error
    draft, polish = reply.stages
    assert (draft.model, polish.model) == ("relay-draft", "relay-polish")
    # Two deployments: the relay group's worker ran the draft, the rollouts group's worker the polish.
    assert draft.worker_id != polish.worker_id
    assert reply.worker_id == polish.worker_id and reply.model == "relay-across"
    assert_nothing_kept(settings, store, request_id)
    assert len(worker_client.replies[request_id]) == 1
