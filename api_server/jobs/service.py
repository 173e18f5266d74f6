"""Jobs: a request published without waiting, owned by the API key that made it, read back by its id.

A job's id is its request id. The job record (owner, model, deadline, cancellation) lives in Redis with
the results' TTL; its state is derived from what the worker stored under that request id: the reply,
else the denoising progress, else queued.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from contract import naming
from contract.messages import InferenceReply, Progress
from contract.model_spec import ModelSpec
from contract.outcomes import FINISHED_JOB_STATES, Outcome
from contract.stores.results import ResultStore

# A queued job nobody picked up this long after its deadline is reported expired (no worker will run it).
EXPIRY_GRACE_MS = 30_000


UNLOGGED_JOBS_KEY = "maas:jobs:unlogged"
WEBHOOK_JOBS_KEY = "maas:jobs:webhooks"


def reply_outcome(reply: InferenceReply) -> Outcome:
    return Outcome.for_reply(reply.status, reply.error_kind)


# The failures that are the version's own, for which a canary's request is asked of the stable version. The
# worker's refusal of the request's own input (`input_refused`) is not one: the stable version would refuse it too.
VERSION_FAILURES = frozenset({Outcome.WORKER_ERROR, Outcome.DEAD_LETTERED})


def version_failed(reply: InferenceReply | None) -> bool:
    """The reply is the version's own failure (not the caller's input's): a canary's request falls back on it."""
    return reply is not None and reply_outcome(reply) in VERSION_FAILURES


def fallback_request_id(request_id: str) -> str:
    """The stable version's attempt at a request a canary failed runs under an id of its own: the first
    attempt's answer is already stored under the request's id, and a worker answers a request id once."""
    return f"{request_id}-fallback"


def job_key(job_id: str) -> str:
    return f"maas:job:{job_id}"


def owner_jobs_key(owner: str) -> str:
    """The ids of the jobs a key may read, scored by creation time (ms): `GET /v1/jobs` lists from it."""
    return f"maas:jobs:owner:{owner}"


@dataclass(frozen=True)
class JobCursor:
    """Where a job list page ended: the last job's creation time and id (ties in one millisecond by id)."""

    created_ms: int
    job_id: str

    def __str__(self) -> str:
        return f"{self.created_ms}_{self.job_id}"


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
    cancelled_ms: int | None = None

    @property
    def started_ms(self) -> int | None:
        """When a worker began running it: its pipeline call's start (known while it runs, and after)."""
        if self.reply is not None and self.reply.worker_started_ms is not None:
            return self.reply.worker_started_ms
        return self.progress.started_ms if self.progress is not None else None

    @property
    def finished_ms(self) -> int | None:
        """When it ended: its answer became available, it was cancelled, or (unanswered) its deadline passed."""
        if self.status == "cancelled" and self.cancelled_ms is not None:
            return self.cancelled_ms
        if self.reply is not None and (self.reply.answered_ms or self.reply.worker_finished_ms):
            return self.reply.answered_ms or self.reply.worker_finished_ms
        # Unanswered past its deadline, or an expiry answer that says no time (a flow's, from a watchdog before
        # its answers carried one): it ended when its deadline passed.
        return self.deadline_ms if self.status == "expired" else None


@dataclass(frozen=True)
class EndedJob:
    """A job that ended with its log row still to write: the partial row, the reply (None: it expired
    unanswered; the stable version's, after a fallback), and whether its outcome feeds the rollback guard (a
    job submitted as one). `fallback`: the stable version's request, when a canary failed this job and the
    stable version is to be asked now (the job has not ended, then); `fallback_from`/`_error`: it was asked."""

    job_id: str
    row: dict
    reply: InferenceReply | None
    observe: bool
    deadline_ms: int = 0
    fallback: FallbackRequest | None = None
    fallback_from: str | None = None
    fallback_error: str | None = None


@dataclass(frozen=True)
class FallbackRequest:
    """What a job routed to a canary keeps so the stable version can be asked if the canary fails it: the
    request as the stable version's queue takes it (under `fallback_request_id`), and its priority."""

    request_json: str
    priority: str


class JobStore:
    def __init__(self, client: redis.Redis, results: ResultStore, ttl_seconds: int) -> None:
        self._redis = client
        self._results = results
        self._ttl = ttl_seconds

    def create(
        self,
        job_id: str,
        owner: str,
        spec: ModelSpec,
        deadline_ms: int,
        created_ms: int | None = None,
        fallback: FallbackRequest | None = None,
    ) -> None:
        """`created_ms`: when the request arrived, for a sync request turned into a job (default: now);
        `fallback`: the stable version's request, for a job the split sent to a canary."""
        pipe = self._redis.pipeline(transaction=True)
        fields = {
            f"owner:{owner}": "1",
            "model": spec.name,
            "model_version": spec.version,
            "created_ms": created_ms if created_ms is not None else int(time.time() * 1000),
            "deadline_ms": deadline_ms,
        }
        if fallback is not None:
            fields.update(fallback_request=fallback.request_json, fallback_priority=fallback.priority)
        pipe.hset(job_key(job_id), mapping=fields)
        pipe.expire(job_key(job_id), self._ttl)
        self._index(pipe, owner, job_id, created_ms if created_ms is not None else int(time.time() * 1000))
        pipe.execute()

    def share(self, job_id: str, owner: str) -> None:
        """Another key's identical request was coalesced into this job: it may read it (and list it) too."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(job_key(job_id), f"owner:{owner}", "1")
        self._index(pipe, owner, job_id, int(time.time() * 1000))
        pipe.execute()

    def _index(self, pipe, owner: str, job_id: str, created_ms: int) -> None:
        """Adds the job to its owner's list, dropping entries older than a job record lives."""
        key = owner_jobs_key(owner)
        pipe.zadd(key, {job_id: created_ms})
        pipe.zremrangebyscore(key, "-inf", f"({int(time.time() * 1000) - self._ttl * 1000}")
        pipe.expire(key, self._ttl)

    def list_for(
        self, owner: str, limit: int, after: JobCursor | None = None, status: str | None = None, scan: int = 1000
    ) -> tuple[list[JobState], JobCursor | None]:
        """The owner's jobs, newest first, after `after`, in `status` if given; and the cursor of the next
        page (None when no job is left to look at). At most `scan` jobs are read per call, so a filter
        that matches little costs a bounded page (short, with a cursor) rather than a scan of everything."""
        key, found, offset, looked = owner_jobs_key(owner), [], 0, 0
        top = after.created_ms if after is not None else "+inf"
        while True:
            batch = self._redis.zrevrangebyscore(key, top, "-inf", start=offset, num=100, withscores=True)
            if not batch:
                return found, None
            offset += len(batch)
            for position, (raw_id, score) in enumerate(batch):
                cursor = JobCursor(int(score), raw_id.decode())
                if after is not None and cursor.created_ms == after.created_ms and cursor.job_id >= after.job_id:
                    continue  # same millisecond, listed already (ties come in descending id order)
                looked += 1
                job = self.get(cursor.job_id, owner)
                if job is not None and (status is None or job.status == status):
                    found.append(job)
                if len(found) == limit or looked == scan:
                    more = position + 1 < len(batch) or bool(
                        self._redis.zrevrangebyscore(key, top, "-inf", start=offset, num=1)
                    )
                    return found, cursor if more else None

    def get(self, job_id: str, owner: str | None) -> JobState | None:
        """The job as `owner` may see it; None when it does not exist or belongs to another key.

        `owner=None` reads any job (the API's own background work, never a caller's request)."""
        record = {key.decode(): value.decode() for key, value in self._redis.hgetall(job_key(job_id)).items()}
        if "model" not in record or (owner is not None and record.get(f"owner:{owner}") != "1"):
            return None
        state = JobState(
            job_id=job_id,
            model=record["model"],
            model_version=record["model_version"],
            created_ms=int(record["created_ms"]),
            deadline_ms=int(record["deadline_ms"]),
            status="queued",
        )
        # After a fallback the job is the stable version's attempt; a canary's error waiting for its fallback
        # to start (the job-log loop starts it within a second) is not the job's end.
        attempt = fallback_request_id(job_id) if "fallback_from" in record else job_id
        state.reply = self._results.get(attempt)
        pending = "fallback_request" in record and time.time() * 1000 < state.deadline_ms
        if pending and version_failed(state.reply):
            state.reply = None
        if "cancelled_ms" in record:
            # Cancelled before it finished (a finished job cannot be cancelled): any result is discarded.
            state.status, state.reply, state.cancelled_ms = "cancelled", None, int(record["cancelled_ms"])
        elif state.reply is not None:
            state.status = reply_outcome(state.reply).spec.job_state or "failed"
        elif (progress := self._results.get_progress(attempt)) is not None:
            state.status, state.progress = "running", progress
        elif time.time() * 1000 > state.deadline_ms + EXPIRY_GRACE_MS:
            state.status = "expired"
        return state

    def defer_log_row(self, job_id: str, row: dict, deadline_ms: int, observe: bool = False) -> None:
        """Keeps the job's partial log row until the job ends (see `job_log.py`); `observe`: its outcome then
        also feeds the rollback guard."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(job_key(job_id), mapping={"log_row": json.dumps(row), "observe": int(observe)})
        pipe.zadd(UNLOGGED_JOBS_KEY, {job_id: deadline_ms})
        pipe.execute()

    def ended_unlogged(self, limit: int = 500) -> list[EndedJob]:
        """Unlogged jobs that ended: answered, or expired unanswered (reply None); and jobs a canary failed
        whose stable version is to be asked now (`fallback` set)."""
        now_ms = time.time() * 1000
        ended = []
        fields = ["log_row", "observe", "fallback_request", "fallback_priority", "fallback_from", "fallback_error",
                  "cancelled_ms"]  # fmt: skip
        for raw_id, deadline_ms in self._redis.zrange(UNLOGGED_JOBS_KEY, 0, limit - 1, withscores=True):
            job_id = raw_id.decode()
            reply = self._results.get(job_id)
            if reply is None and now_ms <= deadline_ms + EXPIRY_GRACE_MS:
                continue  # the common case costs one round trip: not answered yet
            record = dict(zip(fields, self._redis.hmget(job_key(job_id), fields), strict=True))
            if record["fallback_from"] is not None:  # the job is its stable version's attempt now
                reply = self._results.get(fallback_request_id(job_id))
                if reply is None and now_ms <= deadline_ms + EXPIRY_GRACE_MS:
                    continue
            if record["log_row"] is None:  # the job record expired: nothing left to complete
                self._redis.zrem(UNLOGGED_JOBS_KEY, job_id)
                continue
            fallback = None
            if _may_fall_back(record, reply, now_ms, deadline_ms):
                fallback = FallbackRequest(record["fallback_request"].decode(), record["fallback_priority"].decode())
            ended.append(
                EndedJob(
                    job_id,
                    json.loads(record["log_row"]),
                    reply,
                    record["observe"] == b"1",
                    int(deadline_ms),
                    fallback,
                    _text(record["fallback_from"]),
                    _text(record["fallback_error"]),
                )
            )
        return ended

    def drop_fallback(self, job_id: str) -> None:
        """The stable version could not be asked (its queue refused): the canary's answer is the job's."""
        self._redis.hdel(job_key(job_id), "fallback_request")

    def fell_back(self, job_id: str, failed_version: str, error: str, stable_version: str, deadline_ms: int) -> None:
        """Records that the stable version was asked (the job is now its attempt) and waits for its end again."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(
            job_key(job_id),
            mapping={"fallback_from": failed_version, "fallback_error": error, "model_version": stable_version},
        )
        pipe.hdel(job_key(job_id), "fallback_request")
        pipe.zadd(UNLOGGED_JOBS_KEY, {job_id: deadline_ms})
        pipe.execute()

    def claim_log_row(self, job_id: str) -> bool:
        """True for exactly one caller: that one writes the row."""
        return bool(self._redis.zrem(UNLOGGED_JOBS_KEY, job_id))

    def add_webhook(self, job_id: str, url: str, deadline_ms: int) -> None:
        """Registers the job's webhook, called once when the job ends (see `webhooks.py`)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(job_key(job_id), "webhook_url", url)
        pipe.zadd(WEBHOOK_JOBS_KEY, {job_id: deadline_ms})
        pipe.execute()

    def ended_with_webhook(self, limit: int = 500) -> list[tuple[JobState, str]]:
        """(job, webhook URL) for jobs with an undelivered webhook that have ended."""
        ended = []
        for raw_id in self._redis.zrange(WEBHOOK_JOBS_KEY, 0, limit - 1):
            job_id = raw_id.decode()
            job = self.get(job_id, None)
            url = self._redis.hget(job_key(job_id), "webhook_url")
            if job is None or url is None:  # the job record expired: nobody left to tell
                self._redis.zrem(WEBHOOK_JOBS_KEY, job_id)
            elif job.status in FINISHED_JOB_STATES:
                ended.append((job, url.decode()))
        return ended

    def claim_webhook(self, job_id: str) -> bool:
        """True for exactly one caller across API processes: that one delivers the webhook."""
        return bool(self._redis.zrem(WEBHOOK_JOBS_KEY, job_id))

    def change_marks(self, job_ids: list[str]) -> list[tuple]:
        """A cheap fingerprint per job of what `get` derives its state from (progress, reply present,
        cancelled), in one round trip: the event stream re-reads a job in full only when it changes."""
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            fallback = fallback_request_id(job_id)
            pipe.get(naming.progress_key(job_id))
            pipe.exists(naming.result_key(job_id))
            pipe.hexists(job_key(job_id), "cancelled_ms")
            pipe.get(naming.progress_key(fallback))
            pipe.exists(naming.result_key(fallback))
            pipe.hexists(job_key(job_id), "fallback_from")
        flat = pipe.execute()
        return [tuple(flat[index : index + 6]) for index in range(0, len(flat), 6)]

    def cancel(self, job_id: str) -> None:
        """Marks the job cancelled: a queued request is answered `cancelled` unrun, a running batch stops."""
        self._results.cancel(job_id)
        self._results.cancel(fallback_request_id(job_id))
        self._redis.hset(job_key(job_id), "cancelled_ms", int(time.time() * 1000))


def _may_fall_back(record: dict, reply: InferenceReply | None, now_ms: float, deadline_ms: float) -> bool:
    """A job routed to a canary that failed it (its own failure, not the input's), with time left: its stable
    version is asked."""
    return (
        record["fallback_request"] is not None
        and record["fallback_from"] is None
        and record["cancelled_ms"] is None
        and version_failed(reply)
        and now_ms < deadline_ms
    )


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _iso(epoch_ms: int | None) -> str | None:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat()


def stage_timings(reply: InferenceReply) -> list[dict]:
    """A flow's answer's `stages` (sync, job and batch line alike): every stage that ran, in order; the one it
    ended in, when it did not finish, with its `status` and `error_kind`."""
    return [
        {"stage": stage.stage, "model": stage.model, "model_version": stage.model_version,
         "queue_ms": round(stage.queue_ms, 2), "inference_ms": round(stage.inference_ms, 2),
         **({} if stage.finished else {"status": stage.status, "error_kind": stage.error_kind})}
        for stage in reply.stages
    ]  # fmt: skip


def job_view(job: JobState, predictions) -> dict:
    """A job as `GET /v1/jobs/{id}` and its webhook show it; `predictions` turns a reply into image JSON
    (None: the view leaves the result out, as the job list does)."""
    view: dict = {
        "id": job.job_id,
        "status": job.status,
        "model": job.model,
        "model_version": job.model_version,
        "created_at": _iso(job.created_ms),
        "started_at": _iso(job.started_ms),
        "finished_at": _iso(job.finished_ms),
        "links": {"self": f"/v1/jobs/{job.job_id}"},
    }
    if job.progress is not None:
        view["progress"] = {"step": job.progress.step, "total": job.progress.total}
        if job.progress.stage is not None:  # a flow's: its steps count all stages', the running one named
            view["progress"].update(stage=job.progress.stage, stage_index=job.progress.stage_index)
    reply = job.reply
    if reply is not None and job.status == "succeeded":
        if predictions is None:
            return view
        view["result"] = {
            "predictions": predictions(reply),
            "timings_ms": {"queue": round(reply.queue_ms, 2), "inference": round(reply.inference_ms, 2)},
        }
        if reply.stages:  # a flow's, as its sync answer has them
            view["result"]["stages"] = stage_timings(reply)
    elif reply is not None:
        view["error"] = {
            "code": reply_outcome(reply).spec.http_status,
            "message": reply.error or f"model worker answered {reply.status}",
            "kind": reply.error_kind,
        }
        if reply.stages:  # a flow's that did not finish: the stages that ran before it ended (its error names where)
            view["error"]["stages"] = stage_timings(reply)
    return view
