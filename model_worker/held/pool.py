"""The requests a worker holds but has not started: at most about one batch, taken by priority, oldest first.

Pullers add what they pulled; the device loop takes the next batch: the oldest high-priority request (else
the oldest normal one, else the oldest batch line) and every held request that can share its pipeline call,
up to the model's `max_batch_size` images. For a step-scheduled model the device also takes joiners for its
running set between steps, in the same order. Holding no more than one batch beyond the running one is what
keeps a backlog in Pub/Sub, where an idle worker can take it, instead of in one worker's hands.

Batch lines (priority `batch`, issue 35) fill only what interactive traffic leaves: they are pulled only
while no interactive request is held and the pool is empty, at most one batch of them; held batch images
never count against an interactive pull's room, so a worker holding batch lines still takes an interactive
request at once, and that request is chosen first. A batch line never shares a call with an interactive
request: a call (or a step) of 8 images costs about twice one of 1 (README "GPU facts"), and the interactive
request would pay for it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from contract.messages import InferenceRequest
from contract.model_spec import ModelSpec
from contract.naming import PRIORITIES
from model_worker.model.runners import GenerationItem, batch_key


@dataclass(frozen=True)
class HeldMessage:
    """A pulled Pub/Sub message under this worker's lease."""

    subscription: str
    ack_id: str
    attributes: dict[str, str]
    data: bytes
    delivery_attempt: int
    received_at: float


@dataclass
class PendingRequest:
    """A decoded request ready to run: its message, its catalog entry and the images it asks for."""

    message: HeldMessage
    spec: ModelSpec
    request: InferenceRequest
    items: list[GenerationItem]
    priority: str
    deadline_ms: int | None
    cancelled: bool = field(default=False)
    # A flow's stage (model_worker/flows/stages.py `FlowRun`): where its output goes when it finishes; None otherwise.
    flow: Any = None

    def __post_init__(self) -> None:
        # A batch line's images say so to the runner: their step cache decides by the catalog's `batch_threshold`.
        if self.priority == "batch":
            self.items = [replace(item, batch_line=True) for item in self.items]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def size(self) -> int:
        return len(self.items)

    def expired(self, now: float | None = None) -> bool:
        return self.deadline_ms is not None and self.deadline_ms < (now or time.time()) * 1000

    def abandoned(self, now: float | None = None) -> bool:
        return self.cancelled or self.expired(now)

    @property
    def interactive(self) -> bool:
        """Somebody waits on it (high or normal); a batch line is only throughput."""
        return self.priority != "batch"

    @property
    def rank(self) -> int:
        """Its place in the device's order: high, normal, batch."""
        return PRIORITIES.index(self.priority) if self.priority in PRIORITIES else PRIORITIES.index("normal")

    @property
    def ready(self) -> bool:
        """Its adapters and control models (if any) are loaded, or failed to: it may run (or fail) now; until then
        it waits aside."""
        first = self.items[0] if self.items else None
        loading = (first.adapters, first.controls) if first is not None else ()
        return all(loaded is None or loaded.ready for loaded in loading)

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can run in one pipeline call (or, stepped, in one denoising call)."""
        params = self.request.parameters
        if self.spec.scheduling == "step":
            # Steps, guidance, strength and prompts are per item in a step; only the latent size must match.
            # Adapter sets never share a denoising call: diffusers activates one set per call (model_worker/adapters/lora.py).
            return (self.spec.queue, params.width, params.height, params.adapters)
        return (self.spec.queue, *batch_key(params), self.items[0].call_shape if self.items else ())


class RequestPool:
    """Bounded in images: normal pulls stop at `capacity` interactive images; high pulls may add up to `capacity` of
    their own; batch pulls take up to `capacity` only into an empty pool (held batch lines never shrink another
    priority's room)."""

    def __init__(self, capacity: int, batch_images: int | None = None) -> None:
        """`batch_images`: the most batch images held, or run at once (None: `capacity`). Small on an interactive
        worker: a batch call's start (prompt and image encoding) and decode cannot be cut short, and an interactive
        request arriving then waits for them; on a Spot batch worker, full batches."""
        self.capacity = capacity
        self.batch_images = min(capacity, batch_images or capacity)
        self._held: list[PendingRequest] = []
        self._changed = threading.Condition()
        self._closed = False
        self._interactive_running = False  # the device runs an interactive request: no batch line is pulled

    def _images(self, *priorities: str) -> int:
        return sum(p.size for p in self._held if not priorities or p.priority in priorities)

    def room(self, priority: str) -> int:
        with self._changed:
            return self._room(priority)

    def _room(self, priority: str) -> int:
        if self._closed:
            return 0
        if priority == "batch":
            # Idle capacity only: nothing held at all (a held interactive request waits for the device; held batch
            # lines are already the next batch) and no interactive request running, so batch lines are never leased
            # here while interactive work waits or runs: another worker, idle, takes them.
            return 0 if self._held or self._interactive_running else self.batch_images
        used = self._images("high") if priority == "high" else self._images("high", "normal")
        return max(0, self.capacity - used)

    def wait_for_room(self, priority: str, timeout: float) -> int:
        """Blocks until a pull of this priority may take something; returns how many images it may take."""
        with self._changed:
            self._changed.wait_for(lambda: self._room(priority) > 0 or self._closed, timeout)
            return self._room(priority)

    def add(self, pending: PendingRequest) -> None:
        with self._changed:
            self._held.append(pending)
            self._changed.notify_all()

    def take_batch(self, timeout: float) -> tuple[list[PendingRequest], list[PendingRequest]]:
        """(the next batch, requests found abandoned); both empty if nothing arrived within `timeout`."""
        with self._changed:
            # Requests still waiting for their adapters do not wake the device: it would find nothing to run.
            self._changed.wait_for(lambda: self._closed or any(p.ready or p.abandoned() for p in self._held), timeout)
            now = time.time()
            abandoned = [p for p in self._held if p.abandoned(now)]
            live = self._ordered(now)
            batch: list[PendingRequest] = []
            if live:
                first = live[0]
                limit, used = first.spec.max_batch_size, 0
                if not first.interactive:
                    limit = min(limit, self.batch_images)
                for candidate in live:
                    if candidate.interactive != first.interactive:
                        continue  # batch lines never share a call with interactive requests: they would slow it
                    if candidate.batch_key == first.batch_key and used + candidate.size <= limit:
                        batch.append(candidate)
                        used += candidate.size
            taken = {id(p) for p in batch + abandoned}
            self._held = [p for p in self._held if id(p) not in taken]
            self._changed.notify_all()
            return batch, abandoned

    def take_joiners(
        self, key: tuple, room: int, interactive: bool | None = None
    ) -> tuple[list[PendingRequest], list[PendingRequest]]:
        """(requests that join a running set with batch key `key` and `room` images free, abandoned ones); no wait.

        Taken in the device's order (high priority, then oldest), stopping at the first that cannot join: a
        request for another model or size is not overtaken forever, the running set drains and it goes next.
        `interactive`: True takes only high and normal requests, False only batch lines, None both.
        """
        with self._changed:
            now = time.time()
            abandoned = [p for p in self._held if p.abandoned(now)]
            joiners: list[PendingRequest] = []
            for candidate in self._ordered(now):
                if interactive is not None and candidate.interactive != interactive:
                    continue
                if candidate.batch_key != key or candidate.size > room:
                    break
                joiners.append(candidate)
                room -= candidate.size
            taken = {id(p) for p in joiners + abandoned}
            if taken:
                self._held = [p for p in self._held if id(p) not in taken]
                self._changed.notify_all()
            return joiners, abandoned

    def interactive_running(self, running: bool) -> None:
        """The device says whether it runs an interactive request now (batch pulls wait while it does)."""
        with self._changed:
            if running != self._interactive_running:
                self._interactive_running = running
                self._changed.notify_all()

    def first_interactive(self) -> PendingRequest | None:
        """The interactive request the device takes next, if one is held and ready: what a running set of batch
        lines makes room for."""
        with self._changed:
            return next((p for p in self._ordered(time.time()) if p.interactive), None)

    def put_back(self, pending: list[PendingRequest]) -> None:
        """Requests the device preempted before they finished (batch lines): held again, still leased, to start over."""
        with self._changed:
            self._held.extend(pending)
            self._changed.notify_all()

    def wake(self) -> None:
        """A held request's adapters became ready: it may start or join now."""
        with self._changed:
            self._changed.notify_all()

    def _ordered(self, now: float) -> list[PendingRequest]:
        """Live requests that can run now, in the device's order; one waiting for its adapters blocks nobody."""
        return sorted(
            (p for p in self._held if p.ready and not p.abandoned(now)),
            key=lambda p: (p.rank, p.message.received_at),
        )

    def close(self) -> list[PendingRequest]:
        """Stops intake and returns what was held, for the caller to hand back to the queue."""
        with self._changed:
            self._closed = True
            held, self._held = self._held, []
            self._changed.notify_all()
            return held

    def held(self) -> list[PendingRequest]:
        with self._changed:
            return list(self._held)
