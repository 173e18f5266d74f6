"""Drives the device: takes the next batch from the pool, runs one pipeline call, hands the images on.

Nothing slow runs on this thread between calls: encoding, uploads, Redis and Pub/Sub happen in the
finisher, and the pool already holds the next batch, so under load the device goes from one call to the
next without a gap. A batch nobody waits for any more (every request past its deadline or cancelled) is
stopped at the next denoising step. A step-scheduled model runs in a running set instead (`stepping.py`):
between its steps the loop lets held requests join, and runs nothing else until the set is empty.

Batch lines (issue 35) make an interactive request wait no longer than the step under way (or a batch line's
encode or decode under way, which cannot be cut short): a call of batch lines is stopped at its next step when
an interactive request is held (its lines go back to the pool, still leased,
and start over later), and in a running set batch lines are paused (`RunningSet.pause_batch`) while an
interactive request waits or runs, and resumed after. Neither shares a call with an interactive request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from contract.messages import Progress
from contract.payloads import PayloadError
from contract.stores.results import ResultStore
from model_worker.flows.stages import NOT_STARTED, flow_progress
from model_worker.held.leases import LeaseKeeper
from model_worker.held.log_context import message_log_fields
from model_worker.held.pool import PendingRequest, RequestPool
from model_worker.model.runners import BatchAbandonedError, BatchPreemptedError, ModelFailedError, Runner
from model_worker.serving.finisher import ReplyFinisher
from model_worker.serving.health import WorkerHealth
from model_worker.serving.intake import ReplyFactory
from model_worker.serving.metrics import WorkerMetrics
from model_worker.serving.stepping import RunningSet

log = logging.getLogger(__name__)
# A batch line whose run failed (handed back as possibly transient) this many times is answered failed.
BATCH_LINE_RUNS = 2
PROGRESS_INTERVAL_SECONDS = 0.25


# A running request's progress: the request, its step, its total, the images sharing the step, and when
# its pipeline call (or its place in a running set) started, epoch ms.
ProgressEntry = tuple[PendingRequest, int, int, int, int]


class ProgressReporter:
    """Writes the running requests' steps to Redis a few times a second and reads cancellations back.

    A request-scheduled batch has one step for all (`begin`/`update`/`end`); a step-scheduled running set
    reports each request's own step (`running`). A request's last step is always written, whatever the
    throttle caught, so a finished request reads `total` of `total` while it is decoded and answered.

    A thread of its own, so a slow or dead Redis never stalls the device; writes are throttled, so per-step
    progress costs nothing measurable.
    """

    def __init__(self, results: ResultStore, finisher: ReplyFinisher) -> None:
        self._results = results
        self._finisher = finisher
        self._lock = threading.Lock()
        self._batch: list[PendingRequest] = []
        self._step = (0, 0)
        self._started_ms = 0
        self._running: list[ProgressEntry] = []
        self._final: list[ProgressEntry] = []
        self._written: tuple | None = None
        self._stopped = threading.Event()
        self._first_step = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def begin(self, batch: list[PendingRequest], started: float | None = None) -> None:
        """`started` (epoch seconds): the call's start as its replies will state it (`worker_started_ms`)."""
        # The total (the steps the client asked for; img2img runs its strength's share) comes with the
        # first step callback: nothing is written before it.
        with self._lock:
            self._batch, self._step = batch, (0, 0)
            self._started_ms = int((time.time() if started is None else started) * 1000)

    def update(self, step: int, total: int) -> None:
        self._step = (step, total)  # one tuple assignment: atomic, no lock on the device thread
        if step == 1:
            self._first_step.set()  # "running" is visible from the first step, not a tick later

    def end(self) -> None:
        with self._lock:
            self._final += self._batch_entries()
            self._batch = []
        self._first_step.set()

    def running(self, entries: list[tuple[PendingRequest, int, int, int]]) -> None:
        """The step scheduler's running set after a step: (request, its step, its total, images sharing the step)."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            joined = {pending.request_id: started for pending, _, _, _, started in self._running}
            present = {pending.request_id for pending, _, _, _ in entries}
            self._final += [entry for entry in self._running if entry[0].request_id not in present]
            self._running = [
                (pending, step, total, images, joined.get(pending.request_id, now_ms))
                for pending, step, total, images in entries
            ]
        if any(step == 1 for _, step, _, _ in entries):
            self._first_step.set()  # a request that just joined shows as running at once

    def _batch_entries(self) -> list[ProgressEntry]:
        step, total = self._step
        if not self._batch or not total:
            return []
        images = sum(p.size for p in self._batch)
        return [(pending, step, total, images, self._started_ms) for pending in self._batch]

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._first_step.wait(PROGRESS_INTERVAL_SECONDS)
            self._first_step.clear()
            with self._lock:
                entries = list(self._running) + self._batch_entries()
                final, self._final = self._final, []
            try:
                if final:
                    self._write(final)
                if not entries:
                    continue
                state = tuple((id(pending), step) for pending, step, _, _, _ in entries)
                if state != self._written:
                    self._write(entries)
                    self._written = state
                tracked = [pending for pending, _, _, _, _ in entries]
                for request_id in self._results.cancelled([p.request_id for p in tracked]):
                    for pending in tracked:
                        if pending.request_id == request_id:
                            pending.cancelled = True
            except Exception as exc:  # noqa: BLE001 - progress is best effort
                self._finisher.redis_trouble.warn("progress", exc)

    def _write(self, entries: list[ProgressEntry]) -> None:
        now_ms = int(time.time() * 1000)
        self._results.put_progress(
            [Progress(request_id=p.request_id, **flow_progress(p, step, total), batch_size=images, updated_ms=now_ms,
                      started_ms=started_ms)
             for p, step, total, images, started_ms in entries]
        )  # fmt: skip

    def stop(self) -> None:
        self._stopped.set()
        self._first_step.set()


class DeviceLoop:
    def __init__(
        self,
        runners: dict[str, Runner],
        pool: RequestPool,
        finisher: ReplyFinisher,
        leases: LeaseKeeper,
        replies: ReplyFactory,
        progress: ProgressReporter,
        metrics: WorkerMetrics,
        health: WorkerHealth,
    ) -> None:
        self._runners = runners
        self._pool = pool
        self._finisher = finisher
        self._leases = leases
        self._replies = replies
        self._progress = progress
        self._metrics = metrics
        self._health = health
        self.stopping = threading.Event()
        self.calls = 0
        # When the last pipeline call ended (epoch s): a reply says it when its request was waiting by then.
        self._last_call_ended: float | None = None
        self.running = RunningSet(
            runners, progress, metrics, health, replies.worker_id,
            finish=self._finisher.finish, fail=self._fail_alone, abandon=self._answer_abandoned,
        )  # fmt: skip
        self.running.interactive_waiting = lambda: self._pool.first_interactive() is not None
        self.running.give_back = self._pool.put_back

    def run(self) -> None:
        """Until `stopping`; a running set is then finished (drain), but nobody new joins it.

        An exception that escapes a turn (a bug, not a request's own failure, which the runners contain) fails
        the requests that turn held, each answered with the error, and the loop goes on: a dead device thread
        would leave every later request waiting for a worker that pulls but never runs.
        """
        idle_since = time.monotonic()
        while not self.stopping.is_set() or self.running:
            self._health.beat()
            batch: list[PendingRequest] = []
            try:
                if self.running:
                    self._step_running_set()
                    if not self.running:
                        idle_since = time.monotonic()
                    continue
                if self.running.paused and not self.stopping.is_set() and self._pool.first_interactive() is None:
                    self.running.resume(self._pool.batch_images)  # paused batch lines go on before any new one starts
                    continue
                batch, abandoned = self._pool.take_batch(timeout=1.0)
                self._answer_all(abandoned)
                if not batch:
                    continue
                self._metrics.device_idle_seconds.inc(time.monotonic() - idle_since)
                if batch[0].spec.scheduling == "step":
                    self.running.admit(batch)
                    continue
                self.run_batch(batch)
                idle_since = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self._loop_failed(exc, batch)
                idle_since = time.monotonic()
        for pending in self.running.take_paused():
            self._leases.release(pending.message)  # draining: unanswered batch lines go back to Pub/Sub

    def _step_running_set(self) -> None:
        if self.stopping.is_set():
            # Draining (a scale-down, or a Spot preemption's 15 s): batch lines are handed back at once, not run on.
            self.running.pause_batch()
        elif self.running.interactive_images or self._pool.first_interactive() is not None:
            # Somebody waits: batch lines step aside (paused, not lost) so they neither delay nor share its steps.
            self.running.pause_batch()
            self._join(interactive=True)
        else:
            self.running.resume(self._pool.batch_images)
            self._join(interactive=False)
        self._pool.interactive_running(self.running.interactive_images > 0)
        self.running.step()
        if not self.running:
            self._pool.interactive_running(False)

    def _join(self, interactive: bool) -> None:
        if not self.running:
            return  # emptied by `pause_batch`: the next turn starts a new set with the waiting request
        room = (
            self.running.room if interactive else min(self.running.room, self._pool.batch_images - self.running.images)
        )
        joiners, abandoned = self._pool.take_joiners(self.running.key, room, interactive)
        self._answer_all(abandoned)
        self.running.admit(joiners)

    def _loop_failed(self, exc: Exception, batch: list[PendingRequest]) -> None:
        held = self.running.drop_all()
        held += [pending for pending in batch if pending not in held]
        log.error("device loop error; answering its %d requests with it: %r", len(held), exc, exc_info=exc)
        self._metrics.errors.labels(kind="worker_error").inc()
        for pending in held:
            reply = self._replies.make(
                pending.spec, pending.request_id, pending.message,
                status="error", error_kind="worker_error", error=f"worker error: {type(exc).__name__}: {exc}",
            )  # fmt: skip
            self._finisher.answer(pending.message, reply)

    def _answer_all(self, abandoned: list[PendingRequest]) -> None:
        self._metrics.held_requests.set(len(self._pool.held()))
        for pending in abandoned:
            self._answer_abandoned(pending, NOT_STARTED)

    def run_batch(self, batch: list[PendingRequest]) -> None:
        spec = batch[0].spec
        runner = self._runners[spec.queue]
        items = [item for pending in batch for item in pending.items]
        batch_id = uuid.uuid4().hex[:16]
        started = time.time()
        for pending in batch:
            self._metrics.queue_wait_seconds.labels(model=spec.name).observe(
                max(0.0, started - pending.request.published_at_ms / 1000)
            )
        params = batch[0].request.parameters

        preemptible = not any(pending.interactive for pending in batch)

        def on_step(step: int, total: int) -> None:
            self._progress.update(step, total)
            self._health.beat()
            if all(pending.abandoned() for pending in batch):
                raise BatchAbandonedError
            if preemptible and (self.stopping.is_set() or self._pool.first_interactive() is not None):
                raise BatchPreemptedError  # an interactive request waits, or the worker drains: hand them back

        self._progress.begin(batch, started)
        self._pool.interactive_running(not preemptible)
        began = time.perf_counter()
        previous_end = self._last_call_ended
        try:
            self.calls += 1
            images = runner.generate(items, params, on_step)
            if len(images) != len(items):
                raise RuntimeError(f"runner returned {len(images)} images for {len(items)} items")
        except BatchAbandonedError:
            log.warning("batch %s stopped: nobody waits for its %d requests any more", batch_id, len(batch))
            for pending in batch:
                self._answer_abandoned(pending, "while it ran")
            return
        except BatchPreemptedError:
            log.info("call %s of %d batch lines stopped for an interactive request; they run later", batch_id,
                     len(batch))  # fmt: skip
            self._pool.put_back(batch)
            return
        except Exception as exc:  # noqa: BLE001 - each request must still be answered or retried
            self._failed(batch, exc)
            return
        finally:
            self._last_call_ended = time.time()
            self._progress.end()
            self._pool.interactive_running(False)
        seconds = time.perf_counter() - began
        self._metrics.inference_seconds.labels(model=spec.name).observe(seconds)
        self._metrics.batch_size.labels(model=spec.name).observe(len(items))
        finished = time.time()
        offset = 0
        for pending in batch:
            fields = {
                "request_id": pending.request_id,
                "model": spec.name,
                "model_version": spec.version,
                "worker_id": self._replies.worker_id,
                "queue_ms": max(0.0, started * 1000 - pending.request.published_at_ms),
                "inference_ms": seconds * 1000,
                "batch_id": batch_id,
                "batch_size": len(items),
                "accelerator": runner.accelerator,
                "attempt": pending.message.delivery_attempt,
                "worker_started_ms": int(started * 1000),
                "worker_finished_ms": int(finished * 1000),
                "previous_call_ended_ms": _went_on_from(previous_end, pending),
            }
            if (skipped := getattr(runner, "steps_skipped", None)) is not None:
                fields["steps_skipped"] = skipped * pending.size  # the call's step cache decided for all its images
            self._finisher.finish(pending, images[offset : offset + pending.size], fields)
            offset += pending.size

    def _failed(self, batch: list[PendingRequest], exc: Exception) -> None:
        if len(batch) > 1:
            # One bad request must fail alone: run each on its own.
            log.warning("batch of %d failed (%s); running its requests one by one", len(batch), exc)
            for pending in batch:
                self.run_batch([pending])
            return
        self._fail_alone(batch[0], exc)

    def _fail_alone(self, pending: PendingRequest, exc: Exception) -> None:
        traced = {"fields": message_log_fields(pending.message)}  # this request's id and trace
        if isinstance(exc, ModelFailedError):
            log.error("inference failed for %s, for good: %s", pending.request_id, exc, extra=traced)
            self._answer_error(pending, "inference_failed", f"inference failed: {exc}")
            return
        if isinstance(exc, (ValueError, PayloadError)):
            log.warning("request %s cannot run: %s", pending.request_id, exc, extra=traced)
            self._answer_error(pending, "bad_input", f"cannot run this request: {exc}")
            return
        # Possibly transient (device error, out of memory): Pub/Sub retries it with backoff, and after the
        # catalog's max delivery attempts the dead-letter responder tells the client, with this cause. A batch line
        # (nobody waits on it) is run at most BATCH_LINE_RUNS times: a poison line does not hold a Spot GPU 5 times.
        cause = f"{type(exc).__name__}: {exc}"
        failures = self._finisher.note_failure(pending.request_id, cause)
        if pending.priority == "batch" and failures >= BATCH_LINE_RUNS:
            log.error("batch line %s failed %d runs, for good: %s", pending.request_id, failures, cause, extra=traced)
            self._answer_error(pending, "inference_failed", f"inference failed on {failures} runs: {cause}"[:1024])
            return
        log.exception(
            "inference failed for %s (attempt %d of %d); handing it back",
            pending.request_id,
            pending.message.delivery_attempt,
            pending.spec.max_delivery_attempts,
            exc_info=exc,
            extra=traced,
        )
        self._metrics.errors.labels(kind="inference_failed").inc()
        self._leases.release(pending.message)

    def _answer_error(self, pending: PendingRequest, kind: str, error: str) -> None:
        """Answers one request with an error now (no retry); `kind` is the reply's and the log row's error_kind."""
        self._metrics.errors.labels(kind=kind).inc()
        reply = self._replies.make(
            pending.spec, pending.request_id, pending.message, status="error", error_kind=kind, error=error
        )
        self._finisher.answer(pending.message, reply)

    def _answer_abandoned(self, pending: PendingRequest, when: str) -> None:
        if pending.cancelled:
            status, kind, error = "cancelled", "cancelled", f"cancelled {when}"
        else:
            status, kind, error = "expired", "expired", f"deadline passed {when}"
        reply = self._replies.make(pending.spec, pending.request_id, pending.message, status=status, error_kind=kind,
                                   error=error)  # fmt: skip
        self._finisher.answer(pending.message, reply)


def _went_on_from(previous_end: float | None, pending: PendingRequest) -> int | None:
    """The previous call's end (epoch ms) when `pending` was published before it: this worker went on from that
    call to this one, so the time between their ends is what a call costs it when busy; else None (it was idle)."""
    if previous_end is None or pending.request.published_at_ms > previous_end * 1000:
        return None
    return int(previous_end * 1000)
