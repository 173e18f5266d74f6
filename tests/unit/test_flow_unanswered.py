"""A flow nobody answers (the watchdog at its deadline, every delivery attempt's worker dead, the dead-letter
queue): the answer names the flow and the stage it was at, as a worker's would, with the reports of the stages
that ran (so each has its row) and its start their first's (a job's `started_at`); past the deadline between two
worker groups, it says the flow was waiting in the next stage's queue."""

from __future__ import annotations

import time
from types import SimpleNamespace

from contract.flows import plan_stages
from contract.messages import Attr, FlowContext, InferenceReply, InferenceRequest, RequestInstance, StageReport
from contract.stores.inflight import InflightState, KeptRequest
from emulators.stack import local_catalog
from model_worker.flows.stages import FlowStages
from model_worker.held.pool import HeldMessage
from model_worker.serving.watchdog import Watchdog

CATALOG = local_catalog(test_fixtures=True)
DRAFT, POLISH = CATALOG.get("relay-draft"), CATALOG.get("relay-polish")  # two worker groups: relay, rollouts
STARTED_MS = 1_700_000_000_000


def across_message(request_id: str, stage: int = 0, finished: list[StageReport] | None = None) -> InferenceRequest:
    plans = plan_stages(CATALOG.flow("relay-across"), [DRAFT, POLISH], {"seed": 3})
    plan = plans[stage]
    return InferenceRequest(
        request_id=request_id, model=plan.model, model_version=plan.model_version,
        instances=[RequestInstance(prompt="p")], parameters=plan.parameters,
        flow=FlowContext(flow="relay-across", stages=plans, stage=stage, finished=finished or []),
    )  # fmt: skip


def draft_report() -> StageReport:
    return StageReport(stage="draft", index=0, model="relay-draft", model_version="1", worker_id="w-relay",
                       queue_ms=3.0, inference_ms=300.0, worker_started_ms=STARTED_MS, batch_size=1)  # fmt: skip


class Results:
    def __init__(self) -> None:
        self.stored: list[InferenceReply] = []

    def put(self, reply: InferenceReply) -> bool:
        self.stored.append(reply)
        return True


class Inflight:
    """The watchdog's view of Redis: one request past its deadline that nobody holds."""

    def __init__(self, kept: KeptRequest) -> None:
        self.kept, self.forgotten = kept, []

    def lapsed(self, limit: int = 200, grace_ms: int = 0) -> list:
        return []

    def unclaimed(self, now_ms: int) -> list:
        return []

    def overdue(self, now_ms: int) -> list[InflightState]:
        return [InflightState(self.kept.request_id, False, False, self.kept)]

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def watchdog_answer(kept: KeptRequest, reports: list[StageReport]) -> InferenceReply:
    results = Results()
    finisher = SimpleNamespace(publish_reply=lambda reply, attributes: SimpleNamespace(result=lambda timeout: None))
    metrics = SimpleNamespace(watchdog=SimpleNamespace(labels=lambda **_: SimpleNamespace(inc=lambda: None)))
    watchdog = Watchdog(Inflight(kept), results, None, finisher, CATALOG, "w-dog", 6.0, metrics,  # type: ignore[arg-type]
                        flow_reports=lambda request_id: reports)  # fmt: skip
    assert watchdog.sweep() == (0, 1)
    (reply,) = results.stored
    return reply


def kept_request(message: InferenceRequest) -> KeptRequest:
    attributes = {Attr.REQUEST_ID: message.request_id, Attr.MODEL: message.model, Attr.MODEL_VERSION: "1"}
    return KeptRequest(message.request_id, "topic", message.model_dump_json().encode(), attributes,
                       int(time.time() * 1000) - 1, 0)  # fmt: skip


def test_a_flow_past_its_deadline_in_the_handoff_between_groups_says_so_and_keeps_the_stage_that_ran():
    # The API kept the first stage's message; the draft finished and kept its report, then the flow waited in the
    # polish's queue (another worker group) until its deadline.
    reply = watchdog_answer(kept_request(across_message("handoff")), [draft_report()])
    assert (reply.status, reply.model, reply.model_version) == ("expired", "relay-across", "")
    assert reply.error == (
        "stage polish (relay-polish): deadline passed during the handoff from stage draft, which finished, before a "
        "worker of relay-polish took the flow"
    )
    assert [(report.stage, report.status) for report in reply.stages] == [("draft", "ok")]
    assert reply.worker_started_ms == STARTED_MS  # the job's started_at: its draft started


def test_a_flow_nobody_ran_expires_naming_its_first_stage():
    reply = watchdog_answer(kept_request(across_message("never")), [])
    assert reply.error == "stage draft (relay-draft): deadline passed before any worker ran it"
    assert reply.stages == [] and reply.worker_started_ms is None and reply.model == "relay-across"


def test_a_model_request_is_answered_as_before():
    message = across_message("plain").model_copy(update={"flow": None})
    reply = watchdog_answer(kept_request(message), [])
    assert (reply.model, reply.error, reply.stages) == ("relay-draft", "deadline passed before any worker ran it", [])


def test_a_dead_lettered_stage_names_the_flow_and_has_its_report():
    message = across_message("dead", stage=1, finished=[draft_report()])
    held = HeldMessage("dead-letter", "ack", {Attr.REQUEST_ID: "dead"}, message.model_dump_json().encode(), 5, 0.0)
    answered: list[InferenceReply] = []
    finisher = SimpleNamespace(answer=lambda message, reply, store=True: answered.append(reply))
    stages = FlowStages(finisher, None, None, {POLISH.queue: POLISH})  # type: ignore[arg-type]
    failed = InferenceReply(request_id="dead", model="relay-polish", model_version="1", status="error",
                            error_kind="dead_lettered", error="failed after 5 delivery attempts", worker_id="w2")  # fmt: skip
    stages.answer(held, failed)
    (reply,) = answered
    assert (reply.model, reply.error) == (
        "relay-across",
        "stage polish (relay-polish): failed after 5 delivery attempts",
    )
    assert [(report.stage, report.status, report.error_kind) for report in reply.stages] == [
        ("draft", "ok", None),
        ("polish", "error", "dead_lettered"),
    ]
    assert reply.worker_started_ms == STARTED_MS


def test_a_flow_held_in_its_first_stage_is_counted_for_the_later_stages_group_until_it_moves_on():
    """`maas_worker_flows_ahead`: what the later stage's Deployment adds to its backlog (infra/k8s/render.py)."""
    from model_worker.serving.intake import Triage
    from model_worker.serving.metrics import WorkerMetrics

    stages = FlowStages(None, None, None, {DRAFT.queue: DRAFT})  # type: ignore[arg-type]
    items = Triage(None, None, None, None).items
    for request_id, deadline_ms in (("held", int(time.time() * 1000) + 60_000), ("late", int(time.time() * 1000) - 1)):
        message = across_message(request_id)
        held = HeldMessage("sub", f"ack-{request_id}", {}, message.model_dump_json().encode(), 1, time.time())
        stages.intake(DRAFT, held, message, "high", deadline_ms, items)
    assert stages.ahead() == {(POLISH.queue, "high"): 1}  # the one past its deadline is not on its way any more
    metrics = WorkerMetrics()
    metrics.count_flows_ahead(stages.ahead)
    assert b'maas_worker_flows_ahead{priority="high",queue="relay-polish"} 1.0' in metrics.render()
    stages._forget("held")  # noqa: SLF001 - answered: nothing of it is held any more
    assert stages.ahead() == {}


def test_a_flow_job_that_expired_in_the_handoff_has_its_end_and_the_stages_that_ran():
    from api_server.jobs.service import JobState, job_view

    before = int(time.time() * 1000)
    reply = watchdog_answer(kept_request(across_message("handoff-job")), [draft_report()])
    assert reply.answered_ms is not None and reply.answered_ms >= before  # the watchdog's answer says when
    job = JobState("handoff-job", "relay-across", "", created_ms=STARTED_MS - 10, deadline_ms=before - 1,
                   status="expired", reply=reply)  # fmt: skip
    view = job_view(job, predictions=None)
    assert view["started_at"] is not None and view["finished_at"] is not None
    assert job.finished_ms == reply.answered_ms
    assert [(stage["stage"], stage["model"]) for stage in view["error"]["stages"]] == [("draft", "relay-draft")]
    assert "handoff from stage draft" in view["error"]["message"]
    # An expiry answer stored without a time (before the watchdog stamped one) ends at the deadline, not never.
    unstamped = JobState("old", "relay-across", "", STARTED_MS - 10, before - 1, "expired",
                         reply=reply.model_copy(update={"answered_ms": None}))  # fmt: skip
    assert unstamped.finished_ms == before - 1
