"""Flows on the stack, called like models: predict and jobs with stage-named progress, a cancel and a deadline
in the second stage, a row per stage linked to the flow's, and a flow across two deployments that the API
publishes once (the first stage's worker forwards it to the second's queue, never back through the API). The
flows are `make up`'s and tests/models.fixtures.yaml's (sd15-slow-hires, relay-across)."""

from __future__ import annotations

import base64
import io
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis
import requests
from PIL import Image

from api_server.core.auth import Caller
from api_server.flows.serving import FlowService
from api_server.predict.inference import InferenceService
from contract import google_clients, naming
from contract.messages import StageReport, request_attributes
from contract.stores.inflight import InflightStore
from contract.stores.results import ResultStore
from tests.conftest import TEST_ADMIN_KEY, query_rows

pytestmark = pytest.mark.stack
SMALL = {"width": 64, "height": 64}  # the flows' second stage runs at twice this


def predict(stack, auth_headers, flow: str, **parameters) -> requests.Response:
    body = {"instances": [{"prompt": f"flow {uuid.uuid4().hex[:8]}"}], "parameters": {**SMALL, **parameters}}
    return requests.post(f"{stack.api_url}/v1/models/{flow}:predict", json=body, headers=auth_headers, timeout=120)


def submit(stack, auth_headers, flow: str, **parameters) -> str:
    body = {"instances": [{"prompt": f"flow job {uuid.uuid4().hex[:8]}"}], "parameters": {**SMALL, **parameters}}
    response = requests.post(f"{stack.api_url}/v1/models/{flow}/jobs", json=body, headers=auth_headers, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def job_events(stack, auth_headers, job_id: str, on_running=None) -> list[tuple[str, dict]]:
    """Every (event, job) of the job's stream until it ends; `on_running(job)` is called on each progress event."""
    seen, fields = [], {}
    with requests.get(f"{stack.api_url}/v1/jobs/{job_id}/events", headers=auth_headers, stream=True,
                      timeout=(5, 120)) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines(decode_unicode=True):
            if line == "":
                if "event" in fields:
                    seen.append((fields["event"], json.loads(fields["data"])))
                    if fields["event"] == "running" and on_running is not None:
                        on_running(seen[-1][1])
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
    return seen


def log_rows(bigquery, settings, flow_request_id: str, expected: int) -> list[dict]:
    """The flow's row and its stages' rows (keyed `<flow request id>:<stage>`)."""
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    sql = (f"SELECT * FROM {table} WHERE request_id = '{flow_request_id}' "
           f"OR flow_request_id = '{flow_request_id}' ORDER BY stage_index")  # fmt: skip
    return query_rows(bigquery, sql, expected, timeout=60)


def publishes(stack) -> float:
    """Request messages the API has published so far (its `maas_api_publishes_total`, every queue)."""
    text = requests.get(f"{stack.api_url}/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^maas_api_publishes_total\{[^}]*\} (\S+)$", text, re.M))


def test_get_models_lists_each_flow_with_its_stages(stack, auth_headers):
    listed = requests.get(f"{stack.api_url}/v1/models", headers=auth_headers, timeout=10).json()["models"]
    flows = {entry["name"]: entry for entry in listed if entry.get("kind") == "flow"}
    assert {"sd15-hires", "sdxl-refined"} <= set(flows)
    assert [(s["name"], s["model"], s["output"]) for s in flows["sdxl-refined"]["stages"]] == [
        ("base", "sdxl-txt2img", "latent"), ("refiner", "sdxl-refiner", "image"),
    ]  # fmt: skip
    detail = requests.get(f"{stack.api_url}/v1/models/sd15-hires", headers=auth_headers, timeout=10).json()
    assert detail["stages"][0]["resize"] == {"scale": 2, "space": "pixel"} and detail["traffic"] is None


# Each flow's stages, their models and its output size (sd15-hires doubles the size between its stages).
FLOW_STAGES = {
    "sd15-hires": (["base", "hires"], ["sd15-txt2img", "sd15-img2img"], 128),
    "sdxl-refined": (["base", "refiner"], ["sdxl-txt2img", "sdxl-refiner"], 64),
    "flux-draft-edit": (["draft", "edit"], ["flux-schnell", "flux-kontext"], 64),  # ending in an edit (issue 51)
}
# Each stage model's task: its stage row's `task`.
STAGE_TASKS = {"sd15-txt2img": "text-to-image", "sd15-img2img": "image-to-image", "sdxl-txt2img": "text-to-image",
               "sdxl-refiner": "image-to-image", "flux-schnell": "text-to-image", "flux-kontext": "edit"}  # fmt: skip


@pytest.mark.parametrize("flow", list(FLOW_STAGES))
def test_a_flow_answers_like_a_model_with_a_row_per_stage_linked_to_its_own(stack, auth_headers, bigquery, settings,
                                                                            flow):  # fmt: skip
    response = predict(stack, auth_headers, flow, seed=11)
    assert response.status_code == 200, response.text
    answer, request_id = response.json(), response.headers["X-Request-Id"]
    assert answer["model"] == flow and answer["request_id"] == request_id
    stages = [stage["stage"] for stage in answer["stages"]]
    expected_stages, models, size = FLOW_STAGES[flow]
    assert stages == expected_stages
    assert (answer["predictions"][0]["width"], answer["predictions"][0]["height"]) == (size, size)
    rows = log_rows(bigquery, settings, request_id, 3)
    assert len(rows) == 3, rows  # exactly one row per stage that ran, and the flow's
    own = next(row for row in rows if row["request_id"] == request_id)
    assert (own["model"], own["flow"], own["stage"], own["status"]) == (flow, flow, None, "ok")
    staged = [row for row in rows if row["stage"] is not None]
    assert [row["stage"] for row in staged] == stages
    assert [row["model"] for row in staged] == models
    assert [row["task"] for row in staged] == [STAGE_TASKS[model] for model in models]
    assert all(row["flow_request_id"] == request_id and row["flow"] == flow for row in staged)
    assert all(row["batch_id"] and row["inference_ms"] > 0 and row["gpu_seconds"] > 0 for row in staged)
    assert own["gpu_seconds"] == pytest.approx(sum(row["gpu_seconds"] for row in staged), rel=1e-6)
    # One worker group serves both stages: one worker ran them.
    assert len({row["worker_id"] for row in staged}) == 1


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def test_a_flow_repaints_its_draft_under_the_requests_mask_as_the_two_models_called_in_turn(stack, auth_headers,
                                                                                            bigquery, settings):  # fmt: skip
    """sd15-draft-repaint (make up's): sd15-txt2img drafts, sd15-inpaint repaints the draft under the request's mask.
    Its answer is the inpaint model's of the draft with that mask (called in turn); a mask that is not the draft's
    size is predict's 422, with nothing published."""
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 32))  # a quarter repaints
    prompt, seed = f"repaint {uuid.uuid4().hex[:8]}", 17
    url = f"{stack.api_url}/v1/models/sd15-draft-repaint:predict"
    before = publishes(stack)
    wrong = requests.post(url, json={"instances": [{"prompt": prompt, "mask": png_b64(mask.resize((64, 32)))}],
                                     "parameters": {**SMALL, "seed": seed}}, headers=auth_headers, timeout=30)  # fmt: skip
    assert wrong.status_code == 422 and wrong.json()["error"]["field"] == "instances.0.mask", wrong.text
    assert publishes(stack) == before
    draft_parameters = {**SMALL, "seed": seed, "num_inference_steps": 2}  # the draft's; the repaint runs its model's
    body = {"instances": [{"prompt": prompt, "mask": png_b64(mask)}], "parameters": draft_parameters}
    response = requests.post(url, json=body, headers=auth_headers, timeout=120)
    assert response.status_code == 200, response.text
    answer, request_id = response.json(), response.headers["X-Request-Id"]
    assert [(stage["stage"], stage["model"]) for stage in answer["stages"]] == [
        ("draft", "sd15-txt2img"), ("repaint", "sd15-inpaint"),
    ]  # fmt: skip
    draft = requests.post(f"{stack.api_url}/v1/models/sd15-txt2img:predict", headers=auth_headers, timeout=120,
                          json={"instances": [{"prompt": prompt}], "parameters": draft_parameters})  # fmt: skip
    assert draft.status_code == 200, draft.text
    repainted = requests.post(f"{stack.api_url}/v1/models/sd15-inpaint:predict", headers=auth_headers, timeout=120,
                              json={"instances": [{"prompt": prompt, "image": draft.json()["predictions"][0]["image_b64"],
                                                   "mask": png_b64(mask)}],
                                    "parameters": {**SMALL, "seed": seed}})  # fmt: skip
    assert repainted.status_code == 200, repainted.text
    flow_image = pixels(answer["predictions"][0]["image_b64"])
    assert flow_image.shape == (64, 64, 3)
    # The two calls' answer (equal when measured; another batch composition may move a value by a level or two), and
    # not the draft's: the repaint ran on it (the tiny random inpaint model moves every pixel, 40/255 on average).
    assert np.abs(flow_image - pixels(repainted.json()["predictions"][0]["image_b64"])).max() <= 3
    assert np.abs(flow_image - pixels(draft.json()["predictions"][0]["image_b64"])).mean() > 10
    rows = sorted(
        log_rows(bigquery, settings, request_id, 3), key=lambda row: -1 if row["stage"] is None else row["stage_index"]
    )
    assert [(row["stage"], row["task"], row["mask_fraction"]) for row in rows] == [
        (None, "text-to-image", 0.25), ("draft", "text-to-image", None), ("repaint", "inpaint", 0.25),
    ], rows  # fmt: skip


def test_a_flow_job_streams_progress_naming_each_stage_over_all_stages_steps(stack, auth_headers):
    job_id = submit(stack, auth_headers, "sd15-slow-hires", num_inference_steps=20, seed=5)
    seen = job_events(stack, auth_headers, job_id)
    assert seen[-1][0] == "succeeded", seen[-1]
    progress = [job["progress"] for kind, job in seen if kind == "running"]
    assert progress, "no progress event"
    assert {p["total"] for p in progress} == {20 + 50}  # the base's 20 steps and the hires pass's 50
    steps = [p["step"] for p in progress]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert "hires" in {p["stage"] for p in progress}
    assert all(p["stage_index"] == (0 if p["stage"] == "base" else 1) for p in progress)
    assert all(p["step"] > 20 for p in progress if p["stage"] == "hires")


def test_a_flow_job_cancelled_in_its_second_stage_stops_there(stack, auth_headers, bigquery, settings):
    job_id = submit(stack, auth_headers, "sd15-slow-hires", num_inference_steps=4, seed=6)
    cancelled: list[int] = []

    def cancel_in_stage_two(job: dict) -> None:
        if job["progress"].get("stage") == "hires" and not cancelled:
            cancelled.append(job["progress"]["step"])
            answer = requests.delete(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10)
            assert answer.status_code == 200, answer.text

    seen = job_events(stack, auth_headers, job_id, cancel_in_stage_two)
    assert cancelled, "never saw the second stage run"
    assert seen[-1][0] == "cancelled"
    job = requests.get(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10).json()
    assert job["status"] == "cancelled" and "result" not in job
    rows = log_rows(bigquery, settings, job_id, 1)
    own = next(row for row in rows if row["request_id"] == job_id)
    assert own["status"] == "cancelled" and own["flow"] == "sd15-slow-hires"
    assert len([row for row in rows if row["stage"] is not None]) <= 2  # never more than one row per stage


def test_a_flow_past_its_deadline_in_its_second_stage_expires_naming_it(stack, settings):
    """The API's deadline is its job deadline (minutes): the flow's message is published here as the API builds
    it, with a deadline 5 s away. `relay` (tests/models.fixtures.yaml) runs a 0.3 s draft, then a finish that
    sleeps 6 s: the finish cannot end before the deadline, whatever the machine's speed."""
    catalog = stack.catalog()
    flows = FlowService(catalog, lambda model, _request_id, _caller: catalog.get(model))
    call = flows.call(catalog.flow("relay"), uuid.uuid4().hex, Caller("test", "test"))
    body = {"instances": [{"prompt": "deadline"}], "parameters": {"seed": 1}}
    request_id = uuid.uuid4().hex
    inference = InferenceService(None, None, 900)  # type: ignore[arg-type]
    message = inference.message(inference.prepare(call.spec, body, request_id, Caller("test", "test"), flow=call))
    results = ResultStore(redis.Redis.from_url(settings.redis_url), 60)
    publisher = google_clients.publisher_client()
    replies = publisher.topic_path(settings.project_id, naming.REPLIES_TOPIC)
    attributes = request_attributes(message, replies, int((time.time() + 5.0) * 1000))
    topic = publisher.topic_path(settings.project_id, naming.request_topic(call.spec.queue, "normal"))
    publisher.publish(topic, message.model_dump_json().encode(), **attributes).result(timeout=60)
    reply = None
    give_up = time.monotonic() + 60
    while reply is None and time.monotonic() < give_up:
        reply = results.get(request_id)
        time.sleep(0.2)
    assert reply is not None, "the flow was never answered"
    assert reply.status == "expired" and reply.error.startswith("stage finish (relay-finish)"), reply.error
    # The finish ran, partly: it has its report (so its row) beside the draft's; the flow started with the draft.
    assert [(stage.stage, stage.status) for stage in reply.stages] == [("draft", "ok"), ("finish", "expired")]
    assert reply.worker_started_ms == reply.stages[0].worker_started_ms is not None


def test_a_flow_past_its_deadline_in_a_handoff_between_groups_keeps_the_stage_that_ran_and_says_where(stack, settings):
    """The state a flow leaves when its deadline passes while it waits in the next group's queue, set as the API and
    the draft's worker leave it (the API's kept message, the draft's kept report, nobody holding it), with a
    deadline already past: the stack's watchdog answers it, naming the handoff, with the draft's report (its row;
    the job's started_at)."""
    catalog = stack.catalog()
    flows = FlowService(catalog, lambda model, _request_id, _caller: catalog.get(model))
    call = flows.call(catalog.flow("relay-across"), uuid.uuid4().hex, Caller("test", "test"))
    request_id = uuid.uuid4().hex
    inference = InferenceService(None, None, 900)  # type: ignore[arg-type]
    body = {"instances": [{"prompt": "handoff"}], "parameters": {"seed": 1}}
    message = inference.message(inference.prepare(call.spec, body, request_id, Caller("test", "test"), flow=call))
    client = redis.Redis.from_url(settings.redis_url)
    started_ms = int(time.time() * 1000) - 2000
    draft = StageReport(stage="draft", index=0, model="relay-draft", model_version="1", worker_id="w-relay",
                        inference_ms=300.0, worker_started_ms=started_ms, batch_size=1)  # fmt: skip
    client.hset(naming.flow_stages_key(request_id), "0", draft.model_dump_json())
    deadline_ms = int(time.time() * 1000) - 500
    topic = f"projects/{settings.project_id}/topics/{naming.request_topic(call.spec.queue, 'normal')}"
    attributes = request_attributes(message, naming.REPLIES_TOPIC, deadline_ms)
    InflightStore(client).keep(request_id, topic, message.model_dump_json().encode(), attributes, deadline_ms)
    results = ResultStore(client, 60)
    reply, give_up = None, time.monotonic() + 30
    while reply is None and time.monotonic() < give_up:
        reply = results.get(request_id)
        time.sleep(0.2)
    assert reply is not None, "the watchdog never answered the flow"
    assert (reply.status, reply.model) == ("expired", "relay-across")
    assert reply.error.startswith("stage polish (relay-polish): deadline passed during the handoff from stage draft")
    assert [(stage.stage, stage.status) for stage in reply.stages] == [("draft", "ok")]
    assert reply.worker_started_ms == started_ms


def test_a_flow_across_two_deployments_is_published_once_by_the_api(stack, auth_headers, bigquery, settings):
    # relay-across (tests/models.fixtures.yaml): its draft is the relay group's, its polish the rollouts group's.
    before = publishes(stack)
    response = predict(stack, auth_headers, "relay-across", seed=12)
    assert response.status_code == 200, response.text
    assert publishes(stack) - before == 1  # the first stage's worker forwarded the flow to the second's queue
    answer, request_id = response.json(), response.headers["X-Request-Id"]
    assert [(stage["stage"], stage["model"]) for stage in answer["stages"]] == [
        ("draft", "relay-draft"), ("polish", "relay-polish"),
    ]  # fmt: skip
    rows = log_rows(bigquery, settings, request_id, 3)
    staged = [row for row in rows if row["stage"] is not None]
    assert len(rows) == 3 and len({row["worker_id"] for row in staged}) == 2  # two deployments' workers


def test_identical_seeded_flow_calls_run_once_and_only_that_run_has_stage_rows(stack, auth_headers, bigquery, settings):
    prompt = f"coalesced flow {uuid.uuid4().hex[:8]}"
    body = {"instances": [{"prompt": prompt}], "parameters": {**SMALL, "seed": 21}}

    def call(_index: int) -> requests.Response:
        return requests.post(f"{stack.api_url}/v1/models/sd15-hires:predict", json=body, headers=auth_headers,
                             timeout=120)  # fmt: skip

    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(call, range(3)))
    responses.append(call(3))  # after they ended: the result cache
    assert {response.status_code for response in responses} == {200}
    assert len({response.json()["predictions"][0]["image_b64"] for response in responses}) == 1
    assert responses[-1].headers["X-Cache"] == "hit"
    ids = [response.headers["X-Request-Id"] for response in responses]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    quoted = ", ".join(f"'{request_id}'" for request_id in ids)
    rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id IN ({quoted}) OR flow_request_id IN ({quoted})",
                      len(ids) + 2, timeout=60)  # fmt: skip
    ran = [row for row in rows if row["stage"] is None and not row["coalesced"] and not row["cache_hit"]]
    assert len(ran) == 1, rows
    staged = [row for row in rows if row["stage"] is not None]
    assert sorted(row["stage"] for row in staged) == ["base", "hires"]
    assert {row["flow_request_id"] for row in staged} == {ran[0]["request_id"]}


def test_an_idempotency_key_replays_a_flows_answer_without_running_it_again(stack, auth_headers, bigquery, settings):
    headers = {**auth_headers, "Idempotency-Key": f"flow-{uuid.uuid4().hex}"}
    body = {"instances": [{"prompt": "once"}], "parameters": SMALL}  # no seed: only the key makes it one request
    first, again = (requests.post(f"{stack.api_url}/v1/models/sd15-hires:predict", json=body, headers=headers,
                                  timeout=120) for _ in range(2))  # fmt: skip
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == first.json()
    rows = log_rows(bigquery, settings, first.headers["X-Request-Id"], 3)
    assert sorted(row["stage"] or "" for row in rows) == ["", "base", "hires"]
    replay = log_rows(bigquery, settings, again.headers["X-Request-Id"], 1)
    assert [(row["idempotent_replay"], row["stage"]) for row in replay] == [(True, None)]  # no stage rows of its own


def test_a_flow_whose_stage_has_a_failing_canary_is_answered_by_the_stable_version_and_the_guard_rolls_it_back(
    stack, auth_headers, bigquery, settings
):
    """relay-canary (tests/models.fixtures.yaml): its polish's model sends half its calls to a version 2 that fails
    every request. Every flow call is answered (the polish falls back to version 1), and the rollback guard sees the
    canary's failures through the flow alone and takes it to 0%, as it does for direct calls."""
    admin = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}

    def split() -> dict:
        response = requests.get(f"{stack.api_url}/v1/models/relay-polish-canary", headers=auth_headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()["traffic"]

    started, fell_back = time.monotonic(), []
    try:
        while split()["traffic"]["2"] != 0:
            assert time.monotonic() - started < 90, "the failing canary of a flow's stage was not rolled back"
            if len(fell_back) >= 40:  # enough calls for the guard's window: wait for its check
                time.sleep(0.2)
                continue
            response = predict(stack, auth_headers, "relay-canary", seed=len(fell_back))
            assert response.status_code == 200, response.text  # the canary's failure never reaches the caller
            answer = response.json()
            assert answer["model_version"] == "draft=1,polish=1", answer
            assert [(stage["stage"], stage["model_version"]) for stage in answer["stages"]] == [
                ("draft", "1"), ("polish", "1"),
            ]  # fmt: skip
            fell_back.append(response.headers["X-Request-Id"])
        info = split()
        assert info["traffic"] == {"1": 100, "2": 0} and info["set_by"] == "rollback-guard"
        sql = (f"SELECT reason FROM `{settings.project_id}.{settings.dataset}.rollout_audit` "
               "WHERE model = 'relay-polish-canary' AND action = 'rollback'")  # fmt: skip
        (audit,) = query_rows(bigquery, sql, 1, timeout=30)
        assert "error rate" in audit["reason"]
        # A call the canary failed: its row names the failed run and the stable one, and its stages are the stable
        # run's (the failed attempt's polish is the fallback's, not a billed stage of its own).
        table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
        quoted = ", ".join(f"'{request_id}'" for request_id in fell_back)
        rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id IN ({quoted})", len(fell_back), timeout=60)
        failed_over = [row for row in rows if row["fallback_from"] is not None]
        assert failed_over, "no call was sent to the canary"
        assert all(
            (row["fallback_from"], row["model_version"], row["status"])
            == ("draft=1,polish=2", "draft=1,polish=1", "ok")
            and "configured to fail" in row["fallback_error"]
            for row in failed_over
        ), failed_over
    finally:
        requests.delete(f"{stack.api_url}/v1/models/relay-polish-canary/traffic", headers=admin, timeout=10)
