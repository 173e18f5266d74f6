"""A flow's stages as the rollback guard sees them: each stage that ran is a call to its model's version.

A flow's stage runs on the unit the split chose for its model (api_server/flows/serving.py), so a canary serving
a stage must be judged by what it did there exactly as by a direct call (api_server/versions/rollouts.py): its
failures, its successes, its latency. Each stage's observation is keyed `<flow request id>:<stage>` and timed
by the stage's own queue and inference time (the flow's other stages are not that version's doing); a stage
ended by a cancel or by its input's refusal says nothing about its version and is left out.
"""

from __future__ import annotations

from api_server.flows.rows import stage_row_id
from api_server.versions.rollouts import RolloutObservations
from contract.messages import InferenceReply, StageReport
from contract.outcomes import Outcome

NOT_THE_VERSIONS_DOING = frozenset({Outcome.CANCELLED, Outcome.INPUT_REFUSED})


def observe_stages(observations: RolloutObservations, flow_request_id: str, reply: InferenceReply) -> None:
    """Every stage of a flow's reply that its version answered (well or not), as the guard's observations."""
    for report in reply.stages:
        if Outcome.for_reply(report.status, report.error_kind) in NOT_THE_VERSIONS_DOING:
            continue
        total_ms = report.queue_ms + report.inference_ms
        observe_stage(observations, flow_request_id, report, total_ms, report.finished)


def observe_stage(
    observations: RolloutObservations, flow_request_id: str, report: StageReport, total_ms: float, ok: bool
) -> None:
    """One stage's call to its version (versions without a rollback guard are skipped by `observe`)."""
    observations.observe(report.model, report.model_version, stage_row_id(flow_request_id, report.stage), total_ms, ok)
