"""A batch line naming a flow leaves the rows of the same call made interactively (api_server/batches/runner.py): the
flow's row (flow set, the sum of its stages' GPU-seconds) and one row per stage that ran, and its result line has
the stages as the sync answer has them."""

from __future__ import annotations

from types import SimpleNamespace

from api_server.batches.runner import BatchRunner
from api_server.inference_log.writer import InferenceLogRow
from api_server.jobs.service import JobState, job_view
from contract.messages import Payload, Prediction
from tests.unit.test_flow_canaries import flow_call, flow_reply


def runner() -> BatchRunner:
    settings = SimpleNamespace(instance_id="api-1")
    made = BatchRunner(settings, None, None, None, None, None, None, None, None, None)  # type: ignore[arg-type]
    made._save_images = lambda batch_id, line_number, reply: [("gs://b/images/1-0.png", 10)]  # type: ignore[method-assign]
    return made


def line_entry(made: BatchRunner) -> dict:
    _, prepared = flow_call("1")
    batch = SimpleNamespace(batch_id="b1", owner="k")
    return {"custom_id": "c1", "line": 1, "row": made._row(batch, prepared, "c1")}  # type: ignore[arg-type]


def test_a_flow_line_has_the_flows_row_summing_its_stages_and_a_row_per_stage():
    made = runner()
    reply = flow_reply("1").model_copy(update={"request_id": "r", "predictions": [
        Prediction(image=Payload(b64="AAAA"), seed=1, width=64, height=64)]})  # fmt: skip
    kind, counter, item = made._answer("b1", "r", line_entry(made), reply, None)
    assert (kind, counter) == ("results", "succeeded")
    own = InferenceLogRow.from_json(item["row"])
    stages = [InferenceLogRow.from_json(row) for row in item["stage_rows"]]
    assert (own.model, own.flow, own.endpoint, own.batch_job_id) == ("relay-canary", "relay-canary", "batch", "b1")
    assert [(row.request_id, row.stage, row.flow_request_id) for row in stages] == [
        ("r:draft", "draft", "r"), ("r:polish", "polish", "r"),
    ]  # fmt: skip
    assert own.gpu_seconds == round(sum(row.gpu_seconds for row in stages), 6) == 0.012  # 6 ms each
    assert item["line"]["model_version"] == "draft=1,polish=1"
    assert [stage["stage"] for stage in item["line"]["stages"]] == ["draft", "polish"]


def test_a_failed_flow_line_has_its_failed_stage_row_and_a_cancelled_one_only_its_own():
    made = runner()
    failed = flow_reply("1", "error", "inference_failed").model_copy(update={"request_id": "r"})
    kind, _, item = made._answer("b1", "r", line_entry(made), failed, None)
    assert kind == "errors"
    assert [InferenceLogRow.from_json(row).status for row in item["stage_rows"]] == ["ok", "error"]
    _, status, item = made._answer("b1", "r", line_entry(made), None, "cancelled")
    assert status == "cancelled" and "stage_rows" not in item
    assert InferenceLogRow.from_json(item["row"]).flow == "relay-canary"


def test_a_flow_jobs_result_has_its_stages_as_the_sync_answer_has_them():
    done = flow_reply("1").model_copy(update={"request_id": "j"})
    job = JobState("j", "relay-canary", "draft=1,polish=1", 1, 2, "succeeded", reply=done)
    view = job_view(job, lambda reply: [])
    assert view["result"]["stages"] == [
        {"stage": "draft", "model": "relay-draft", "model_version": "1", "queue_ms": 4.0, "inference_ms": 6.0},
        {"stage": "polish", "model": "relay-polish-canary", "model_version": "1", "queue_ms": 4.0, "inference_ms": 6.0},
    ]
