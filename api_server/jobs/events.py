"""A job's status as Server-Sent Events: which events a state change gives, and one watcher thread per process.

Watching costs no Redis traffic per watcher: a `JobWatchHub` polls every watched job of its process
with one pipelined round trip per tick (`JobStore.change_marks`), re-reads a job in full only when its
marks change, and hands the new state to that job's watchers. A tick of 0.25 s is also what keeps `running`
events to about four a second. A watcher costs no thread either: under gunicorn the stream is served on the
event loop (`async_job_event_stream`, handed over by `api_server/process/wsgi_bridge.py`), where a watch is an
`asyncio.Event`; `job_event_stream` is the same stream for a plain WSGI server (one thread per watcher).

Event ids make a reconnect resume (`Last-Event-ID`): `0` is `queued`, `N` is `running` step N, `end` is
the one terminal event (`succeeded`, `failed`, `expired`, `cancelled`, or `deadline` when the job outlived
its deadline without ending). Nothing already sent is sent again; after `end` there is nothing left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import redis

from api_server.jobs.service import EXPIRY_GRACE_MS, JobState, JobStore
from contract.digits import ascii_digits
from contract.outcomes import FINISHED_JOB_STATES as ENDED

log = logging.getLogger(__name__)

TICK_SECONDS = 0.25
KEEPALIVE_SECONDS = 15.0
RETRY_MS = 2000
QUEUED_ID, END_ID = "0", "end"
KEEPALIVE_FRAME = ": keepalive\n\n"


class InvalidLastEventIdError(ValueError):
    """`Last-Event-ID` is none of the ids this stream sends (`0`, a step number, `end`)."""


@dataclass
class StreamCursor:
    """What the client already has: nothing (None), `queued` (0), running step N, or the end."""

    step: int | None = None
    ended: bool = False

    @classmethod
    def from_last_event_id(cls, value: str | None) -> StreamCursor:
        if value is None or not value.strip():
            return cls()
        value = value.strip()
        if value == END_ID:
            return cls(ended=True)
        if not ascii_digits(value) or len(value) > 9:
            raise InvalidLastEventIdError(f"Last-Event-ID {value!r}: expected 0, a step number or 'end'")
        return cls(step=int(value))


def sse_frame(event: str, event_id: str, data: dict) -> str:
    return f"id: {event_id}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def events_for(state: JobState, cursor: StreamCursor, view: Callable[[JobState], dict]) -> list[str]:
    """The frames `state` adds to what the cursor says was sent; advances the cursor."""
    if cursor.ended:
        return []
    if state.status in ENDED:
        cursor.ended = True
        return [sse_frame(state.status, END_ID, view(state))]
    if state.status == "running" and state.progress is not None:
        step = state.progress.step
        if cursor.step is not None and step <= cursor.step:
            return []
        cursor.step = step
        return [sse_frame("running", str(step), view(state))]
    if state.status == "queued" and cursor.step is None:
        cursor.step = 0
        # Pub/Sub does not tell a message's place in its subscription: the position is not known here.
        return [sse_frame("queued", QUEUED_ID, {**view(state), "position": None})]
    return []


def deadline_frame(state: JobState, view: Callable[[JobState], dict]) -> str:
    message = (
        f"job {state.job_id} passed its deadline without ending (still {state.status}); "
        f"GET /v1/jobs/{state.job_id} reads its outcome"
    )
    return sse_frame("deadline", END_ID, {**view(state), "message": message})


def stream_deadline_ms(state: JobState) -> int:
    """After this the job store itself calls a still-queued job expired: no stream outlives it."""
    return state.deadline_ms + EXPIRY_GRACE_MS


class JobWatch:
    """One open stream's mailbox: the hub puts the latest state in, the stream takes it out.

    Made with a `loop`, the hub's delivery also wakes an asyncio waiter on that loop (`next_state_async`)."""

    def __init__(self, job_id: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.job_id = job_id
        self._changed = threading.Condition()
        self._state: JobState | None = None
        self._loop = loop
        self._woken = asyncio.Event() if loop is not None else None

    def deliver(self, state: JobState) -> None:
        with self._changed:
            self._state = state
            self._changed.notify()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed (worker shutting down): nobody waits
                self._loop.call_soon_threadsafe(self._woken.set)

    def next_state(self, timeout: float) -> JobState | None:
        """The newest state not yet taken, or None after `timeout` seconds without one."""
        with self._changed:
            if self._state is None:
                self._changed.wait(timeout)
            return self._take()

    async def next_state_async(self, timeout: float) -> JobState | None:
        """`next_state` on the watch's event loop: waits without holding a thread."""
        assert self._woken is not None, "made without a loop"
        while True:
            self._woken.clear()  # before the take: a delivery after it sets the event again
            with self._changed:
                state = self._take()
            if state is not None:
                return state
            try:
                await asyncio.wait_for(self._woken.wait(), timeout)
            except TimeoutError:
                with self._changed:
                    return self._take()

    def _take(self) -> JobState | None:
        state, self._state = self._state, None
        return state


class JobWatchHub:
    """Polls the watched jobs of this process on one thread (started with the first watch)."""

    def __init__(self, jobs: JobStore, tick_seconds: float = TICK_SECONDS) -> None:
        self._jobs = jobs
        self._tick = tick_seconds
        self._lock = threading.Lock()
        self._watches: dict[str, set[JobWatch]] = {}
        self._marks: dict[str, tuple] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._redis_down = False

    def watch(self, job_id: str, loop: asyncio.AbstractEventLoop | None = None) -> JobWatch:
        watch = JobWatch(job_id, loop)
        with self._lock:
            self._watches.setdefault(job_id, set()).add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="job-watch-hub", daemon=True)
                self._thread.start()
        return watch

    def unwatch(self, watch: JobWatch) -> None:
        with self._lock:
            watchers = self._watches.get(watch.job_id)
            if watchers is not None:
                watchers.discard(watch)
                if not watchers:
                    del self._watches[watch.job_id]
                    self._marks.pop(watch.job_id, None)

    def watched(self) -> int:
        with self._lock:
            return sum(len(watchers) for watchers in self._watches.values())

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._tick):
            try:
                self.poll_once()
            except redis.RedisError as exc:
                if not self._redis_down:
                    log.warning("job event streams paused: Redis unavailable (%s)", exc)
                self._redis_down = True
            except Exception:  # noqa: BLE001 - the hub must outlive one bad tick
                log.exception("job event hub tick failed")

    def poll_once(self) -> None:
        """One tick: the marks of every watched job, then a full read of each that changed."""
        with self._lock:
            job_ids = list(self._watches)
        if not job_ids:
            return
        marks = self._jobs.change_marks(job_ids)
        self._redis_down = False
        for job_id, mark in zip(job_ids, marks, strict=True):
            if self._marks.get(job_id) == mark:
                continue
            state = self._jobs.get(job_id, None)
            with self._lock:
                if job_id not in self._watches:
                    continue
                self._marks[job_id] = mark
                watchers = list(self._watches[job_id])
            if state is not None:
                for watch in watchers:
                    watch.deliver(state)


class JobEventStream:
    """One stream's rules apart from how it waits, shared by the WSGI and asyncio drivers below: the opening
    frames, the frames each new state adds, when the deadline falls, and the frame that ends it there."""

    def __init__(
        self,
        first: JobState,
        cursor: StreamCursor,
        view: Callable[[JobState], dict],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.first, self.cursor, self.view, self.clock = first, cursor, view, clock
        self.state = first

    @property
    def ended(self) -> bool:
        return self.cursor.ended

    def opening(self) -> list[str]:
        return [f"retry: {RETRY_MS}\n\n", *events_for(self.first, self.cursor, self.view)]

    def seconds_left(self) -> float:
        return stream_deadline_ms(self.first) / 1000 - self.clock()

    def on_state(self, state: JobState) -> list[str]:
        self.state = state
        return events_for(state, self.cursor, self.view)

    def at_deadline(self, latest: JobState | None) -> list[str]:
        """The job's outcome if it ended meanwhile, else the explicit `deadline` frame; either way the end."""
        latest = latest or self.state
        return events_for(latest, self.cursor, self.view) or [deadline_frame(latest, self.view)]


def job_event_stream(
    hub: JobWatchHub, stream: JobEventStream, read_job: Callable[[], JobState | None],
    keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> Iterator[str]:  # fmt: skip
    """The response body on a WSGI server: frames as the job changes, a comment every `keepalive_seconds` (so
    a dead client is noticed and proxies keep the connection), and exactly one terminal frame, then the end."""
    yield from stream.opening()
    if stream.ended:
        return
    watch = hub.watch(stream.first.job_id)
    try:
        while not stream.ended:
            left = stream.seconds_left()
            if left <= 0:
                yield from stream.at_deadline(read_job())
                return
            new = watch.next_state(min(keepalive_seconds, left))
            yield from [KEEPALIVE_FRAME] if new is None else stream.on_state(new)
    finally:
        hub.unwatch(watch)


async def async_job_event_stream(
    hub: JobWatchHub, stream: JobEventStream, read_job: Callable[[], JobState | None],
    keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> AsyncIterator[bytes]:  # fmt: skip
    """The same body on the event loop: no thread while it waits. A terminal state's view (which may read
    result payloads) and the deadline's re-read of the job run on a thread of the loop's executor."""
    yield "".join(stream.opening()).encode()
    if stream.ended:
        return
    watch = hub.watch(stream.first.job_id, asyncio.get_running_loop())
    try:
        while not stream.ended:
            left = stream.seconds_left()
            if left <= 0:
                yield "".join(await asyncio.to_thread(lambda: stream.at_deadline(read_job()))).encode()
                return
            new = await watch.next_state_async(min(keepalive_seconds, left))
            if new is None:
                frames = [KEEPALIVE_FRAME]
            elif new.status in ENDED:
                frames = await asyncio.to_thread(stream.on_state, new)
            else:
                frames = stream.on_state(new)
            if frames:
                yield "".join(frames).encode()
    finally:
        hub.unwatch(watch)
