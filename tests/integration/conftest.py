"""Fixtures for the worker tests: a client on the worker's queues, and extra worker processes to kill."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator

import pytest

from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, worker_env
from tests.integration.worker_client import WorkerClient

_extra_index = itertools.count(40)


@pytest.fixture
def worker_client(stack, settings) -> Iterator[WorkerClient]:
    client = WorkerClient(settings)
    yield client
    client.close()


@pytest.fixture
def extra_worker(stack) -> Iterator[Callable[[str], str]]:
    """Starts another worker for a deployment, as the stack starts its own; stopped (by PID) after the test."""
    registry = ProcessRegistry(stack.stack_dir)
    started: list[str] = []

    def start(deployment: str = "synthetic") -> str:
        index = next(_extra_index)
        name = f"worker-{deployment}-extra-{index}"
        env = worker_env(stack, deployment, index)
        registry.start(name, [sys.executable, "-m", "model_worker"], env, cwd=ROOT)
        started.append(name)
        url = f"http://127.0.0.1:{stack.worker_health_port(index)}/readyz"
        # A bound for a hang, not a pace: on a busy host an SD worker took over 120 s to import and warm up.
        registry.wait_until(name, lambda: http_ok(url), timeout=300)
        return name

    yield start
    for name in started:
        registry.stop(name, timeout=30)


def extra_worker_port(stack, name: str) -> int:
    """The probe port of a worker `extra_worker` started (the index that picked it ends its name). Not read from
    /proc/PID/environ: a worker forked by the stack's launcher shows the launcher's environment there."""
    return stack.worker_health_port(int(name.rsplit("-", 1)[1]))
