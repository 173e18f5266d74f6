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


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    model: str
    model_version: str
    instances: list[RequestInstance]
    parameters: GenerationParameters
    published_at_ms: int = Field(default_factory=lambda: int(time.time() * 1000))


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: Payload
    seed: int
    width: int
    height: int


ReplyStatus = Literal["ok", "error", "expired", "cancelled"]


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
    # When this answer became available (stored, then published): a job's end, its log row's end-to-end time.
    answered_ms: int | None = None


class Progress(BaseModel):
    """Denoising progress of a running request, kept in Redis under `naming.progress_key`."""

    model_config = ConfigDict(extra="forbid")
    request_id: str
    step: int
    total: int
    batch_size: int = 1
    updated_ms: int
    started_ms: int | None = None  # when the pipeline call running it began: a running job's `started_at`


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
