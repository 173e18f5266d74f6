"""A flow's stage on a canary (tests/models.fixtures.yaml `relay-canary`: its polish on `relay-polish-canary`, whose
version 2 fails every request): the stage falls back to the stable version and feeds the rollback guard exactly
as a direct call to that model does, for a sync call and for a job."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

from api_server.core.auth import Caller
from api_server.flows.serving import FlowService
from api_server.inference_log.job_rows import JobLogFinisher
from api_server.inference_log.records import InferenceCall, RequestRecords
from api_server.inference_log.writer import InferenceLogRow
from api_server.jobs.service import EndedJob, FallbackRequest
from api_server.predict.inference import InferenceService
from api_server.predict.serving import Mode
from contract.messages import InferenceReply, StageReport
from contract.outcomes import Outcome
from tests.unit.test_model_versions import (
    CATALOG,
    FallingBackJobs,
    Observed,
    Publisher,
    Rows,
    ScriptedInference,
    serving_with,
)

CALLER = Caller("k", "d")
BODY = {"instances": [{"prompt": "p"}], "parameters": {"seed": 1, "width": 64, "height": 64}}


def flow_call(polish_version: str = "2"):
    """A call to relay-canary whose polish the split sent to `polish_version`, its body validated and planned."""
    service = FlowService(CATALOG, lambda model, _id, _caller: CATALOG.version(model, polish_version)
                          if model == "relay-polish-canary" else CATALOG.get(model))  # fmt: skip
    call = service.call(CATALOG.flow("relay-canary"), "r", CALLER)
    inference = InferenceService(None, None, 900)  # type: ignore[arg-type]
    return inference, inference.prepare(call.spec, BODY, "r", CALLER, flow=call)


def report(stage: str, index: int, model: str, version: str, status: str = "ok", kind: str | None = None):
    return StageReport(stage=stage, index=index, model=model, model_version=version, queue_ms=4.0, inference_ms=6.0,
                       worker_started_ms=1_700_000_000_000, batch_size=1, status=status, error_kind=kind)  # fmt: skip


def flow_reply(polish_version: str, status: str = "ok", kind: str | None = None) -> InferenceReply:
    stages = [report("draft", 0, "relay-draft", "1"), report("polish", 1, "relay-polish-canary", polish_version,
                                                             status, kind)]  # fmt: skip
    error = None if status == "ok" else "stage polish (relay-polish-canary): inference failed: configured to fail"
    return InferenceReply(request_id="r", model="relay-canary", model_version="", status=status, error=error,
                          error_kind=kind, stages=stages)  # fmt: skip


def test_a_stage_its_canary_fails_is_asked_again_with_that_stage_on_the_stable_version():
    _, prepared = flow_call("2")
    assert prepared.spec.version == "draft=1,polish=2"
    inference = ScriptedInference(flow_reply("2", "error", "inference_failed"), flow_reply("1"))
    answer = serving_with(inference)._run_sync(prepared)
    assert answer.outcome is Outcome.OK and answer.record.status == 200
    body = json.loads(answer.record.body)
    assert (body["model_version"], body["request_id"]) == ("draft=1,polish=1", "r")
    (first, second) = inference.runs
    assert first == ("r", "draft=1,polish=2", None) and second[:2] == ("r-fallback", "draft=1,polish=1")
    fallback = answer.fallback
    assert (fallback.failed_version, fallback.answered_by.version) == ("draft=1,polish=2", "draft=1,polish=1")
    assert (fallback.stage.stage, fallback.stage.model_version) == ("polish", "2")


def test_a_stage_already_on_its_stable_version_or_refusing_the_input_is_not_asked_again():
    _, stable = flow_call("1")
    inference = ScriptedInference(flow_reply("1", "error", "inference_failed"))
    answer = serving_with(inference)._run_sync(stable)
    assert answer.record.status == 500 and answer.fallback is None and len(inference.runs) == 1
    _, canary = flow_call("2")
    inference = ScriptedInference(flow_reply("2", "error", "bad_input"))
    answer = serving_with(inference)._run_sync(canary)
    assert answer.outcome is Outcome.INPUT_REFUSED and answer.fallback is None and len(inference.runs) == 1


def test_the_rollback_guard_sees_the_canarys_failure_and_the_stable_versions_answer_per_stage():
    _, prepared = flow_call("2")
    answer = serving_with(ScriptedInference(flow_reply("2", "error", "inference_failed"), flow_reply("1")))._run_sync(
        prepared
    )
    observed = Observed()
    records = RequestRecords(None, None, None, "i", "per-request", observations=observed)  # type: ignore[arg-type]
    call = InferenceCall(InferenceLogRow("r", datetime.now(UTC), "relay-canary", "ok", 200), Mode.SYNC)
    call.spec, call.answer, call.flow = prepared.spec, answer, prepared.flow
    records._observe(call, answer.outcome, 10.0)
    # As a direct call's fallback: the canary's failure, then the stable version's answer (and the draft's).
    assert observed.calls == [
        ("relay-polish-canary", "2", "r:polish", False),
        ("relay-draft", "1", "r:draft", True),
        ("relay-polish-canary", "1", "r:polish", True),
    ]


def flow_job(status: str, polish_version: str, fallback: FallbackRequest | None = None, **ended) -> EndedJob:
    created = datetime.now(UTC) - timedelta(seconds=3)
    row = InferenceLogRow("j", created, "relay-canary", "accepted", 202, model_version="draft=1,polish=2",
                          endpoint="job", flow="relay-canary")  # fmt: skip
    reply = flow_reply(polish_version, status, None if status == "ok" else "inference_failed")
    reply = reply.model_copy(update={"request_id": "j", "answered_ms": int(time.time() * 1000)})
    return EndedJob("j", row.to_json(), reply, True, 10**13, fallback, **ended)


def test_a_flow_job_its_canary_stage_fails_is_sent_once_with_that_stage_on_the_stable_version():
    inference, prepared = flow_call("2")
    message = inference.message(prepared)
    fallback = serving_with(ScriptedInference())._job_fallback(prepared, message)
    planned = json.loads(fallback.request_json)
    assert planned["request_id"] == "r-fallback"
    assert [stage["model_version"] for stage in planned["flow"]["stages"]] == ["1", "1"]
    jobs, rows, observed, publisher = (
        FallingBackJobs([flow_job("error", "2", fallback)]),
        Rows(),
        Observed(),
        Publisher(),
    )
    finisher = JobLogFinisher(jobs, rows, observations=observed, catalog=CATALOG, inference=publisher)
    assert finisher.finish_ended() == 0 and rows.rows == []  # not ended: the stable version is asked
    assert publisher.published == [("r-fallback", "relay-draft", 10**13, "normal")]  # the flow's first stage's queue
    assert jobs.fallen == [("j", "draft=1,polish=2", "draft=1,polish=1")]
    assert observed.calls == [("relay-polish-canary", "2", "j:polish", False)]
    # Its stable attempt ended: the flow's row (the stable run's version, naming the failed one) and its stages'.
    jobs.ended, jobs.claimed = [flow_job("ok", "1", fallback_from="draft=1,polish=2", fallback_error="boom")], set()
    assert finisher.finish_ended() == 1
    own, draft, polish = rows.rows
    assert (own.model_version, own.status, own.fallback_from) == ("draft=1,polish=1", "ok", "draft=1,polish=2")
    assert (polish.model_version, polish.status, polish.request_id) == ("1", "ok", "j:polish")
    assert observed.calls[1:] == [("relay-draft", "1", "j:draft", True), ("relay-polish-canary", "1", "j:polish", True)]


def test_a_flow_job_failed_by_a_stage_on_its_stable_version_ends_with_that_answer():
    inference, prepared = flow_call("2")
    fallback = serving_with(ScriptedInference())._job_fallback(prepared, inference.message(prepared))
    jobs, rows, publisher = FallingBackJobs([flow_job("error", "1", fallback)]), Rows(), Publisher()
    finisher = JobLogFinisher(jobs, rows, observations=Observed(), catalog=CATALOG, inference=publisher)
    assert finisher.finish_ended() == 1 and jobs.dropped == ["j"] and publisher.published == []
    assert [row.status for row in rows.rows] == ["error", "ok", "error"]
