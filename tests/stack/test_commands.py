"""The stack's commands where nothing runs, and the make targets that call them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from emulators.processes import ProcessRegistry
from emulators.stack import ROOT, StackConfig


def stack_command(stack_dir, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MAAS_STACK_DIR": str(stack_dir), "MAAS_STACK_PORT_OFFSET": "31000"}
    return subprocess.run(
        [sys.executable, "-m", "emulators.stack", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_down_with_nothing_running_says_so(tmp_path):
    result = stack_command(tmp_path, "down")
    assert result.returncode == 0 and f"Nothing is running in {tmp_path}" in result.stdout


def test_status_with_nothing_running_says_so_and_fails(tmp_path):
    result = stack_command(tmp_path, "status")
    assert result.returncode == 3 and "Nothing is running" in result.stdout


def test_restart_of_an_unknown_component_names_the_known_ones(tmp_path):
    result = stack_command(tmp_path, "restart", "nonesuch")
    assert result.returncode == 1
    assert "unknown component 'nonesuch'" in result.stderr and "worker-synthetic" in result.stderr


def test_stale_pid_files_are_not_taken_for_running_processes(tmp_path):
    registry = ProcessRegistry(tmp_path)
    # This test's own PID with the wrong start time: a PID file left by a reboot, its number reused since.
    (registry.pid_dir / "api.pid").write_text(f"{os.getpid()} 1")
    assert not registry.is_running("api")
    result = stack_command(tmp_path, "down")
    assert "Nothing is running" in result.stdout and registry.names() == []


def test_settings_are_recorded_so_later_commands_act_on_the_stack_as_started(tmp_path):
    config = StackConfig(stack_dir=tmp_path, port_offset=31000, api_keys="k1,k2", api_keys_from_env=True)
    config.save()
    assert StackConfig.load(tmp_path) == config
    assert oct((tmp_path / "stack.json").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize(
    ("target", "command"),
    [
        ("up", "emulators.stack up"),
        ("run", "emulators.stack run"),
        ("down", "emulators.stack down"),
        ("status", "emulators.stack status"),
        ("bootstrap", "emulators.stack bootstrap"),
        ("restart-pubsub", "emulators.stack restart pubsub"),
        ("restart COMPONENT=worker-synthetic", "emulators.stack restart worker-synthetic"),
    ],
)
def test_make_targets_run_the_stack_commands(target, command):
    result = subprocess.run(["make", "-n", *target.split()], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert command in result.stdout
