"""A flow's inference log rows: its own row (what the caller is billed for) and one row per stage that ran.

The worker's final reply to a flow lists every stage that ran, once each (`InferenceReply.stages`), the stage
it ended in included when it did not finish (a failure, a deadline or a cancel inside it); each becomes a row of
its own, keyed `<flow request id>:<stage>` (so the log's one-row-per-request-id view keeps each once), linked to the
flow's row by `flow_request_id`, with the stage's unit (its task and family from the catalog: an edit stage's row
says `edit`, an inpaint stage's `inpaint` with the request's `mask_fraction`), timings, batch and GPU-seconds. The
flow's row sums its stages' GPU-seconds; stage rows are never billed.
"""

from __future__ import annotations

from dataclasses import replace

from api_server.inference_log.writer import InferenceLogRow, from_epoch_ms
from contract.catalog import ModelCatalog
from contract.messages import InferenceReply, StageReport
from contract.outcomes import Outcome

# A stage row's endpoint: its model's sync and job latencies (the caller's waits) leave it out.
STAGE_ENDPOINT = "stage"


def stage_row_id(flow_request_id: str, stage: str) -> str:
    return f"{flow_request_id}:{stage}"


def rows_of(row: InferenceLogRow, reply: InferenceReply | None, catalog: ModelCatalog | None) -> list[InferenceLogRow]:
    """`row` and, when `reply` is a flow's final reply, a row per stage that ran (the flow's row then carries
    the sum of their GPU-seconds); `catalog` gives each stage's task and family (without one they are left NULL)."""
    if reply is None or not reply.stages:
        return [row]
    stages = [_stage_row(row, reply, report, catalog) for report in _once_each(reply.stages)]
    row.flow = row.flow or row.model
    row.gpu_seconds = round(sum(stage.gpu_seconds or 0.0 for stage in stages), 6)
    return [row, *stages]


def _once_each(reports: list[StageReport]) -> list[StageReport]:
    """One report per stage index (a redelivered stage's report is the last one recorded)."""
    by_index = {report.index: report for report in reports}
    return [by_index[index] for index in sorted(by_index)]


def _stage_row(
    flow: InferenceLogRow, reply: InferenceReply, report: StageReport, catalog: ModelCatalog | None
) -> InferenceLogRow:
    failed = not report.finished
    # The stage's unit as the catalog has it (a canary's version, else the model's stable one).
    unit = (catalog.version(report.model, report.model_version) or catalog.get(report.model)) if catalog else None
    outcome = Outcome.for_reply(report.status, report.error_kind)
    images = flow.num_images or 1
    gpu_seconds = round(report.inference_ms / 1000 * images / report.batch_size, 6) if report.batch_size else None
    # The stage's model's step cache, when the worker counted its skipped steps (it ran with it; the request may have
    # turned it off).
    cached = unit is not None and unit.step_cache is not None and report.steps_skipped is not None
    return replace(
        flow,
        request_id=stage_row_id(flow.request_id, report.stage),
        model=report.model,
        model_version=report.model_version,
        task=unit.task if unit is not None else None,
        model_family=unit.family.name if unit is not None and unit.family else None,
        endpoint=STAGE_ENDPOINT,
        status=outcome.spec.log_status,
        error=(reply.error or report.status)[:1024] if failed else None,
        error_kind=(report.error_kind or outcome.spec.error_kind) if failed else None,
        cache_hit=False,
        coalesced=False,
        idempotent_replay=False,
        num_inference_steps=report.steps or None,
        step_cache=unit.step_cache.kind if cached else None,
        # The request's mask is an inpaint stage's; the other stages repaint nothing.
        mask_fraction=flow.mask_fraction if unit is not None and unit.takes_mask else None,
        steps_skipped=report.steps_skipped,
        adapters=None,  # the flow's row lists the request's adapters and control models
        controls=None,
        input_bytes=None,
        output_bytes=None,
        worker_started_at=from_epoch_ms(report.worker_started_ms),
        worker_finished_at=from_epoch_ms(report.worker_finished_ms),
        total_ms=round(report.queue_ms + report.inference_ms, 2),
        queue_ms=report.queue_ms,
        inference_ms=report.inference_ms,
        batch_id=report.batch_id,
        batch_size=report.batch_size or None,
        worker_id=report.worker_id or None,
        accelerator=report.accelerator,
        attempt=report.attempt,
        fallback_from=None,
        fallback_error=None,
        flow=flow.flow or flow.model,
        stage=report.stage,
        stage_index=report.index,
        flow_request_id=flow.request_id,
        gpu_seconds=gpu_seconds,
    )
