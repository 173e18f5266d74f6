"""Keeps the stack's API and workers running as Kubernetes keeps pods: one that exits is started again after a backoff.

Emulators are watched but not restarted: losing one is an outage to see (and, in the chaos suite, to
cause on purpose); `python -m emulators.stack restart NAME` brings it back.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from emulators.processes import ProcessRegistry, exit_code

log = logging.getLogger("emulators.supervisor")

BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
# A process that stayed up this long has its backoff reset, as the kubelet does after a stable run.
STABLE_AFTER_SECONDS = 30.0
POLL_SECONDS = 0.5


@dataclass
class Watch:
    """What the supervisor knows about one process."""

    restarts: int = 0
    failures: int = 0  # consecutive exits without a stable run in between; sets the backoff
    last_exit: str = ""
    restart_at: float | None = None


def backoff_seconds(failures: int) -> float:
    return min(BACKOFF_FIRST_SECONDS * 2 ** max(failures - 1, 0), BACKOFF_MAX_SECONDS)


class Supervisor:
    """Restarts the processes in `starters` (name -> start function) when they exit; reports those in `watched`."""

    def __init__(
        self,
        registry: ProcessRegistry,
        starters: Mapping[str, Callable[[], subprocess.Popen | None]],
        watched: Sequence[str] = (),
        state_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._starters = dict(starters)
        self._watched = list(watched)
        self._state_path = state_path
        self._clock = clock
        self._watches = {name: Watch() for name in self._starters}
        self._children: dict[str, subprocess.Popen] = {}
        self._down_reported: set[str] = set()

    @property
    def watches(self) -> dict[str, Watch]:
        return self._watches

    def run(self, stop: threading.Event) -> None:
        log.info("supervising %s; watching %s", ", ".join(self._starters), ", ".join(self._watched) or "nothing else")
        while not stop.is_set():
            self.check()
            stop.wait(POLL_SECONDS)
        log.info("supervisor stopped")

    def check(self) -> None:
        changed = False
        for name in self._starters:
            changed |= self._check_one(name)
        for name in self._watched:
            self._report_watched(name)
        if changed:
            self._save_state()

    def _check_one(self, name: str) -> bool:
        watch = self._watches[name]
        if self._registry.is_running(name):
            uptime = self._registry.uptime(name) or 0.0
            if watch.failures and uptime >= STABLE_AFTER_SECONDS:
                watch.failures = 0
            watch.restart_at = None
            return False
        # Whoever holds the lock (a deliberate restart, `down`) is already starting or stopping it.
        if not self._registry.try_lock(name):
            return False
        try:
            if self._registry.is_running(name):
                return False
            now = self._clock()
            if watch.restart_at is None:
                watch.failures += 1
                watch.last_exit = self._exit_note(name)
                delay = backoff_seconds(watch.failures)
                watch.restart_at = now + delay
                log.warning(
                    "%s %s; restarting in %.0fs (restart %d). Last log lines:\n%s",
                    name,
                    watch.last_exit,
                    delay,
                    watch.restarts + 1,
                    self._registry.log_tail(name, lines=5),
                )
                return True
            if now < watch.restart_at:
                return False
            self._registry.stop(name, timeout=5)  # whatever is left of its process group
            watch.restart_at = None
            try:
                process = self._starters[name]()
            except Exception as exc:  # noqa: BLE001 - a failed start is one more failure, retried later
                watch.failures += 1
                watch.restart_at = now + backoff_seconds(watch.failures)
                log.error("%s failed to start: %s; next try in %.0fs", name, exc, backoff_seconds(watch.failures))
                return True
            if process is not None:
                self._children[name] = process
            watch.restarts += 1
            log.warning("%s restarted (pid %s, restart %d)", name, self._registry.pid(name), watch.restarts)
            return True
        finally:
            self._registry.unlock(name)

    def _exit_note(self, name: str) -> str:
        process = self._children.pop(name, None)
        code = exit_code(process) if process is not None else self._registry.exit_code_of(name)
        if code is None:
            return "exited"
        return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def _report_watched(self, name: str) -> None:
        if self._registry.pid(name) is None:
            return  # not part of this stack, or stopped on purpose
        if not self._registry.try_lock(name):
            return  # a deliberate restart is under way
        self._registry.unlock(name)
        if self._registry.is_running(name):
            if name in self._down_reported:
                log.info("%s is running again", name)
                self._down_reported.discard(name)
        elif name not in self._down_reported:
            log.error("%s is not running; emulators are not restarted automatically: make restart-%s", name, name)
            self._down_reported.add(name)

    def _save_state(self) -> None:
        if self._state_path is not None:
            state = {
                name: {k: v for k, v in asdict(w).items() if k != "restart_at"} for name, w in self._watches.items()
            }
            self._state_path.write_text(json.dumps(state, indent=2))


def load_state(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
