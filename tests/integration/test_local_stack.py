"""The local stack as an operator runs it: `up` twice, a killed worker, emulator restarts, the bootstrap command.

Every command runs as `make` runs it (`python -m emulators.stack ...`) against the session's stack.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import requests

from emulators.processes import ProcessRegistry, http_probe
from emulators.stack import ROOT, SUPERVISOR, StackConfig
from tests.conftest import query_rows, wait_for

pytestmark = pytest.mark.stack


def stack_command(stack: StackConfig, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MAAS_STACK_DIR": str(stack.stack_dir), "MAAS_STACK_PORT_OFFSET": str(stack.port_offset)}
    return subprocess.run(
        [sys.executable, "-m", "emulators.stack", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def worker_readyz(stack: StackConfig, deployment: str) -> tuple[int, str]:
    index = list(stack.catalog().deployments()).index(deployment)
    return http_probe(f"http://127.0.0.1:{stack.worker_health_port(index)}/readyz", timeout=2)


def api_readyz(stack: StackConfig) -> tuple[int, str]:
    return http_probe(f"{stack.api_url}/readyz", timeout=5)


def everything_ready(stack: StackConfig) -> bool:
    return api_readyz(stack)[0] == 200 and all(
        worker_readyz(stack, deployment)[0] == 200 for deployment in stack.catalog().deployments()
    )


def predict_noop(stack: StackConfig, headers: dict, prompt: str) -> requests.Response:
    return requests.post(
        f"{stack.api_url}/v1/models/noop:predict", json={"instances": [{"prompt": prompt}]}, headers=headers, timeout=60
    )


def test_up_on_a_running_stack_says_so_and_leaves_it_serving(stack, auth_headers):
    registry = ProcessRegistry(stack.stack_dir)
    before = {name: registry.pid(name) for name in registry.names()}
    result = stack_command(stack, "up")
    assert result.returncode == 0, result.stderr
    assert "already up" in result.stderr
    assert stack.api_url in result.stdout and stack.api_keys.split(",")[0] in result.stdout
    assert {name: registry.pid(name) for name in registry.names()} == before
    assert predict_noop(stack, auth_headers, "after a second up").status_code == 200


def test_sigkilled_worker_is_restarted_by_the_supervisor_and_serves_again(stack, auth_headers):
    registry = ProcessRegistry(stack.stack_dir)
    victim = registry.pid("worker-synthetic")
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: registry.pid("worker-synthetic") != victim and registry.is_running("worker-synthetic"),
        timeout=20,
        what="the supervisor starts a new worker-synthetic",
    )
    wait_for(lambda: worker_readyz(stack, "synthetic")[0] == 200, timeout=60, what="the new worker is ready")
    assert predict_noop(stack, auth_headers, "after a kill").status_code == 200
    supervisor_log = registry.log_path(SUPERVISOR).read_text()
    # The stack's launcher forked it and reaped it: the supervisor says how it ended.
    assert "worker-synthetic was killed by signal 9; restarting in" in supervisor_log
    assert f"worker-synthetic restarted (pid {registry.pid('worker-synthetic')}" in supervisor_log


def test_pubsub_restart_makes_api_and_workers_unready_until_the_bootstrap(stack, auth_headers):
    restarted = stack_command(stack, "restart", "pubsub")
    assert restarted.returncode == 0, restarted.stderr
    assert "make bootstrap" in restarted.stderr
    try:
        # Until its client reconnects to the restarted emulator, the API may first say "pubsub unreachable": a
        # true answer for that moment. What is asserted is that it then names the missing topics.
        status, body = wait_for(
            lambda: (probe := api_readyz(stack))[0] == 503 and "pubsub topic" in probe[1] and probe,
            timeout=60,
            what="the API reports its topics missing",
        )
        assert "missing (run the bootstrap)" in body
        # The same for the worker: "pubsub unreachable" may come first; the missing subscription is then named.
        status, body = wait_for(
            lambda: (
                (probe := worker_readyz(stack, "synthetic"))[0] == 503
                and "subscription does not exist" in probe[1]
                and probe
            ),
            timeout=60,
            what="the worker reports its subscription missing",
        )
        assert "subscription does not exist (run the bootstrap)" in body
    finally:
        bootstrapped = stack_command(stack, "bootstrap")
    assert bootstrapped.returncode == 0, bootstrapped.stderr
    assert "maas-requests-noop-workers" in bootstrapped.stderr  # what it re-created, one line each
    wait_for(lambda: everything_ready(stack), timeout=120, what="the API and every worker are ready again")
    assert predict_noop(stack, auth_headers, "after the bootstrap").status_code == 200


def test_bigquery_restart_keeps_earlier_rows_and_new_rows_arrive(stack, auth_headers, settings, bigquery):
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"

    def rows_of(request_id: str, timeout: float) -> list[dict]:
        return query_rows(bigquery, f"SELECT status FROM {table} WHERE request_id = '{request_id}'", 1, timeout)

    before = predict_noop(stack, auth_headers, "before the restart").json()["request_id"]
    assert rows_of(before, timeout=30) == [{"status": "ok"}]
    restarted = stack_command(stack, "restart", "bigquery")
    assert restarted.returncode == 0, restarted.stderr
    assert rows_of(before, timeout=0) == [{"status": "ok"}]
    after = predict_noop(stack, auth_headers, "after the restart").json()["request_id"]
    assert rows_of(after, timeout=30) == [{"status": "ok"}]
    assert api_readyz(stack)[0] == 200
