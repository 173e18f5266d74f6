"""The stack's process registry: PID files, readiness waits with log tails, stopping whole process groups."""

from __future__ import annotations

import os
import sys

import pytest

from emulators.processes import ProcessRegistry, StartupError


def test_started_process_is_tracked_and_stopped_by_pid(tmp_path):
    registry = ProcessRegistry(tmp_path)
    registry.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    assert registry.is_running("sleeper") and registry.names() == ["sleeper"]
    registry.stop_all()
    assert not registry.is_running("sleeper") and registry.names() == []


def test_stop_reaches_the_children_of_a_process(tmp_path):
    registry = ProcessRegistry(tmp_path)
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    registry.start("parent", [sys.executable, "-c", script], dict(os.environ))
    pgid = registry.pid("parent")
    registry.stop("parent")
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_a_process_that_exits_during_startup_reports_its_log(tmp_path):
    registry = ProcessRegistry(tmp_path)
    registry.start(
        "broken", [sys.executable, "-c", "print('port already in use'); raise SystemExit(3)"], dict(os.environ)
    )
    with pytest.raises(StartupError, match="port already in use"):
        registry.wait_until("broken", lambda: False, timeout=10)
    registry.stop_all()


def test_starting_a_running_process_twice_is_refused(tmp_path):
    registry = ProcessRegistry(tmp_path)
    registry.start("once", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    try:
        with pytest.raises(StartupError, match="already running"):
            registry.start("once", [sys.executable, "-c", "pass"], dict(os.environ))
    finally:
        registry.stop_all()
