"""The event stream's rules without a server: ids, resume, one terminal event, the deadline, the shared hub."""

from __future__ import annotations

import asyncio
import json

import pytest

from api_server.jobs.events import (
    EXPIRY_GRACE_MS,
    InvalidLastEventIdError,
    JobEventStream,
    JobWatchHub,
    StreamCursor,
    async_job_event_stream,
    events_for,
    job_event_stream,
)
from api_server.jobs.service import JobState
from contract.messages import Progress


def state(status: str, step: int | None = None, deadline_ms: int = 10_000_000) -> JobState:
    progress = Progress(request_id="j1", step=step, total=10, updated_ms=0) if step is not None else None
    return JobState("j1", "noop", "1", 0, deadline_ms, status, progress=progress)


def view(job: JobState) -> dict:
    return {"id": job.job_id, "status": job.status}


def parse(frames: list[str]) -> list[tuple[str, str]]:
    out = []
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.strip().splitlines() if not line.startswith(":"))
        if "event" in lines:
            out.append((lines["event"], lines["id"]))
    return out


class FakeJobs:
    """A job store whose state the test sets; change marks follow it."""

    def __init__(self, job: JobState) -> None:
        self.job = job
        self.mark_reads = 0

    def change_marks(self, job_ids):
        self.mark_reads += 1
        return [(self.job.status, self.job.progress and self.job.progress.step) for _ in job_ids]

    def get(self, job_id, owner):
        return self.job


def test_each_step_is_sent_once_in_order_then_one_terminal_event():
    cursor = StreamCursor()
    sequence = [state("queued"), state("queued"), state("running", 2), state("running", 2), state("running", 5)]
    sequence += [state("succeeded"), state("succeeded")]
    frames = [frame for job in sequence for frame in events_for(job, cursor, view)]
    assert parse(frames) == [("queued", "0"), ("running", "2"), ("running", "5"), ("succeeded", "end")]


def test_last_event_id_resumes_after_it_and_end_leaves_nothing():
    cursor = StreamCursor.from_last_event_id("5")
    assert parse(events_for(state("running", 5), cursor, view)) == []
    assert parse(events_for(state("running", 6), cursor, view)) == [("running", "6")]
    assert StreamCursor.from_last_event_id("end").ended
    assert events_for(state("succeeded"), StreamCursor.from_last_event_id("end"), view) == []
    for bad in ("-1", "five", "1e3", "9" * 12, "\u00b9"):  # a superscript: a digit to isdigit(), not to int()
        with pytest.raises(InvalidLastEventIdError):
            StreamCursor.from_last_event_id(bad)


def test_queued_event_says_its_position_is_unknown():
    [frame] = events_for(state("queued"), StreamCursor(), view)
    data = json.loads(frame.split("data: ", 1)[1])
    assert data == {"id": "j1", "status": "queued", "position": None}


def test_a_stream_open_past_the_jobs_deadline_ends_with_a_deadline_event():
    job = state("running", 3, deadline_ms=1_000)
    hub = JobWatchHub(FakeJobs(job), tick_seconds=3600)
    clock = iter([0.5, (1_000 + EXPIRY_GRACE_MS) / 1000 + 1])
    stream = JobEventStream(job, StreamCursor(), view, clock=lambda: next(clock))
    body = list(job_event_stream(hub, stream, lambda: job, keepalive_seconds=0.01))
    assert body[0].startswith("retry:")
    assert parse(body[1:]) == [("running", "3"), ("deadline", "end")]
    assert "passed its deadline" in body[-1] and hub.watched() == 0


def test_the_hub_reads_every_watched_job_in_one_round_trip_and_wakes_its_watchers():
    jobs = FakeJobs(state("queued"))
    hub = JobWatchHub(jobs, tick_seconds=3600)  # ticks driven by hand
    watches = [hub.watch("j1") for _ in range(50)]
    hub.poll_once()
    assert jobs.mark_reads == 1 and all(w.next_state(0).status == "queued" for w in watches)
    hub.poll_once()  # unchanged: nobody is woken
    assert all(w.next_state(0) is None for w in watches)
    jobs.job = state("running", 1)
    hub.poll_once()
    assert all(w.next_state(0).status == "running" for w in watches) and jobs.mark_reads == 3
    for watch in watches:
        hub.unwatch(watch)
    assert hub.watched() == 0


def test_the_event_loop_stream_waits_on_the_hub_without_a_thread_and_ends_once():
    jobs = FakeJobs(state("queued"))
    hub = JobWatchHub(jobs, tick_seconds=3600)

    async def watch() -> list[bytes]:
        stream = JobEventStream(jobs.job, StreamCursor(), view, clock=lambda: 0.0)  # far from the deadline
        body = async_job_event_stream(hub, stream, lambda: jobs.job)
        chunks = [await anext(body)]  # retry + queued, before any watch
        waiting = asyncio.ensure_future(anext(body))
        await asyncio.sleep(0)  # the stream now waits on its watch
        assert hub.watched() == 1
        jobs.job = state("running", 4)
        await asyncio.to_thread(hub.poll_once)  # the hub's thread delivers; the loop wakes the stream
        chunks.append(await waiting)
        jobs.job = state("succeeded")
        await asyncio.to_thread(hub.poll_once)
        chunks += [chunk async for chunk in body]
        return chunks

    chunks = asyncio.run(watch())
    frames = [frame + "\n\n" for chunk in chunks for frame in chunk.decode().split("\n\n") if frame]
    assert parse(frames) == [("queued", "0"), ("running", "4"), ("succeeded", "end")]
    assert hub.watched() == 0
