"""Jobs: a request published without waiting, owned by the API key that made it, read back by its id.

A job's id is its request id. The job record (owner, model, deadline, cancellation) lives in Redis with
the results' TTL; its state is derived from what the worker stored under that request id: the reply,
else the denoising progress, else queued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from contract.catalog import ModelSpec
from contract.messages import InferenceReply, Progress
from contract.results import ResultStore

# A queued job nobody picked up this long after its deadline is reported expired (no worker will run it).
EXPIRY_GRACE_MS = 30_000
REPLY_STATE = {"ok": "succeeded", "error": "failed", "expired": "expired", "cancelled": "cancelled"}


def job_key(job_id: str) -> str:
    return f"maas:job:{job_id}"


@dataclass
class JobState:
    job_id: str
    model: str
    model_version: str
    created_ms: int
    deadline_ms: int
    status: str
    reply: InferenceReply | None = None
    progress: Progress | None = None


class JobStore:
    def __init__(self, client: redis.Redis, results: ResultStore, ttl_seconds: int) -> None:
        self._redis = client
        self._results = results
        self._ttl = ttl_seconds

    def create(self, job_id: str, owner: str, spec: ModelSpec, deadline_ms: int) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(
            job_key(job_id),
            mapping={
                f"owner:{owner}": "1",
                "model": spec.name,
                "model_version": spec.version,
                "created_ms": int(time.time() * 1000),
                "deadline_ms": deadline_ms,
            },
        )
        pipe.expire(job_key(job_id), self._ttl)
        pipe.execute()

    def share(self, job_id: str, owner: str) -> None:
        """Another key's identical request was coalesced into this job: it may read it too."""
        self._redis.hset(job_key(job_id), f"owner:{owner}", "1")

    def get(self, job_id: str, owner: str) -> JobState | None:
        """The job as `owner` may see it; None when it does not exist or belongs to another key."""
        record = {key.decode(): value.decode() for key, value in self._redis.hgetall(job_key(job_id)).items()}
        if record.get(f"owner:{owner}") != "1":
            return None
        state = JobState(
            job_id=job_id,
            model=record["model"],
            model_version=record["model_version"],
            created_ms=int(record["created_ms"]),
            deadline_ms=int(record["deadline_ms"]),
            status="queued",
        )
        state.reply = self._results.get(job_id)
        if "cancelled_ms" in record:
            # Cancelled before it finished (a finished job cannot be cancelled): any result is discarded.
            state.status, state.reply = "cancelled", None
        elif state.reply is not None:
            state.status = REPLY_STATE[state.reply.status]
        elif (progress := self._results.get_progress(job_id)) is not None:
            state.status, state.progress = "running", progress
        elif time.time() * 1000 > state.deadline_ms + EXPIRY_GRACE_MS:
            state.status = "expired"
        return state

    def cancel(self, job_id: str) -> None:
        """Marks the job cancelled: a queued request is answered `cancelled` unrun, a running batch stops."""
        self._results.cancel(job_id)
        self._redis.hset(job_key(job_id), "cancelled_ms", int(time.time() * 1000))
