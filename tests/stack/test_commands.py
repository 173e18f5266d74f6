"""The stack's commands where nothing runs, the make targets that call them, and what a restart starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from emulators.processes import ProcessRegistry
from emulators.stack import LOCAL_CATALOG_OVERLAY, ROOT, StackConfig, api_component, recorded_or, worker_components

# Nothing listens in these tests, but a stack directory records its ports: keep them this session's.
PORT_OFFSET = int(os.environ.get("MAAS_TEST_PORT_OFFSET", "10000"))


def stack_command(stack_dir, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MAAS_STACK_DIR": str(stack_dir), "MAAS_STACK_PORT_OFFSET": str(PORT_OFFSET)}
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
    config = StackConfig(stack_dir=tmp_path, port_offset=PORT_OFFSET, api_keys="k1,k2", api_keys_from_env=True)
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


def test_make_status_with_nothing_running_fails_with_the_status_the_docs_give(tmp_path):
    # make exits 2 whenever a command fails, whatever the command's own status: the local stack's page must say so.
    result = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "status"],
        cwd=ROOT,
        env={**os.environ, "MAAS_STACK_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Nothing is running" in result.stdout
    page = ROOT / "docs" / "getting-started" / "local-stack.md"
    [row] = [line for line in page.read_text().splitlines() if line.startswith("| `make status`")]
    promised = {int(code) for code in re.findall(r"`make status` exits (\d)", row)}
    assert promised == {2}, row
    assert "3 when nothing runs" in row  # `python -m emulators.stack status`, the command itself


def test_worker_probe_ports_follow_the_catalog_order(tmp_path):
    order: list[str] = []
    # The local overlay's `overrides` may put a production model in a worker group (the flows' groups).
    overrides = yaml.safe_load(LOCAL_CATALOG_OVERLAY.read_text()).get("overrides") or {}
    for path in (ROOT / "contract" / "models.yaml", LOCAL_CATALOG_OVERLAY):
        for name, entry in yaml.safe_load(path.read_text())["models"].items():
            spec = {**entry, **overrides.get(name, {})}
            # A version may name a worker group of its own (else the model's, else the model's name).
            for version in (spec.get("versions") or {"": {}}).values():
                if (deployment := version.get("worker_group") or spec.get("worker_group") or name) not in order:
                    order.append(deployment)
    config = StackConfig(stack_dir=tmp_path, port_offset=0, worker_replicas=2)
    ports = {worker.name: worker.port for worker in worker_components(config)}
    assert ports == {
        **{f"worker-{deployment}": 8091 + index for index, deployment in enumerate(order)},
        **{f"worker-{deployment}-2": 8091 + len(order) + index for index, deployment in enumerate(order)},
    }
    assert order[0] == "sd15"  # the first model of contract/models.yaml (sd15-txt2img), in its local worker group


def test_a_restarted_api_gets_the_recorded_environment_not_the_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("MAAS_STACK_DIR", str(tmp_path))
    monkeypatch.setenv("MAAS_RATE_LIMIT_PER_MINUTE", "7")
    monkeypatch.delenv("MAAS_CONCURRENCY_LIMIT", raising=False)
    StackConfig.from_env().save()  # what `make up` records
    # Later, another shell runs `make restart COMPONENT=api` with settings of its own.
    monkeypatch.setenv("MAAS_RATE_LIMIT_PER_MINUTE", "99")
    monkeypatch.setenv("MAAS_CONCURRENCY_LIMIT", "3")
    env = api_component(recorded_or(StackConfig.from_env())).env
    assert env["MAAS_RATE_LIMIT_PER_MINUTE"] == "7"
    assert "MAAS_CONCURRENCY_LIMIT" not in env
    assert env["PATH"] == os.environ["PATH"]  # the system's variables are the caller's
