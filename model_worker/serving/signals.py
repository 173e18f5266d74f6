"""What a worker does on SIGTERM or SIGINT: drain once, bounded by a deadline, off the interrupted thread.

A Python signal handler runs on the main thread between two bytecodes of whatever that thread was doing, and a
second signal runs it again inside the first. Draining right there deadlocked a worker that got two SIGTERMs: the
second handler waited for a pull lock the first one held, on the same thread, and the drain's deadline was never
armed. So the handler only arms the deadline and starts the drain on a thread of its own, and a repeated signal
changes nothing."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("model_worker")


class DrainOnSignal:
    """A signal handler: the first signal starts `stop` and the deadline, later ones are only logged."""

    def __init__(self, stop: Callable[[], None], drain_seconds: float, exit_now: Callable[[int], None] = os._exit):
        self._stop = stop
        self._drain_seconds = drain_seconds
        self._exit_now = exit_now
        self._started = threading.Event()
        self.stopping: threading.Thread | None = None

    def __call__(self, signum: int, _frame=None) -> None:
        if self._started.is_set():
            log.info("signal %d: already draining", signum)
            return
        self._started.set()
        log.info("signal %d: draining (at most %ds)", signum, self._drain_seconds)
        # Armed first: whatever the drain meets, the process ends by its deadline.
        deadline = threading.Timer(self._drain_seconds, self._exit_now, args=(1,))
        deadline.daemon = True
        deadline.start()
        # Stop pulling; the running batch finishes and is answered, held requests go back to the queue.
        self.stopping = threading.Thread(target=self._stop, name="drain", daemon=True)
        self.stopping.start()
