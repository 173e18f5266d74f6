"""The stack's worker launcher (emulators/launcher.py) forks a process that is what `Popen(start_new_session=True)`
would have started: its own session, environment, directory and log, a random state of its own, and an exit code
the supervisor can read; and the registry starts afresh whatever the launcher cannot take. The launcher here preloads
nothing (the stack's preloads torch and diffusers): what is tested is the fork and what the child is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from emulators import launcher, processes
from emulators.processes import ProcessRegistry
from emulators.stack import ROOT
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(not launcher.supported(), reason="the launcher forks on Linux only")
PROBE = [sys.executable, "-m", "tests.launched_probe"]


@pytest.fixture
def stack_dir(tmp_path) -> Path:
    """A stack directory with a launcher listening on it (stopped after the test)."""
    # numpy imported and drawn from before any fork, as in the stack's launcher (whose libraries import it).
    script = "import numpy, sys; numpy.random.random(); from pathlib import Path; from emulators.launcher import Launcher; Launcher(Path(sys.argv[1])).serve()"
    server = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        wait_for(lambda: launcher.ready(tmp_path) or server.poll() is not None, "the launcher listening", timeout=60)
        assert server.poll() is None, "the launcher exited"
        yield tmp_path
    finally:
        server.terminate()
        server.wait(10)


def probe_env(out: Path, **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "PROBE_OUT": str(out),
        "PROBE_MARKER": out.name,
        **extra,
    }


def facts(path: Path) -> dict:
    wait_for(path.exists, f"{path.name} written", timeout=30)
    return json.loads(path.read_text())


def test_a_launched_module_runs_in_its_own_session_directory_environment_and_log_and_its_exit_code_is_kept(
    stack_dir, tmp_path
):
    work = tmp_path / "work"
    work.mkdir()
    log, exit_file = tmp_path / "probe.log", tmp_path / "probe.exit"
    env = probe_env(tmp_path / "first.json", PROBE_EXIT="3")
    pid = launcher.launch(stack_dir, "tests.launched_probe", env, work, log, exit_file)
    assert pid is not None
    first = facts(tmp_path / "first.json")
    assert first["pid"] == pid and first["sid"] == pid, first  # a session (and process group) of its own
    assert first["cwd"] == str(work) and first["marker"] == "first.json" and first["name"] == "__main__", first
    wait_for(exit_file.exists, "the exit code written", timeout=30)
    assert exit_file.read_text().split() == [str(pid), "3"]
    assert "probe says hello" in log.read_text()
    # A second child draws its own random numbers, not the launcher's sequence again.
    launcher.launch(stack_dir, "tests.launched_probe", probe_env(tmp_path / "second.json", PROBE_EXIT="0"), work,
                    log, tmp_path / "second.exit")  # fmt: skip
    assert facts(tmp_path / "second.json")["draw"] != first["draw"]


def test_a_killed_child_is_reaped_with_its_signal_and_leaves_no_zombie(stack_dir, tmp_path):
    exit_file = tmp_path / "probe.exit"
    pid = launcher.launch(stack_dir, "tests.launched_probe", probe_env(tmp_path / "out.json"), tmp_path,
                          tmp_path / "probe.log", exit_file)  # fmt: skip
    facts(tmp_path / "out.json")
    os.kill(pid, signal.SIGKILL)
    wait_for(exit_file.exists, "the exit code written", timeout=30)
    assert exit_file.read_text().split() == [str(pid), "-9"]
    assert not Path(f"/proc/{pid}").exists()  # reaped, not a zombie


def test_the_registry_forks_through_the_launcher_and_starts_afresh_without_one(stack_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "LAUNCHED_MODULES", ("tests.launched_probe",))
    registry = ProcessRegistry(stack_dir)
    assert registry.start("probe", PROBE, probe_env(tmp_path / "launched.json"), cwd=ROOT) is None  # no Popen: forked
    launched = facts(tmp_path / "launched.json")
    assert registry.pid("probe") == launched["pid"] and registry.is_running("probe")
    assert registry.exit_code_of("probe", wait=0) is None  # running
    os.kill(launched["pid"], signal.SIGKILL)
    wait_for(lambda: not registry.is_running("probe"), "the probe gone", timeout=30)
    assert registry.exit_code_of("probe", wait=30) == -9  # what the supervisor's note says
    registry.stop("probe", timeout=10)
    assert registry.exit_code_of("probe", wait=0) is None  # forgotten with its PID file
    # Not a launched module, or no launcher listening: a fresh process, as before.
    other = ProcessRegistry(tmp_path / "no-launcher")
    process = other.start("probe", PROBE, probe_env(tmp_path / "fresh.json", PROBE_EXIT="0"), cwd=ROOT)
    assert process is not None and facts(tmp_path / "fresh.json")["pid"] == process.pid
    process.wait(30)
    assert other.exit_code_of("probe", wait=30) is None  # not launched: the Popen tells
    assert registry.start("exec", [sys.executable, "-c", "pass"], dict(os.environ)) is not None
