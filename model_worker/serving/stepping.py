"""The step scheduler: a running set of requests sharing one denoising call per step, joined and left between steps.

For a model with `scheduling: step` the device loop keeps a running set (at most `max_batch_size` images
of one latent size) and advances it one model call at a time. A request that arrives while it runs joins
at the next step (at its own first timestep: image-to-image starts later in the schedule); a request whose
own last step is done leaves at once, decoded in one VAE call with those finishing at the same step, and
goes to the finisher; a cancelled or expired one leaves at the next step; the others go on undisturbed.
A failure in the shared call reruns that step request by request, so a bad request fails alone.

Batch lines (issue 35) only use a device nobody else wants: when an interactive request waits or runs, the
batch lines are paused (`pause_batch`): they leave the set with their denoising state, still leased, and are
resumed where they stopped (`resume`) once no interactive request waits or runs, before any new batch line
starts. A paused line is answered once, by the set it finishes in, or handed back unanswered on drain. Finished
batch lines are decoded one request a call, and the rest wait (finished, not stepped) as soon as an interactive
request waits (`interactive_waiting`): a full batch's decode (8 images at 512x512, about 4.6 s on an L4) would
otherwise hold the device from it; one line's decode is what it waits for at most. Likewise a set of batch lines
starts (encodes) one line at a time, and those not started go back to the pool when an interactive request waits.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from contract.step_cache import running_step_cache
from model_worker.held.pool import PendingRequest
from model_worker.model.runners import Runner, RunningItem
from model_worker.serving.health import WorkerHealth
from model_worker.serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RunningRequest:
    """One request in the running set: its images' denoising states and what its reply will say."""

    pending: PendingRequest
    items: list[RunningItem]
    joined: float = field(default_factory=time.time)
    began: float = field(default_factory=time.perf_counter)
    widest: int = 0  # the most images that shared a denoising call with it: its reply's batch_size

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.items)

    def free(self) -> None:
        """Drops its images' denoising state (latents, scheduler, step cache) at once: it will not step again."""
        for item in self.items:
            item.state.clear()

    @property
    def failure(self) -> Exception | None:
        return next((r.failure for r in self.items if r.failure is not None), None)

    def progress(self) -> tuple[int, int]:
        """(step, total) in the request's own terms: step i of the N steps it asked for (image-to-image: the share
        of them its strength runs, as `scheduling: request` reports it).

        A scheduler may run one more model call than asked (PNDM): the calls done are scaled to the requested
        count, so the total is always N and the step reaches N at the last call.
        """
        first = self.items[0]
        requested = first.requested or self.pending.request.parameters.num_inference_steps
        if first.done == 0:
            return 0, requested
        return max(1, first.done * requested // max(first.total, 1)), requested


# What the device loop does with a request the running set is done with.
Finish = Callable[[PendingRequest, list, dict], None]
Fail = Callable[[PendingRequest, Exception], None]
Abandon = Callable[[PendingRequest, str], None]


class RunningSet:
    """The step scheduler's running set on the device thread; `admit` between steps, `step` once per call."""

    def __init__(
        self,
        runners: dict[str, Runner],
        progress,
        metrics: WorkerMetrics,
        health: WorkerHealth,
        worker_id: str,
        finish: Finish,
        fail: Fail,
        abandon: Abandon,
    ) -> None:
        self._runners = runners
        self._progress = progress
        self._metrics = metrics
        self._health = health
        self._worker_id = worker_id
        self._finish, self._fail, self._abandon = finish, fail, abandon
        self._requests: list[RunningRequest] = []
        self.paused: list[RunningRequest] = []  # batch lines that left room for interactive requests
        self.key: tuple | None = None
        # The running set's id, the `batch_id` of every request that ran in it: kept while it is never empty.
        self.batch_id: str | None = None
        self.calls = 0
        # Set by the device loop: whether an interactive request waits for the device (batch lines' decodes stop),
        # and where batch lines not started yet go when one does (the pool: held again, still leased).
        self.interactive_waiting: Callable[[], bool] = lambda: False
        self.give_back: Callable[[list[PendingRequest]], None] | None = None

    def __bool__(self) -> bool:
        return bool(self._requests)

    @property
    def images(self) -> int:
        return sum(len(r.items) for r in self._requests)

    @property
    def room(self) -> int:
        if not self._requests:
            return 0
        return self._requests[0].pending.spec.max_batch_size - self.images

    def admit(self, joiners: list[PendingRequest]) -> None:
        """Prepares each joiner's images (prompt encoding, initial latents); they run from the next step. Batch lines
        start one at a time: once an interactive request waits, those not started go back (`give_back`)."""
        for index, pending in enumerate(joiners):
            if index and not pending.interactive and self.give_back is not None and self.interactive_waiting():
                self.give_back(joiners[index:])
                break
            runner = self._runners[pending.spec.queue]
            try:
                items = runner.start_items(pending.items, pending.request.parameters)
            except Exception as exc:  # noqa: BLE001 - e.g. an input the pipeline refuses: this request alone
                self._fail(pending, exc)
                continue
            if not self._requests:
                self.key, self.batch_id = pending.batch_key, uuid.uuid4().hex[:16]
            self._requests.append(RunningRequest(pending, items))
            self._metrics.queue_wait_seconds.labels(model=pending.spec.name).observe(
                max(0.0, time.time() - pending.request.published_at_ms / 1000)
            )
        self._metrics.running_images.set(self.images)

    @property
    def batch_images(self) -> int:
        return sum(len(r.items) for r in self._requests if not r.pending.interactive)

    @property
    def interactive_images(self) -> int:
        return self.images - self.batch_images

    def pause_batch(self) -> int:
        """Pauses every batch line in the set (interactive requests go on); returns the images paused."""
        lines = [r for r in self._requests if not r.pending.interactive]
        for request in lines:
            self._leave(request)
            self.paused.append(request)
        images = sum(len(r.items) for r in lines)
        if images:
            log.info("paused %d batch images for interactive work or a drain", images)
            self._metrics.running_images.set(self.images)
        return images

    def resume(self, images: int | None = None) -> int:
        """Brings paused batch lines back, oldest first, where they fit (an empty set takes the first one's size), up
        to `images` in the set; returns how many requests came back. They go on from the step they paused at."""
        resumed = 0
        for request in list(self.paused):
            key, size = request.pending.batch_key, len(request.items)
            if self._requests and (key != self.key or size > self.room):
                continue
            if self._requests and images is not None and self.images + size > images:
                continue
            self.paused.remove(request)
            if not self._requests:
                self.key, self.batch_id = key, uuid.uuid4().hex[:16]
            self._requests.append(request)
            resumed += 1
        if resumed:
            self._metrics.running_images.set(self.images)
        return resumed

    def take_paused(self) -> list[PendingRequest]:
        """Empties the paused list (a draining worker hands these back to Pub/Sub unanswered)."""
        paused, self.paused = [r.pending for r in self.paused], []
        return paused

    def step(self) -> None:
        """Drops the abandoned, runs one denoising call for the rest, and hands the finished to the finisher."""
        for request in [r for r in self._requests if r.pending.abandoned()]:
            self._leave(request)
            request.free()
            self._abandon(request.pending, "while it ran")
        for request in [r for r in self.paused if r.pending.abandoned()]:
            self.paused.remove(request)
            request.free()
            self._abandon(request.pending, "while it was paused")
        if self._requests:
            spec = self._requests[0].pending.spec
            model = spec.name
            runner = self._runners[spec.queue]  # runners are keyed by the unit's queue: `{model}--{version}`
            # Batch lines left finished by an earlier turn (their decode gave way) are decoded, not stepped.
            stepping = [r for r in self._requests if not r.finished]
            images = sum(len(r.items) for r in stepping)
            if stepping:
                self._denoise(runner, stepping)
                self.calls += 1
                self._metrics.step_images.labels(model=model).observe(images)
                self._health.beat()
            for request in stepping:
                request.widest = max(request.widest, images)
            for request in [r for r in self._requests if r.failure is not None]:
                self._leave(request)
                self._fail(request.pending, request.failure)
            # Those finishing now are in this report too: their last step shows as N of N.
            self._progress.running([(r.pending, *r.progress(), images) for r in self._requests])
            finished = [r for r in self._requests if r.finished]
            interactive = [r for r in finished if r.pending.interactive]
            if interactive:
                self._decode_and_finish(runner, interactive)
            for request in [r for r in finished if not r.pending.interactive]:
                if self.interactive_waiting():
                    break  # the rest are decoded later, paused with the other lines meanwhile
                self._decode_and_finish(runner, [request])
        else:
            self._progress.running([])
        self._metrics.running_images.set(self.images)

    def _denoise(self, runner: Runner, requests: list[RunningRequest]) -> None:
        try:
            runner.denoise_step([item for r in requests for item in r.items])
            return
        except Exception as exc:  # noqa: BLE001 - nothing stepped: find who fails by stepping each alone
            if len(requests) == 1:
                request = requests[0]
                self._leave(request)
                self._fail(request.pending, exc)
                return
            log.warning("step of %d requests failed (%s); stepping them one by one", len(requests), exc)
        for request in list(requests):
            try:
                runner.denoise_step(request.items)
            except Exception as exc:  # noqa: BLE001 - this one fails alone
                self._leave(request)
                self._fail(request.pending, exc)

    def _decode_and_finish(self, runner: Runner, finished: list[RunningRequest]) -> None:
        try:
            images = runner.decode([item for r in finished for item in r.items])
        except Exception as exc:  # noqa: BLE001 - decode each on its own so one bad request fails alone
            if len(finished) == 1:
                self._leave(finished[0])
                self._fail(finished[0].pending, exc)
                return
            for request in finished:
                self._decode_and_finish(runner, [request])
            return
        ended = time.time()
        offset = 0
        for request in finished:
            self._leave(request)
            pending, count = request.pending, len(request.items)
            fields = {
                "request_id": pending.request_id,
                "model": pending.spec.name,
                "model_version": pending.spec.version,
                "worker_id": self._worker_id,
                "queue_ms": max(0.0, request.joined * 1000 - pending.request.published_at_ms),
                "inference_ms": (time.perf_counter() - request.began) * 1000,
                "batch_id": self.batch_id,
                "batch_size": request.widest,
                "accelerator": runner.accelerator,
                "attempt": pending.message.delivery_attempt,
                "worker_started_ms": int(request.joined * 1000),
                "worker_finished_ms": int(ended * 1000),
            }
            if running_step_cache(pending.spec.step_cache, pending.request.parameters.step_cache) is not None:
                fields["steps_skipped"] = sum(item.skipped for item in request.items)
            self._metrics.inference_seconds.labels(model=pending.spec.name).observe(fields["inference_ms"] / 1000)
            self._finish(pending, images[offset : offset + count], fields)
            offset += count

    def drop_all(self) -> list[PendingRequest]:
        """Empties the set and returns its requests, for the device loop to answer after an error of its own."""
        dropped = [r.pending for r in self._requests + self.paused]
        self._requests.clear()
        self.paused.clear()
        self.key = None
        self._metrics.running_images.set(0)
        return dropped

    def _leave(self, request: RunningRequest) -> None:
        self._requests.remove(request)
        if not self._requests:
            self.key = None  # the batch id stays until the next request starts a new set
