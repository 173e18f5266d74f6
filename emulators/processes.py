"""Starts background processes with a PID file and a log each, waits for them, stops them by PID."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from emulators import launcher

# The commands the stack's launcher forks instead of starting afresh: the diffusion workers (`python -m model_worker`),
# whose start is mostly importing what the launcher has imported already.
LAUNCHED_MODULES = ("model_worker",)


class StartupError(RuntimeError):
    """A process did not become ready; the message ends with the tail of its log."""


class ProcessRegistry:
    """Processes of one stack, tracked by PID files under `<stack_dir>/pids`.

    A PID file holds the process id and its kernel start time, so a PID file left behind by a reboot
    or a crash never makes us signal an unrelated process that was given the same id.
    """

    def __init__(self, stack_dir: Path) -> None:
        self.pid_dir = stack_dir / "pids"
        self.log_dir = stack_dir / "logs"
        self.lock_dir = stack_dir / "locks"
        self._locks: dict[str, object] = {}
        for directory in (self.pid_dir, self.log_dir, self.lock_dir):
            directory.mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _pid_path(self, name: str) -> Path:
        return self.pid_dir / f"{name}.pid"

    def start(
        self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen | None:
        """Starts `argv` in a session of its own (so stopping it also stops its children, e.g. Java), its output to
        its log. A worker is forked by the stack's launcher where one runs (emulators/launcher.py): then there is no
        Popen (None), and `exit_code_of` reads how it ended."""
        if self.is_running(name):
            raise StartupError(f"{name} is already running (pid {self.pid(name)}); run `make down` first")
        self._exit_path(name).unlink(missing_ok=True)
        process = None
        pid = self._launch(name, argv, env, cwd)
        if pid is None:
            log = open(self.log_path(name), "ab")  # noqa: SIM115 - handed to the child process
            process = subprocess.Popen(
                list(argv), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            log.close()
            pid = process.pid
        launched = " launched" if process is None else ""
        self._pid_path(name).write_text(f"{pid} {_start_time(pid) or '-'}{launched}")
        return process

    def _launch(self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path | None) -> int | None:
        module = launcher.module_of(list(argv))
        if module not in LAUNCHED_MODULES or not launcher.supported():
            return None
        return launcher.launch(self.pid_dir.parent, module, env, cwd, self.log_path(name), self._exit_path(name))

    def _exit_path(self, name: str) -> Path:
        return self.pid_dir / f"{name}.exit"

    def exit_code_of(self, name: str, wait: float = 1.0) -> int | None:
        """How a launched process that has ended ended (negative: the signal): its launcher reaps it within
        milliseconds, so this waits up to `wait` seconds for the code. None when unknown (not launched, or its
        launcher gone)."""
        record = self._record(name)
        if record is None or not self._pid_path(name).read_text().endswith(" launched"):
            return None
        deadline = time.monotonic() + wait
        while True:
            with contextlib.suppress(OSError, ValueError):
                pid, code = self._exit_path(name).read_text().split()
                if int(pid) == record[0]:
                    return int(code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _record(self, name: str) -> tuple[int, str | None] | None:
        try:
            fields = self._pid_path(name).read_text().split()
            return int(fields[0]), (fields[1] if len(fields) > 1 and fields[1] != "-" else None)
        except (FileNotFoundError, ValueError, IndexError):
            return None

    def pid(self, name: str) -> int | None:
        record = self._record(name)
        return record[0] if record else None

    def is_running(self, name: str) -> bool:
        record = self._record(name)
        if record is None:
            return False
        pid, started = record
        return _alive(pid) and (started is None or _start_time(pid) == started)

    def uptime(self, name: str) -> float | None:
        """Seconds since the process was started (its PID file was written)."""
        try:
            return time.time() - self._pid_path(name).stat().st_mtime
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        return sorted(path.stem for path in self.pid_dir.glob("*.pid"))

    def forget(self, name: str) -> None:
        self._pid_path(name).unlink(missing_ok=True)

    def _group(self, name: str) -> int | None:
        """The process group to signal: the recorded one, unless its PID now belongs to someone else."""
        record = self._record(name)
        if record is None:
            return None
        pid, started = record
        if _alive(pid) and started is not None and _start_time(pid) != started:
            return None  # the id was reused by an unrelated process
        return pid

    def stop(self, name: str, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL it if anything in it is left after `timeout`."""
        self.stop_group([name], timeout)

    def stop_group(self, names: Sequence[str], timeout: float = 15.0) -> None:
        """SIGTERM every process group in `names` at once, wait for them together, SIGKILL what is left."""
        groups = [group for group in map(self._group, names) if group is not None]
        for group in groups:
            _signal_group(group, signal.SIGTERM)
        _wait_gone(groups, timeout)
        for group in groups:
            if _group_exists(group):
                _signal_group(group, signal.SIGKILL)
        _wait_gone(groups, 5.0)
        for name in names:
            self.forget(name)

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

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float = 120.0) -> Iterator[None]:
        """Held by whoever stops or starts `name` (a restart, the supervisor), so they never race."""
        if not self.try_lock(name, timeout):
            raise StartupError(f"{name} is being started or stopped by another command")
        try:
            yield
        finally:
            self.unlock(name)

    def try_lock(self, name: str, timeout: float = 0.0) -> bool:
        handle = open(self.lock_dir / f"{name}.lock", "a")  # noqa: SIM115 - held until unlock()
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._locks[name] = handle
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.close()
                    return False
                time.sleep(0.1)

    def unlock(self, name: str) -> None:
        handle = self._locks.pop(name, None)
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1].startswith("Z")
    except OSError:
        return False


# How the children `_alive` reaped ended (pid -> exit code, negative for a signal): once reaped, their Popen can
# no longer tell (`poll()` answers 0 for a child someone else waited for), so `exit_code` asks here first.
_reaped: dict[int, int] = {}


def exit_code(process: subprocess.Popen) -> int | None:
    """The process's exit code (negative: the signal that killed it), None while it runs."""
    if _alive(process.pid):
        return None
    if process.pid in _reaped:
        process.returncode = _reaped.pop(process.pid)
        return process.returncode
    return process.poll()


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        reaped, status = os.waitpid(pid, os.WNOHANG)  # reap our own children so they do not linger as zombies
        if reaped:
            _reaped[reaped] = os.waitstatus_to_exitcode(status)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _group_exists(group: int) -> bool:
    """Whether any live process remains in the group (its leader may be gone, or a zombie)."""
    _alive(group)  # reaps the leader if it is our child
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg succeeds while only zombies are left; look for a member that is still running.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def _wait_gone(groups: Sequence[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_group_exists(group) for group in groups):
        time.sleep(0.05)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    return 200 <= http_probe(url, timeout)[0] < 300


def http_probe(url: str, timeout: float = 1.0) -> tuple[int, str]:
    """(status, first line of the body); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
            return response.status, response.read(2000).decode(errors="replace").strip()
    except urllib.error.HTTPError as error:
        try:
            return error.code, error.read(2000).decode(errors="replace").strip()
        except OSError:  # the status came, its body did not in time (a loaded machine): the status is the answer
            return error.code, ""
    except (urllib.error.URLError, OSError, ValueError) as error:
        return 0, f"not answering ({type(getattr(error, 'reason', error)).__name__})"


def redis_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_port_free(port: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not port_free(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True
