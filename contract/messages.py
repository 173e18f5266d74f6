"""Pub/Sub message bodies and attributes exchanged between the API server and the workers."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.generation import GenerationParameters
from contract.naming import Priority

__all__ = ["GenerationParameters"]  # declared with the parameters' roles in contract/generation.py

SCHEMA_VERSION = "1"


class Attr:
    """Attribute names on every request and reply message."""

    REQUEST_ID = "request_id"
    MODEL = "model"
    MODEL_VERSION = "model_version"
    REPLY_TO = "reply_to"
    DEADLINE_MS = "deadline_ms"
    PRIORITY = "priority"
    SCHEMA_VERSION = "schema_version"
    # Set on replies in per-instance reply mode so the instance subscription can filter on it.
    INSTANCE = "api_instance"
    # The client's trace (W3C format) on a request, when it sent one: the worker binds it to its log lines.
    TRACEPARENT = "traceparent"
    # Set on a request the watchdog published again after its holder died: how many times it did so.
    REDISPATCHES = "redispatches"


class Payload(BaseModel):
    """Bytes carried inline (base64) or, above the inline limit, as a GCS object URI."""

    model_config = ConfigDict(extra="forbid")
    b64: str | None = None
    uri: str | None = None


class RequestInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    image: Payload | None = None
    # An inpaint request's mask (a PNG: white repaints, black keeps), the image's size; left out of other messages.
    mask: Payload | None = Field(default=None, exclude_if=lambda mask: mask is None)


# How a flow's stage passes its output on (contract/flows.py): a latent the next stage starts from, or images.
StageOutput = Literal["image", "latent"]


class Resize(BaseModel):
    """A resize between two stages of a flow (the hires fix): of the latent, or of the decoded image."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scale: Literal[1.5, 2]
    space: Literal["latent", "pixel"]


class Handoff(BaseModel):
    """diffusers' base + refiner handoff: the base stops at `denoising_end` of its schedule with a latent that
    still holds noise, and the next stage starts at `denoising_start` (the same fraction) from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    denoising_end: float | None = Field(default=None, gt=0, lt=1)
    denoising_start: float | None = Field(default=None, gt=0, lt=1)


class FlowStagePlan(BaseModel):
    """One stage of a flow's request, resolved by the API (contract/flows.py `plan_stages`): the unit chosen
    (version or canary), its fully merged parameters, and how its output goes on."""

    model_config = ConfigDict(extra="forbid")
    name: str
    model: str
    model_version: str
    # The unit's queue (contract/catalog.py `ModelSpec.queue`): its request topics and worker are named after it.
    queue: str
    parameters: GenerationParameters
    output: StageOutput = "image"
    resize: Resize | None = None
    handoff: Handoff | None = None
    # Denoising steps this stage runs (its share of the flow's progress total).
    steps: int = Field(ge=0)


ReplyStatus = Literal["ok", "error", "expired", "cancelled"]


class StageReport(BaseModel):
    """What the worker that ran a flow's stage knows about it: one per stage that ran, on the flow's reply."""

    model_config = ConfigDict(extra="forbid")
    stage: str
    index: int
    model: str
    model_version: str
    worker_id: str = ""
    accelerator: str | None = None
    queue_ms: float = 0.0
    inference_ms: float = 0.0
    worker_started_ms: int | None = None
    worker_finished_ms: int | None = None
    batch_id: str | None = None
    batch_size: int = 0
    attempt: int = 0
    steps: int = 0
    # The steps its images skipped when its model ran with a step cache (contract/step_cache.py); None: it ran without.
    steps_skipped: int | None = None
    # The stage the flow ended in, when it did not finish (`error_kind` its reply's: inference_failed, expired,
    # cancelled, dead_lettered...): it still gets its log row, and a canary's failure its fallback. "ok" otherwise.
    status: ReplyStatus = "ok"
    error_kind: str | None = None

    @property
    def finished(self) -> bool:
        return self.status == "ok"


class FlowContext(BaseModel):
    """A flow on a request message: every stage's plan, which stage this message asks for, and what the
    stages before it left (their reports, and their output when it crossed to another worker group)."""

    model_config = ConfigDict(extra="forbid")
    flow: str
    stages: list[FlowStagePlan] = Field(min_length=1)
    stage: int = Field(default=0, ge=0)
    # The previous stage's output, forwarded across worker groups: a safetensors file holding `latents`
    # (N, C, H, W) or `images` (N, H, W, 3, uint8); inline when small, else a claim check in the payload bucket.
    intermediate: Payload | None = None
    finished: list[StageReport] = Field(default_factory=list)


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    model: str
    model_version: str
    instances: list[RequestInstance]
    parameters: GenerationParameters
    published_at_ms: int = Field(default_factory=lambda: int(time.time() * 1000))
    # Set on a flow's request (the API publishes it to the first stage's unit; `model`/`model_version`/
    # `parameters` are that stage's): the worker runs `flow.stage` and hands its output on.
    flow: FlowContext | None = None
    # The control images of `parameters.controls`, in its order (inline, or a claim check); left out when none.
    control_images: list[Payload] = Field(default_factory=list, exclude_if=lambda images: not images)


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: Payload
    seed: int
    width: int
    height: int


class InferenceReply(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    model: str
    model_version: str
    status: ReplyStatus
    predictions: list[Prediction] = Field(default_factory=list)
    error: str | None = None
    # Machine-readable reason for a non-ok status: bad_input, inference_failed, expired, cancelled,
    # dead_lettered, malformed.
    error_kind: str | None = None
    worker_id: str = ""
    queue_ms: float = 0.0
    inference_ms: float = 0.0
    # What only the worker knows, for the inference log: the batch this request ran in, on what, which try.
    batch_id: str | None = None
    batch_size: int = 0
    accelerator: str | None = None
    attempt: int = 0
    worker_started_ms: int | None = None
    worker_finished_ms: int | None = None
    # Denoising steps the step cache skipped, summed over the request's images; None without a step cache.
    steps_skipped: int | None = None
    # When the worker's previous call ended, if this request was already published then (the worker went on from
    # that call to this one): worker_finished_ms minus this is what a call costs a busy worker, gaps included
    # (admission's call time, api_server/predict/admission.py). None: the worker was idle, or steps requests.
    previous_call_ended_ms: int | None = None
    # When this answer became available (stored, then published): a job's end, its log row's end-to-end time.
    answered_ms: int | None = None
    # A flow's final reply (`model` the flow's name, `model_version` ""): every stage that ran, once each.
    stages: list[StageReport] = Field(default_factory=list)


class Progress(BaseModel):
    """Denoising progress of a running request, kept in Redis under `naming.progress_key`."""

    model_config = ConfigDict(extra="forbid")
    request_id: str
    step: int
    total: int
    batch_size: int = 1
    updated_ms: int
    started_ms: int | None = None  # when the pipeline call running it began: a running job's `started_at`
    # A flow's: the stage running, by name and index; `step`/`total` count all its stages' steps.
    stage: str | None = None
    stage_index: int | None = None


def request_attributes(
    request: InferenceRequest, reply_to: str, deadline_ms: int, priority: Priority = "normal"
) -> dict[str, str]:
    return {
        Attr.REQUEST_ID: request.request_id,
        Attr.MODEL: request.model,
        Attr.MODEL_VERSION: request.model_version,
        Attr.REPLY_TO: reply_to,
        Attr.DEADLINE_MS: str(deadline_ms),
        Attr.PRIORITY: priority,
        Attr.SCHEMA_VERSION: SCHEMA_VERSION,
    }
