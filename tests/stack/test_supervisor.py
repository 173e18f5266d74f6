"""The supervisor against real processes: an exited process comes back after a backoff, logged; locks and emulators."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest

from emulators.processes import ProcessRegistry
from emulators.supervisor import BACKOFF_MAX_SECONDS, Supervisor, backoff_seconds

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry(tmp_path):
    registry = ProcessRegistry(tmp_path)
    yield registry
    registry.stop_all()


@pytest.fixture
def supervised(registry, tmp_path):
    clock = Clock()
    start = lambda: registry.start("api", SLEEPER, dict(os.environ))  # noqa: E731
    start()
    supervisor = Supervisor(
        registry, {"api": start}, watched=["pubsub"], state_path=tmp_path / "state.json", clock=clock
    )
    return supervisor, clock


def kill(registry: ProcessRegistry, name: str) -> int:
    pid = registry.pid(name)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while registry.is_running(name):
        assert time.monotonic() < deadline, f"{name} survived SIGKILL"
        time.sleep(0.01)
    return pid


def test_backoff_doubles_up_to_a_ceiling():
    assert [backoff_seconds(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_seconds(50) == BACKOFF_MAX_SECONDS


def test_an_exited_process_is_restarted_after_its_backoff_and_the_restart_is_logged(registry, supervised, caplog):
    supervisor, clock = supervised
    caplog.set_level(logging.INFO, logger="emulators.supervisor")
    victim = kill(registry, "api")
    supervisor.check()
    assert "api exited; restarting in 1s (restart 1)" in caplog.text
    assert not registry.is_running("api")  # not before the backoff
    clock.now += 1.0
    supervisor.check()
    assert registry.is_running("api") and registry.pid("api") != victim
    assert f"api restarted (pid {registry.pid('api')}, restart 1)" in caplog.text
    assert '"restarts": 1' in (registry.pid_dir.parent / "state.json").read_text()


def test_a_process_that_keeps_dying_waits_longer_each_time(registry, supervised, caplog):
    supervisor, clock = supervised
    caplog.set_level(logging.INFO, logger="emulators.supervisor")
    for delay in (1, 2, 4):
        kill(registry, "api")
        supervisor.check()
        assert f"restarting in {delay}s" in caplog.text
        clock.now += delay
        supervisor.check()
        assert registry.is_running("api")
    assert supervisor.watches["api"].restarts == 3


def test_a_process_being_restarted_on_purpose_is_left_alone(registry, supervised, caplog):
    supervisor, clock = supervised
    with registry.lock("api"):
        kill(registry, "api")
        supervisor.check()
        clock.now += 60
        supervisor.check()
    assert "api" not in caplog.text and not registry.is_running("api")


def test_a_dead_emulator_is_reported_once_and_not_restarted(registry, supervised, caplog):
    supervisor, _ = supervised
    registry.start("pubsub", SLEEPER, dict(os.environ))
    kill(registry, "pubsub")
    supervisor.check()
    supervisor.check()
    assert caplog.text.count("pubsub is not running") == 1 and "make restart-pubsub" in caplog.text
    assert not registry.is_running("pubsub")


def test_the_exit_status_of_a_restarted_process_is_reported_as_it_was(registry, tmp_path, caplog):
    """The registry's liveness check reaps its children; the supervisor still reports how they ended (it said
    "exited with status 0" for every crash of a process it had restarted)."""
    clock = Clock()
    failing = [sys.executable, "-c", "import sys, time; time.sleep(1); sys.exit(3)"]
    start = lambda: registry.start("worker", failing, dict(os.environ))  # noqa: E731
    start()
    supervisor = Supervisor(registry, {"worker": start}, clock=clock)
    caplog.set_level(logging.INFO, logger="emulators.supervisor")
    for _ in range(2):  # the first exit is of a process `up` started; the second of the supervisor's own
        deadline = time.monotonic() + 10
        while registry.is_running("worker"):  # reaps it, as the supervisor's own checks do
            assert time.monotonic() < deadline
            time.sleep(0.05)
        supervisor.check()
        clock.now += BACKOFF_MAX_SECONDS
        supervisor.check()
    assert "worker exited; restarting in 1s" in caplog.text
    assert "worker exited with status 3; restarting in 2s" in caplog.text
    kill(registry, "worker")
    supervisor.check()
    assert "worker was killed by signal 9; restarting in 4s" in caplog.text
