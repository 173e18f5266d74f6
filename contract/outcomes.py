"""The one vocabulary of a request's outcome: per outcome, its HTTP status, log status, error kind and job state.

Every mapping in the API reads this table: the answer's HTTP status, the inference log row's `status` and
`error_kind`, the state `GET /v1/jobs/{id}` shows and the job's `error.code`. So an event has one name
wherever it is counted: a worker's `expired` reply is `expired` in the log whether the request waited for
it (sync, 504) or polled for it (a job), and a `cancelled` one is `cancelled` on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class OutcomeSpec:
    # What a synchronous predict answers (job endpoints answer 202 with the job, whose state is `job_state`).
    http_status: int
    # The inference log row's `status` (the analytics views group on it).
    log_status: str
    # The row's `error_kind` when the worker named none (a worker's own kind, e.g. `bad_input`, wins).
    error_kind: str | None
    # The job's state when a job ends this way; None for refusals, which never make a job.
    job_state: str | None


class Outcome(StrEnum):
    OK = "ok"
    CACHE_HIT = "cache_hit"
    COALESCED = "coalesced"
    REPLAY = "replay"
    ACCEPTED = "accepted"  # a job made; its own outcome comes later
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    TOO_LARGE = "too_large"
    BAD_INPUT = "bad_input"
    RATE_LIMITED = "rate_limited"
    REJECTED = "rejected"  # any other refusal before the model
    UNAVAILABLE = "unavailable"
    OVERLOADED = "overloaded"  # refused at once by admission: its predicted start would miss its deadline
    TIMEOUT = "timeout"  # no reply in time, and the request could not be kept as a job
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    DEAD_LETTERED = "dead_lettered"
    INPUT_REFUSED = "input_refused"  # the worker refused what it was given (an adapter it cannot load, an image)
    WORKER_ERROR = "worker_error"
    INTERNAL = "internal"

    @property
    def spec(self) -> OutcomeSpec:
        return OUTCOMES[self]

    @property
    def answered(self) -> bool:
        """The model's result was returned (computed now, or kept from an identical request)."""
        return self.spec.log_status == "ok"

    @classmethod
    def for_reply(cls, status: str, error_kind: str | None = None) -> Outcome:
        """A worker reply's outcome (`InferenceReply.status` and `.error_kind`)."""
        if status == "error":
            return {"dead_lettered": cls.DEAD_LETTERED, "bad_input": cls.INPUT_REFUSED}.get(
                error_kind, cls.WORKER_ERROR
            )
        return _BY_REPLY_STATUS[status]

    @classmethod
    def for_http_status(cls, status: int) -> Outcome:
        """A refusal known only by its HTTP status (an error raised before or instead of an answer)."""
        if (outcome := _BY_HTTP_STATUS.get(status)) is not None:
            return outcome
        return cls.REJECTED if status < 500 else cls.INTERNAL


OUTCOMES: dict[Outcome, OutcomeSpec] = {
    Outcome.OK: OutcomeSpec(200, "ok", None, "succeeded"),
    Outcome.CACHE_HIT: OutcomeSpec(200, "ok", None, "succeeded"),
    Outcome.COALESCED: OutcomeSpec(200, "ok", None, "succeeded"),
    Outcome.REPLAY: OutcomeSpec(200, "ok", None, "succeeded"),
    Outcome.ACCEPTED: OutcomeSpec(202, "accepted", None, "queued"),
    Outcome.BAD_REQUEST: OutcomeSpec(400, "rejected", "bad_request", None),
    Outcome.UNAUTHORIZED: OutcomeSpec(401, "rejected", "unauthenticated", None),
    Outcome.FORBIDDEN: OutcomeSpec(403, "rejected", "forbidden", None),
    Outcome.NOT_FOUND: OutcomeSpec(404, "rejected", "not_found", None),
    Outcome.CONFLICT: OutcomeSpec(409, "rejected", "conflict", None),
    Outcome.TOO_LARGE: OutcomeSpec(413, "rejected", "too_large", None),
    Outcome.BAD_INPUT: OutcomeSpec(422, "rejected", "invalid_request", None),
    Outcome.RATE_LIMITED: OutcomeSpec(429, "rejected", "rate_limited", None),
    Outcome.REJECTED: OutcomeSpec(400, "rejected", "rejected", None),
    Outcome.UNAVAILABLE: OutcomeSpec(503, "unavailable", "unavailable", None),
    # After UNAVAILABLE, which stays the generic 503 (`_BY_HTTP_STATUS` takes the first of a status).
    Outcome.OVERLOADED: OutcomeSpec(503, "overloaded", "overloaded", None),
    Outcome.TIMEOUT: OutcomeSpec(504, "timeout", "timeout", None),
    Outcome.EXPIRED: OutcomeSpec(504, "expired", "expired", "expired"),
    Outcome.CANCELLED: OutcomeSpec(409, "cancelled", "cancelled", "cancelled"),
    Outcome.DEAD_LETTERED: OutcomeSpec(500, "error", "dead_lettered", "failed"),
    # A 422, as the API's own refusals: the request's input is at fault, not the service; logged as before.
    Outcome.INPUT_REFUSED: OutcomeSpec(422, "error", "bad_input", "failed"),
    Outcome.WORKER_ERROR: OutcomeSpec(500, "error", "inference_failed", "failed"),
    Outcome.INTERNAL: OutcomeSpec(500, "error", "internal", None),
}

_BY_REPLY_STATUS = {"ok": Outcome.OK, "expired": Outcome.EXPIRED, "cancelled": Outcome.CANCELLED}
# Refusals by status: the first outcome in the table with that status and no job state (the generic one).
_BY_HTTP_STATUS = {
    spec.http_status: outcome
    for outcome, spec in reversed(OUTCOMES.items())
    if spec.job_state is None and outcome is not Outcome.REJECTED
}
# Job states that are final: a finished job cannot be cancelled (409), and its log row can be written.
FINISHED_JOB_STATES = frozenset(spec.job_state for spec in OUTCOMES.values() if spec.job_state not in (None, "queued"))
