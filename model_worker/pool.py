"""The requests a worker holds but has not started: at most about one batch, taken high priority and oldest first.

Pullers add what they pulled; the device loop takes the next batch: the oldest high-priority request (else
the oldest normal one) and every held request that can share its pipeline call, up to the model's
`max_batch_size` images. For a step-scheduled model the device also takes joiners for its running set
between steps, in the same order. Holding no more than one batch beyond the running one is what keeps a
backlog in Pub/Sub, where an idle worker can take it, instead of in one worker's hands.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from contract.catalog import ModelSpec
from contract.messages import InferenceRequest
from model_worker.runners import GenerationItem, batch_key


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
    # A flow's stage (model_worker/flows.py `FlowRun`): where its output goes when it finishes; None otherwise.
    flow: Any = None

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
    def ready(self) -> bool:
        """Its adapters (if any) are loaded, or failed to: it may run (or fail) now; until then it waits aside."""
        adapters = self.items[0].adapters if self.items else None
        return adapters is None or adapters.ready

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can run in one pipeline call (or, stepped, in one denoising call)."""
        params = self.request.parameters
        if self.spec.scheduling == "step":
            # Steps, guidance, strength and prompts are per item in a step; only the latent size must match.
            # Adapter sets never share a denoising call: diffusers activates one set per call (model_worker/lora.py).
            return (self.spec.queue, params.width, params.height, params.adapters)
        return (self.spec.queue, *batch_key(params), self.items[0].call_shape if self.items else ())


class RequestPool:
    """Bounded in images: normal pulls stop at `capacity`; high pulls may add up to `capacity` of their own."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: list[PendingRequest] = []
        self._changed = threading.Condition()
        self._closed = False

    def _images(self, priority: str | None = None) -> int:
        return sum(p.size for p in self._held if priority is None or p.priority == priority)

    def room(self, priority: str) -> int:
        with self._changed:
            return self._room(priority)

    def _room(self, priority: str) -> int:
        if self._closed:
            return 0
        used = self._images("high") if priority == "high" else self._images()
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
                for candidate in live:
                    if candidate.batch_key == first.batch_key and used + candidate.size <= limit:
                        batch.append(candidate)
                        used += candidate.size
            taken = {id(p) for p in batch + abandoned}
            self._held = [p for p in self._held if id(p) not in taken]
            self._changed.notify_all()
            return batch, abandoned

    def take_joiners(self, key: tuple, room: int) -> tuple[list[PendingRequest], list[PendingRequest]]:
        """(requests that join a running set with batch key `key` and `room` images free, abandoned ones); no wait.

        Taken in the device's order (high priority, then oldest), stopping at the first that cannot join: a
        request for another model or size is not overtaken forever, the running set drains and it goes next.
        """
        with self._changed:
            now = time.time()
            abandoned = [p for p in self._held if p.abandoned(now)]
            joiners: list[PendingRequest] = []
            for candidate in self._ordered(now):
                if candidate.batch_key != key or candidate.size > room:
                    break
                joiners.append(candidate)
                room -= candidate.size
            taken = {id(p) for p in joiners + abandoned}
            if taken:
                self._held = [p for p in self._held if id(p) not in taken]
                self._changed.notify_all()
            return joiners, abandoned

    def wake(self) -> None:
        """A held request's adapters became ready: it may start or join now."""
        with self._changed:
            self._changed.notify_all()

    def _ordered(self, now: float) -> list[PendingRequest]:
        """Live requests that can run now, in the device's order; one waiting for its adapters blocks nobody."""
        return sorted(
            (p for p in self._held if p.ready and not p.abandoned(now)),
            key=lambda p: (p.priority != "high", p.message.received_at),
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
