"""A flow's stages in the worker without a model (the synthetic runners): progress over all stages, and a failing
stage failing the flow with the stage named."""

from __future__ import annotations

import time
from types import SimpleNamespace

from contract.flows import plan_stages
from contract.messages import FlowContext, InferenceRequest, RequestInstance
from emulators.stack import local_catalog
from model_worker.flows.stages import FlowStages, flow_progress
from model_worker.held.pool import HeldMessage
from model_worker.model.runners import SyntheticRunner
from model_worker.serving.intake import Triage
from tests.unit.test_step_scheduler import Worker

CATALOG = local_catalog(test_fixtures=True)
# The fixtures' `relay` flow on instant synthetic units; the finish configured to fail every call.
DRAFT = CATALOG.get("relay-draft").model_copy(update={"runner": "noop", "call_seconds": None})
FINISH = CATALOG.get("relay-finish").model_copy(update={"runner": "noop", "call_seconds": None, "fails": True})
UNITS = {DRAFT.queue: DRAFT, FINISH.queue: FINISH}


class StepRecording(SyntheticRunner):
    """A synthetic runner keeping the steps its calls reported: how far a call went before it was stopped."""

    def __init__(self, spec, call_seconds: float) -> None:
        super().__init__(spec, call_seconds=call_seconds)
        self.steps: list[tuple[int, int]] = []

    def generate(self, items, params, on_step):
        def recorded(step: int, total: int) -> None:
            self.steps.append((step, total))
            on_step(step, total)

        return super().generate(items, params, recorded)


def relay_message(request_id: str):
    flow = CATALOG.flow("relay")
    plans = plan_stages(flow, [DRAFT, FINISH], {"seed": 3, "num_inference_steps": 4})
    body = InferenceRequest(
        request_id=request_id, model=DRAFT.name, model_version="1", instances=[RequestInstance(prompt="p")],
        parameters=plans[0].parameters, flow=FlowContext(flow="relay", stages=plans),
    )  # fmt: skip
    return body, HeldMessage("sub", f"ack-{request_id}", {}, body.model_dump_json().encode(), 1, time.time())


def test_a_failing_stage_fails_the_flow_naming_the_stage_and_keeps_the_reports_before_it():
    body, message = relay_message("failing")
    with Worker({queue: SyntheticRunner(spec) for queue, spec in UNITS.items()}) as worker:
        stages = FlowStages(worker.outcomes, worker.pool, worker.outcomes, UNITS)
        worker.loop._finisher = stages
        answered = []
        answer = worker.outcomes.answer
        worker.outcomes.answer = lambda message, reply, store=True: answered.append(reply) or answer(message, reply)
        pending = stages.intake(DRAFT, message, body, "normal", None, Triage(None, None, None, None).items)
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    (reply,) = answered
    assert (reply.status, reply.error_kind, reply.model, reply.model_version) == (
        "error",
        "inference_failed",
        "relay",
        "",
    )
    assert reply.error.startswith("stage finish (relay-finish): inference failed: relay-finish version 1 is configured")
    # The failed stage has its report too (its log row; the version that failed it, for a canary's fallback).
    assert [(report.stage, report.index, report.status) for report in reply.stages] == [
        ("draft", 0, "ok"),
        ("finish", 1, "error"),
    ]
    failed = reply.stages[1]
    assert (failed.model, failed.model_version, failed.error_kind) == ("relay-finish", "1", "inference_failed")
    assert reply.worker_started_ms == reply.stages[0].worker_started_ms is not None


def test_progress_counts_every_stage_and_names_the_one_running():
    body, message = relay_message("progress")
    stages = FlowStages(None, None, None, UNITS)
    pending = stages.intake(DRAFT, message, body, "normal", None, Triage(None, None, None, None).items)
    draft, finish = body.flow.stages
    total = draft.steps + finish.steps
    assert flow_progress(pending, 2, draft.steps) == {"step": 2, "total": total, "stage": "draft", "stage_index": 0}
    pending.flow.stage = 1
    assert flow_progress(pending, 5, 10) == {
        "step": draft.steps + round(5 * finish.steps / 10), "total": total, "stage": "finish", "stage_index": 1,
    }  # fmt: skip


def test_a_flow_past_its_deadline_in_stage_2_stops_there_and_says_so():
    body, message = relay_message("late")
    slow = FINISH.model_copy(update={"runner": "sleep", "call_seconds": 20.0, "fails": False})
    units = {DRAFT.queue: DRAFT, slow.queue: slow}
    finish = StepRecording(slow, call_seconds=20.0)
    with Worker({DRAFT.queue: SyntheticRunner(DRAFT), slow.queue: finish}) as worker:
        stages = FlowStages(worker.outcomes, worker.pool, worker.outcomes, units)
        worker.loop._finisher = stages
        answered = []
        answer = worker.outcomes.answer
        worker.outcomes.answer = lambda message, reply, store=True: answered.append(reply) or answer(message, reply)
        deadline_ms = int((time.time() + 3) * 1000)  # the instant draft is long done; the 20 s finish is not
        worker.pool.add(
            stages.intake(DRAFT, message, body, "normal", deadline_ms, Triage(None, None, None, None).items)
        )
        worker.outcomes.wait(1)
    (reply,) = answered
    assert (reply.status, reply.model) == ("expired", "relay")
    assert reply.error == "stage finish (relay-finish): deadline passed while it ran"
    # The stage the deadline passed in ran, partly: it has its report (and so its row), as the draft has.
    assert [(report.stage, report.status) for report in reply.stages] == [("draft", "ok"), ("finish", "expired")]
    assert reply.worker_started_ms == reply.stages[0].worker_started_ms is not None
    # Stopped at a step of stage 2, not at its end: by the steps it ran, not by how long that took.
    (step, total) = finish.steps[-1]
    assert step < total, f"stage 2 ran to step {step} of {total}: its call was not stopped"


def test_the_flow_stages_pass_a_failed_runs_cause_to_the_finisher():
    """The device loop counts a handed-back failure through whatever finisher it holds: the flow stages' too."""
    noted: list[tuple[str, str]] = []
    finisher = SimpleNamespace(note_failure=lambda request_id, cause: noted.append((request_id, cause)) or 2)
    stages = FlowStages(finisher, None, None, UNITS)
    assert stages.note_failure("r1", "RuntimeError: device lost") == 2
    assert noted == [("r1", "RuntimeError: device lost")]
