"""A worker's SIGTERM handler drains once, off the interrupted thread, with its deadline armed first: a second
SIGTERM during the drain (the handler run again inside the first, as Python runs nested signal handlers) changed
nothing but a log line, where draining on the signal's own thread deadlocked on a lock the first handler held."""

from __future__ import annotations

import signal
import threading

from model_worker.serving.signals import DrainOnSignal


def test_a_second_signal_while_the_first_drains_neither_deadlocks_nor_drains_twice():
    pull_lock = threading.Lock()  # stands for a lock `stop` takes (a pull's), not reentrant
    calls: list[str] = []
    exits: list[int] = []

    def stop() -> None:
        with pull_lock:
            calls.append(threading.current_thread().name)
            handler(signal.SIGTERM)  # the second signal, delivered while the first drain holds the lock

    handler = DrainOnSignal(stop, drain_seconds=60, exit_now=exits.append)
    handler(signal.SIGTERM)
    handler.stopping.join(timeout=10)
    assert not handler.stopping.is_alive(), "the drain deadlocked on its own lock"
    assert calls == ["drain"]  # once, and not on the thread the signal interrupted
    assert exits == []  # the deadline is armed, not yet due


def test_the_deadline_ends_a_drain_that_hangs():
    ended = threading.Event()
    exits: list[int] = []

    def exit_now(code: int) -> None:
        exits.append(code)
        ended.set()

    handler = DrainOnSignal(threading.Event().wait, drain_seconds=0.2, exit_now=exit_now)  # a stop that never returns
    handler(signal.SIGINT)
    assert ended.wait(10) and exits == [1]
