"""The local stack's worker launcher: one process that imports torch and diffusers once, then forks each worker.

A diffusion worker spends almost all of its start importing torch, diffusers and transformers (about 87% of a
tiny SD 1.5 worker's 7.5 s of CPU, sampled). A stack starts a dozen of them, its tests start more (extra workers,
restarts after kills), and two test stacks start theirs at once on two cores. Forked from a process that has
imported them, a worker starts with them in memory: it pays only for its own modules and its models.

The launcher forks before any thread of its own, channel or model exists (the fork server pattern of
multiprocessing), and only for `python -m <module>` on the launcher's own interpreter, on Linux. Everything else, and
any launch the launcher cannot answer (not started yet, gone, busy past the timeout), starts as a fresh process
(`ProcessRegistry.start`): the launcher makes starts cheaper, never possible.

Each child is what `subprocess.Popen(start_new_session=True)` would start: a session of its own, its log on stdout
and stderr, its working directory and environment (read by the worker at run time; the preloaded libraries read
theirs at import, so the launcher starts with the environment a worker gets). The launcher reaps its children and
writes each exit code (negative: the signal) to the exit file the launch named, for the supervisor's restart notes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import runpy
import signal
import socket
import sys
import traceback
from pathlib import Path

# What the children share: the libraries every diffusion worker imports, and the pipeline classes diffusers
# imports lazily on first use (a worker's `from_pretrained` otherwise imports its family's modules itself).
PRELOADED_MODULES = ("torch", "transformers", "diffusers", "google.cloud.pubsub_v1", "google.cloud.storage",
                     "google.cloud.bigquery", "redis", "PIL.Image", "numpy", "safetensors.torch")  # fmt: skip
PRELOADED_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline",
                       "FluxPipeline", "AutoPipelineForText2Image")  # fmt: skip
LAUNCH_TIMEOUT_SECONDS = 10.0


def address(stack_dir: Path) -> str:
    """The launcher's socket, in Linux's abstract namespace: no path length limit, nothing left behind."""
    digest = hashlib.sha256(str(Path(stack_dir).resolve()).encode()).hexdigest()[:16]
    return f"\0maas-launcher-{digest}"


def supported() -> bool:
    """Forking a process that has imported torch is what multiprocessing does on Linux; macOS forbids it in effect."""
    return sys.platform == "linux"


def module_of(argv: list[str] | tuple[str, ...]) -> str | None:
    """The module of a `<this python> -m <module>` command line, the only kind the launcher starts."""
    if len(argv) == 3 and argv[1] == "-m" and os.path.realpath(argv[0]) == os.path.realpath(sys.executable):
        return argv[2]
    return None


def launch(
    stack_dir: Path, module: str, env: dict[str, str], cwd: Path | None, log: Path, exit_file: Path
) -> int | None:
    """Asks the stack's launcher to fork `python -m module`; its pid, or None where the launcher cannot (the
    caller starts the process itself)."""
    request = {"module": module, "env": env, "cwd": str(cwd or os.getcwd()), "log": str(log), "exit": str(exit_file)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(LAUNCH_TIMEOUT_SECONDS)
            connection.connect(address(stack_dir))
            connection.sendall(json.dumps(request).encode() + b"\n")
            with connection.makefile("rb") as reply:
                return int(json.loads(reply.readline())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ready(stack_dir: Path) -> bool:
    """Whether the launcher accepts launches (it listens only once its imports are done)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(1.0)
        try:
            connection.connect(address(stack_dir))
        except OSError:
            return False
    return True


def preload(modules: tuple[str, ...] = PRELOADED_MODULES, pipelines: tuple[str, ...] = PRELOADED_PIPELINES) -> None:
    import importlib

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import, as model_worker's main sets it before its own
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a library not installed is imported by the worker, or not needed
            print(f"launcher: not preloaded {name}: {exc}", file=sys.stderr)
    if "diffusers" in sys.modules:
        for name in pipelines:
            with contextlib.suppress(Exception):
                getattr(sys.modules["diffusers"], name)


class Launcher:
    """Accepts launches on the stack's socket, forks each, and reaps the children (their exit codes to files)."""

    def __init__(self, stack_dir: Path) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address(stack_dir))
        self._exit_files: dict[int, str] = {}
        self._exited: dict[int, int] = {}  # reaped before their launch was recorded

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, self._reap)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        self._listener.listen(64)
        print(f"launcher: ready, pid {os.getpid()}", file=sys.stderr, flush=True)
        while True:
            connection, _ = self._listener.accept()
            with connection:
                try:
                    connection.settimeout(LAUNCH_TIMEOUT_SECONDS)
                    with connection.makefile("rb") as lines:
                        line = lines.readline()
                    if not line:
                        continue  # a readiness probe: connected, nothing asked
                    request = json.loads(line)
                    pid = self._fork(request, connection)
                    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except (OSError, ValueError, KeyError) as exc:
                    print(f"launcher: a launch failed: {exc!r}", file=sys.stderr, flush=True)

    def _fork(self, request: dict, connection: socket.socket) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._listener.close()
            connection.close()
            run_child(request)  # never returns
        self._exit_files[pid] = request["exit"]
        if pid in self._exited:
            self._record(pid, self._exited.pop(pid))
        return pid

    def _reap(self, *_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if pid in self._exit_files:
                self._record(pid, code)
            else:
                self._exited[pid] = code

    def _record(self, pid: int, code: int) -> None:
        with contextlib.suppress(OSError):
            Path(self._exit_files.pop(pid)).write_text(f"{pid} {code}\n")


def run_child(request: dict) -> None:
    """In the forked child: becomes the process `Popen` would have started, runs the module, exits with its code."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        code = _run_module(request["module"])
    except BaseException:  # noqa: BLE001 - whatever it was, the child ends here with its trace in its log
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_module(module: str) -> int:
    import atexit

    sys.argv = [module]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()  # what the interpreter's exit would run (os._exit skips it)
    return code


def _reseed() -> None:
    """numpy's global random state, seeded once in the launcher, would otherwise be every child's same sequence
    (Python's `random` reseeds itself in a forked child)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m emulators.launcher <stack dir>", file=sys.stderr)
        return 2
    stack_dir = Path(sys.argv[1])
    preload()
    Launcher(stack_dir).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
