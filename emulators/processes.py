"""Starts background processes with a PID file and a log each, waits for them, stops them by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path


class StartupError(RuntimeError):
    """A process did not become ready; the message ends with the tail of its log."""


class ProcessRegistry:
    """Processes of one stack, tracked by PID files under `<stack_dir>/pids`."""

    def __init__(self, stack_dir: Path) -> None:
        self.pid_dir = stack_dir / "pids"
        self.log_dir = stack_dir / "logs"
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        if self.is_running(name):
            raise StartupError(f"{name} is already running (pid {self.pid(name)}); run `make down` first")
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - handed to the child process
        # A session of its own, so stopping the stack also stops the process's children (e.g. Java).
        process = subprocess.Popen(
            list(argv), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        (self.pid_dir / f"{name}.pid").write_text(str(process.pid))
        return process

    def pid(self, name: str) -> int | None:
        path = self.pid_dir / f"{name}.pid"
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def is_running(self, name: str) -> bool:
        pid = self.pid(name)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return not _is_zombie(pid)

    def names(self) -> list[str]:
        return sorted(path.stem for path in self.pid_dir.glob("*.pid"))

    def stop(self, name: str, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it has not exited within `timeout`."""
        pid = self.pid(name)
        if pid is not None:
            _signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                _signal_group(pid, signal.SIGKILL)
                while _alive(pid) and time.monotonic() < deadline + 5:
                    time.sleep(0.05)
        (self.pid_dir / f"{name}.pid").unlink(missing_ok=True)

    def stop_group(self, names: Sequence[str], timeout: float = 15.0) -> None:
        """SIGTERM every process in `names` at once, then wait for them together."""
        pids = {name: self.pid(name) for name in names}
        for pid in filter(None, pids.values()):
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(pid and _alive(pid) for pid in pids.values()):
            time.sleep(0.05)
        for name in names:
            self.stop(name, timeout=0)

    def stop_all(self, stages: Sequence[Sequence[str]] = ()) -> None:
        """Stop stage by stage (dependents before what they depend on), then anything left."""
        for stage in [*stages, self.names()]:
            self.stop_group([name for name in stage if self.pid(name) is not None])

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def wait_until(self, name: str, probe: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running(name):
                raise StartupError(f"{name} exited during start-up:\n{self.log_tail(name)}")
            if probe():
                return
            time.sleep(0.2)
        raise StartupError(f"{name} not ready after {timeout:.0f}s:\n{self.log_tail(name)}")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap our own children so they do not linger as zombies
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _is_zombie(pid)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def redis_ok(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
