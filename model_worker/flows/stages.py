"""Flows in the worker: a flow's request runs stage after stage, each stage an ordinary request to the pool.

The API publishes a flow's request (contract/flows.py, `InferenceRequest.flow`) to its first stage's unit.
Intake turns it into that stage's PendingRequest; the pool, the running set and the step scheduler run it as
any other (it shares denoising steps with single calls). `FlowStages` sits between the device loop and the
finisher: when a stage that is not the last finishes, its output becomes the next stage's input, resized as
the flow says. If this process serves the next stage's unit, the output stays where it is (latents on the
device) and the next stage goes to the pool with the same message, lease and request id; otherwise it is
published to that unit's queue with the flow's context (the output inline when small, else a claim check in
the payload bucket), the flow's deadline, priority and reply address, and this worker lets the request go.
Only the last stage answers, with every stage's report. Each finished stage's output and report are kept
(`flow_state.FlowCheckpoints`) until the flow ends, so a redelivered flow resumes after its last finished
stage instead of starting again. Every answer for a flow (an error, a cancel, an expiry) names the flow and
the stage it ended in.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from google.cloud import pubsub_v1

from contract import naming
from contract.messages import (
    Attr,
    FlowContext,
    FlowStagePlan,
    InferenceReply,
    InferenceRequest,
    Payload,
    StageReport,
)
from contract.model_spec import ModelSpec
from contract.payloads import PayloadError
from model_worker.flows.state import FlowCheckpoints, Intermediate, stage_output
from model_worker.held.pool import HeldMessage, PendingRequest, RequestPool
from model_worker.model.runners import GenerationItem

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_SECONDS = 30
# How the device loop says a request it let go never ran (model_worker/serving/device.py): no stage report then.
NOT_STARTED = "before it started"
# Builds a request's GenerationItems (model_worker.serving.intake.Triage.items): inputs, one per instance, for a later
# stage (the previous stage's latents or images), None for the first (its instances' own images, if any).
ItemsOf = Callable[[ModelSpec, InferenceRequest, list | None], list[GenerationItem]]


@dataclass
class FlowRun:
    """A flow's request while one of its stages is held by this worker."""

    request: InferenceRequest  # the flow's message as published (its context: the stage the message asks for)
    stage: int  # the stage running now
    reports: list[StageReport] = field(default_factory=list)  # the stages finished before it, in order
    items_of: ItemsOf | None = None
    priority: str = "normal"
    deadline_ms: int | None = None

    @property
    def context(self) -> FlowContext:
        assert self.request.flow is not None
        return self.request.flow

    @property
    def plans(self) -> list[FlowStagePlan]:
        return self.context.stages

    @property
    def plan(self) -> FlowStagePlan:
        return self.plans[self.stage]

    @property
    def last(self) -> bool:
        return self.stage == len(self.plans) - 1

    def stage_request(self, index: int) -> InferenceRequest:
        """The message body of stage `index`: that stage's unit and parameters, the flow's context at it."""
        plan = self.plans[index]
        context = self.context.model_copy(update={"stage": index, "finished": list(self.reports)})
        return self.request.model_copy(update={
            "model": plan.model, "model_version": plan.model_version, "parameters": plan.parameters, "flow": context,
        })  # fmt: skip


def flow_progress(pending: PendingRequest, step: int, total: int) -> dict:
    """A request's progress fields; a flow's stage counts every stage's steps and names the stage (its own step
    count mapped onto the steps its plan gives it)."""
    run: FlowRun | None = getattr(pending, "flow", None)
    if run is None:
        return {"step": step, "total": total}
    done = sum(plan.steps for plan in run.plans[: run.stage])
    own = run.plan.steps
    scaled = min(own, round(step * own / total)) if total else 0
    return {
        "step": done + scaled, "total": sum(plan.steps for plan in run.plans),
        "stage": run.plan.name, "stage_index": run.stage,
    }  # fmt: skip


def stage_error(plan: FlowStagePlan, error: str | None) -> str:
    return f"stage {plan.name} ({plan.model}): {error or 'failed'}"


def ended_stage_report(plan: FlowStagePlan, index: int, reply: InferenceReply) -> StageReport:
    """The report of the stage a flow ended in (failed, expired or cancelled while held here, or dead-lettered):
    its unit, the worker's fields of the answer, and how it ended."""
    return StageReport(
        stage=plan.name, index=index, model=plan.model, model_version=plan.model_version, steps=plan.steps,
        worker_id=reply.worker_id, accelerator=reply.accelerator, attempt=reply.attempt,
        queue_ms=reply.queue_ms, inference_ms=reply.inference_ms, worker_started_ms=reply.worker_started_ms,
        worker_finished_ms=reply.worker_finished_ms or int(time.time() * 1000), batch_id=reply.batch_id,
        batch_size=reply.batch_size, status=reply.status, error_kind=reply.error_kind,
    )  # fmt: skip


def unanswered_flow_reply(data: bytes, reply: InferenceReply, kept: list[StageReport]) -> InferenceReply:
    """`reply` (the watchdog's expiry or dead letter of a request nobody holds) for a flow's message (`data`):
    named for the flow and the stage it was at, with the reports of the stages that finished (the message's and
    those `kept` in Redis), its start their first's. Past the deadline between two worker groups, the error says
    so: the flow was waiting in the next stage's queue, not running. Anything else is returned as it is."""
    try:
        request = InferenceRequest.model_validate_json(data)
    except ValueError:
        return reply
    if request.flow is None:
        return reply
    plans = request.flow.stages
    known = {report.index: report for report in request.flow.finished} | {report.index: report for report in kept}
    at = min(request.flow.stage, len(plans) - 1)
    while at in known and at + 1 < len(plans):
        at += 1
    reports = [known[index] for index in range(at) if index in known]
    plan, error = plans[at], stage_error(plans[at], reply.error)
    if reply.error_kind == "dead_lettered":  # every worker that held this stage stopped: it ran, and has its row
        reports.append(ended_stage_report(plan, at, reply))
    if reply.status == "expired" and at > 0 and plans[at - 1].queue != plan.queue:
        error = (f"stage {plan.name} ({plan.model}): deadline passed during the handoff from stage "
                 f"{plans[at - 1].name}, which finished, before a worker of {plan.model} took the flow")  # fmt: skip
    return reply.model_copy(update={
        "model": request.flow.flow, "model_version": "", "error": error, "stages": reports,
        "worker_started_ms": reports[0].worker_started_ms if reports else reply.worker_started_ms,
    })  # fmt: skip


class FlowStages:
    """The finisher as the device loop sees it, with flows' stages routed on; anything else goes straight through.

    `finish`, `answer`, `note_failure` and `redis_trouble` are the finisher's interface (model_worker/serving/finisher.py)."""

    def __init__(
        self,
        finisher,
        pool: RequestPool,
        leases,
        served: dict[str, ModelSpec],
        checkpoints: FlowCheckpoints | None = None,
        publisher: pubsub_v1.PublisherClient | None = None,
        project_id: str = "",
        inline_limit: int = 256 * 1024,
        results=None,
    ) -> None:
        """`served`: this worker's units by queue; `checkpoints` None keeps nothing (no resume: the unit tests'
        device loop); `publisher` None serves only flows whose every stage is served here."""
        self._finisher = finisher
        self._pool = pool
        self._leases = leases
        self._served = served
        self._checkpoints = checkpoints
        self._publisher = publisher
        self._project_id = project_id
        self._inline_limit = inline_limit
        self._results = results
        # Checkpoints, forwards and clean-ups, off the device thread (the next stage in this process never waits for
        # them), one at a time in order: a flow's clean-up never overtakes the keeping of its last stage.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flows")
        # The stage each flow held here is at, by request id: an answer for its message names that stage.
        self._runs: dict[str, FlowRun] = {}
        self._lock = threading.Lock()

    @property
    def redis_trouble(self):
        return self._finisher.redis_trouble

    def note_failure(self, request_id: str, cause: str) -> int:
        """A failed run handed back for a retry, counted with its cause (the finisher's)."""
        return self._finisher.note_failure(request_id, cause)

    # --- intake --------------------------------------------------------------------------------------------

    def intake(
        self,
        spec: ModelSpec,
        message: HeldMessage,
        request: InferenceRequest,
        priority: str,
        deadline_ms: int | None,
        items_of: ItemsOf,
    ) -> PendingRequest | None:
        """The PendingRequest of the stage a flow's message asks for, or of the stage after the last one finished
        (a redelivery after a crash); None when it went on to another group. Raises PayloadError for a message
        whose flow cannot run here."""
        context = request.flow
        assert context is not None
        if not 0 <= context.stage < len(context.stages):
            raise PayloadError(f"flow {context.flow}: stage {context.stage} of {len(context.stages)} stages")
        if context.stages[context.stage].queue != spec.queue:
            raise PayloadError(
                f"flow {context.flow}: stage {context.stage} is for {context.stages[context.stage].queue}, "
                f"not {spec.queue}"
            )
        run = FlowRun(request, context.stage, list(context.finished), items_of)
        intermediate = self._resume(run)
        if intermediate is None and context.intermediate is not None:
            intermediate = Intermediate.from_bytes(self._unpack(context.intermediate))
        if run.plan.queue not in self._served:  # resumed past the stages served here
            self._background.submit(self._forward, message, run, intermediate, priority, deadline_ms)
            return None
        return self._stage(message, run, intermediate, priority, deadline_ms)

    def _resume(self, run: FlowRun) -> Intermediate | None:
        """Moves `run` past the stages already finished (their reports kept in Redis); their last output."""
        if self._checkpoints is None:
            return None
        try:
            kept = {report.index: report for report in self._checkpoints.reports(run.request.request_id)}
        except Exception as exc:  # noqa: BLE001 - Redis down: run the stage the message asks for
            self.redis_trouble.warn("flow stages", exc)
            return None
        known = {report.index: report for report in run.reports} | kept
        resumed = run.stage
        while resumed in known and resumed + 1 < len(run.plans):
            resumed += 1
        if resumed == run.stage:
            return None
        try:
            data = self._checkpoints.load(run.request.request_id, resumed - 1)
        except Exception as exc:  # noqa: BLE001 - the output is gone: run from the stage asked for
            log.warning("flow %s: stage %d's output is missing (%s); running stage %d again",
                        run.request.request_id, resumed - 1, exc, run.stage)  # fmt: skip
            return None
        run.reports = [known[index] for index in range(resumed)]
        run.stage = resumed
        log.info("flow %s resumes at stage %s after %d finished", run.request.request_id, run.plan.name, resumed)
        return Intermediate.from_bytes(data)

    def _unpack(self, payload: Payload) -> bytes:
        if payload.b64 is not None:
            return base64.b64decode(payload.b64)
        if payload.uri is None or self._checkpoints is None:
            raise PayloadError("a flow's intermediate has neither b64 nor a readable uri")
        return self._checkpoints.read_uri(payload.uri)

    def _stage(
        self,
        message: HeldMessage,
        run: FlowRun,
        intermediate: Intermediate | None,
        priority: str,
        deadline_ms: int | None,
    ) -> PendingRequest:
        spec = self._served[run.plan.queue]
        body = run.stage_request(run.stage)
        inputs = intermediate.inputs() if intermediate is not None else None
        assert run.items_of is not None
        items = run.items_of(spec, body, inputs)
        handoff = run.plan.handoff
        following = run.plans[run.stage + 1] if not run.last else None
        items = [
            replace(
                item,
                denoising_start=handoff.denoising_start if handoff else None,
                denoising_end=handoff.denoising_end if handoff else None,
                latent_output=run.plan.output == "latent" and following is not None,
            )
            for item in items
        ]
        run.priority, run.deadline_ms = priority, deadline_ms
        with self._lock:
            self._runs[run.request.request_id] = run
        return PendingRequest(message, spec, body, items, priority, deadline_ms, flow=run)

    # --- the device's finisher -----------------------------------------------------------------------------

    def finish(self, pending: PendingRequest, outputs: list, fields: dict):
        run: FlowRun | None = pending.flow
        if run is None:
            return self._finisher.finish(pending, outputs, fields)
        report = StageReport(
            stage=run.plan.name, index=run.stage, steps=run.plan.steps,
            **{key: fields[key] for key in StageReport.model_fields if key in fields and key not in ("stage", "steps")},
        )  # fmt: skip
        if run.last:
            reports = [*run.reports, report]
            future = self._finisher.finish(pending, outputs, self._final_fields(run, fields, reports))
            if future is not None:
                future.add_done_callback(lambda _: self._background.submit(self._forget, pending.request_id))
            return future
        following = run.plans[run.stage + 1]
        intermediate = stage_output(outputs, run.plan, following)
        run = replace(run, reports=[*run.reports, report], stage=run.stage + 1)
        if following.queue in self._served:
            # The next stage joins the pool now (its intermediate stays on the device); its checkpoint is kept
            # meanwhile, off the device thread.
            following_stage = self._stage(pending.message, run, intermediate, pending.priority, pending.deadline_ms)
            following_stage.cancelled = pending.cancelled
            self._pool.add(following_stage)
            self._background.submit(self._keep, run, report, intermediate, pending.deadline_ms)
            return None
        return self._background.submit(
            self._forward, pending.message, run, intermediate, pending.priority, pending.deadline_ms, report
        )

    def _final_fields(self, run: FlowRun, fields: dict, reports: list[StageReport]) -> dict:
        """The flow's own reply: the flow's name (its row bills the caller), every stage's report, the first
        stage's queue time and start, the stages' inference time together."""
        first = reports[0]
        return {
            **fields,
            "model": run.context.flow,
            "model_version": "",
            "queue_ms": first.queue_ms,
            "inference_ms": sum(report.inference_ms for report in reports),
            "worker_started_ms": first.worker_started_ms,
            "stages": reports,
        }

    def _keep(self, run: FlowRun, report: StageReport, intermediate: Intermediate, deadline_ms: int | None) -> str:
        """Keeps a finished stage (output, then report) for a resume; returns its output's URI ("" if not kept)."""
        if self._checkpoints is None:
            return ""
        started = time.perf_counter()
        try:
            data = intermediate.to_bytes()
            uri = self._checkpoints.save(run.request.request_id, report, data, deadline_ms)
        except Exception as exc:  # noqa: BLE001 - not kept: a crash reruns this stage, nothing worse
            log.warning("flow %s: stage %s not kept (%s)", run.request.request_id, report.stage, exc)
            return ""
        log.info("flow %s: stage %s kept (%d bytes) in %.0f ms", run.request.request_id, report.stage, len(data),
                 (time.perf_counter() - started) * 1000)  # fmt: skip
        return uri

    def _forward(
        self,
        message: HeldMessage,
        run: FlowRun,
        intermediate: Intermediate | None,
        priority: str,
        deadline_ms: int | None,
        report: StageReport | None = None,
    ) -> None:
        """Publishes the flow's next stage to its unit's queue (another worker group), then lets it go here."""
        request_id = run.request.request_id
        with self._lock:
            self._runs.pop(request_id, None)
        try:
            data = intermediate.to_bytes() if intermediate is not None else b""
            if report is not None and intermediate is not None:
                uri = self._keep(run, report, intermediate, deadline_ms)
            else:  # resumed here past this group's stages: the kept output of the stage before
                uri = self._checkpoints.uri(request_id, run.stage - 1) if self._checkpoints and run.stage else ""
            if not data:
                payload = None
            elif len(data) <= self._inline_limit or not uri:
                payload = Payload(b64=base64.b64encode(data).decode("ascii"))
            else:
                payload = Payload(uri=uri)
            body = run.stage_request(run.stage)
            assert body.flow is not None
            body = body.model_copy(update={"flow": body.flow.model_copy(update={"intermediate": payload})})
            if self._publisher is None:
                raise RuntimeError(f"no publisher for {run.plan.queue}")
            attributes = {
                key: value for key, value in message.attributes.items() if key not in (Attr.REDISPATCHES,)
            } | {Attr.MODEL: run.plan.model, Attr.MODEL_VERSION: run.plan.model_version, Attr.REQUEST_ID: request_id}
            topic = self._publisher.topic_path(self._project_id, naming.request_topic(run.plan.queue, priority))
            # The next worker takes the request's holder lease: this one lets it go first, or that one would
            # see it held and drop its copy.
            self._leases.hand_over(message)
            self._publisher.publish(topic, body.model_dump_json().encode(), **attributes).result(
                timeout=PUBLISH_TIMEOUT_SECONDS
            )
        except Exception:  # noqa: BLE001 - handed back: its redelivery resumes from the kept stage
            log.exception("flow %s: could not forward stage %s; handing it back", request_id, run.plan.name)
            self._leases.release(message)
            return
        log.info("flow %s: stage %s forwarded to %s", request_id, run.plan.name, run.plan.queue)
        self._leases.ack(message, answered=False)

    def answer(self, message: HeldMessage, reply: InferenceReply, store: bool = True):
        """An answer for a request that did not finish (or a stored reply again); a flow's names the flow and the
        stage it ended in, and carries the reports of the stages that finished, then the report of the stage it
        ended in when that stage was taken to run here (its log row; a canary's failure is known by it)."""
        if not store or reply.status == "ok" or reply.stages:
            return self._finisher.answer(message, reply, store)
        run = self._run_of(message)
        if run is None:
            return self._finisher.answer(message, reply, store)
        reports = list(run.reports)
        ran = self._held_run(run.request.request_id) is run and not (reply.error or "").endswith(NOT_STARTED)
        if ran or reply.error_kind == "dead_lettered":  # held here, or tried by every delivery attempt
            reports.append(ended_stage_report(run.plan, run.stage, reply))
        reply = reply.model_copy(update={
            "model": run.context.flow, "model_version": "", "error": stage_error(run.plan, reply.error),
            "stages": reports,
            # The flow started when its first stage did (a job's `started_at`), whichever stage it ended in.
            "worker_started_ms": reports[0].worker_started_ms if reports else reply.worker_started_ms,
        })  # fmt: skip
        future = self._finisher.answer(message, reply, store)
        if future is not None:
            future.add_done_callback(lambda _: self._background.submit(self._forget, reply.request_id))
        return future

    def _run_of(self, message: HeldMessage) -> FlowRun | None:
        """The flow (and stage) a message's request is at: the pool's stage request if one is held, else the
        message's own."""
        try:
            request = InferenceRequest.model_validate_json(message.data)
        except ValueError:
            return None
        if request.flow is None:
            return None
        held = self._held_run(request.request_id)
        return held or FlowRun(
            request, min(request.flow.stage, len(request.flow.stages) - 1), list(request.flow.finished)
        )

    def ahead(self) -> dict[tuple[str, str], int]:
        """The flows held here (in a stage, before their deadline) by (queue, priority) of each later stage another
        worker group serves: what will reach that group's queue, counted before it does (its autoscaler adds it to
        the queue's backlog, so a later stage's group is not scaled one stage late)."""
        now_ms = time.time() * 1000
        with self._lock:
            runs = list(self._runs.values())
        counts: dict[tuple[str, str], int] = {}
        for run in runs:
            if run.deadline_ms is not None and run.deadline_ms < now_ms:
                continue
            for queue in {plan.queue for plan in run.plans[run.stage + 1 :] if plan.queue not in self._served}:
                counts[(queue, run.priority)] = counts.get((queue, run.priority), 0) + 1
        return counts

    def _held_run(self, request_id: str) -> FlowRun | None:
        with self._lock:
            return self._runs.get(request_id)

    def _forget(self, request_id: str) -> None:
        """The flow was answered: nothing of it is kept any more."""
        with self._lock:
            self._runs.pop(request_id, None)
        if self._checkpoints is None:
            return
        try:
            self._checkpoints.forget(request_id)
        except Exception as exc:  # noqa: BLE001 - they expire with the deadline anyway
            log.warning("flow %s: its kept stages were not removed (%s)", request_id, exc)

    def close(self) -> None:
        self._background.shutdown(wait=True)
