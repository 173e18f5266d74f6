"""Step scheduling in the real worker process: SIGTERM while a running set is mid-run loses nothing."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from emulators.processes import ProcessRegistry
from emulators.stack import local_catalog
from tests.integration.conftest import extra_worker_port

pytestmark = pytest.mark.stack
TXT2IMG = "sd15-txt2img"  # `scheduling: step` in the catalog


def running_images(port: int) -> float:
    body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    line = next(line for line in body.splitlines() if line.startswith("maas_worker_running_images "))
    return float(line.split()[1])


def test_sigterm_finishes_the_running_set_and_hands_the_rest_back(stack, worker_client, extra_worker):
    name = extra_worker(local_catalog(test_fixtures=True).get(TXT2IMG).deployment)  # its worker group locally
    registry = ProcessRegistry(stack.stack_dir)
    pid = registry.pid(name)
    port = extra_worker_port(stack, name)
    # More than the stack's own worker holds (a running set and a full pool: 16), so this one runs some.
    sent = [worker_client.send(TXT2IMG, f"drain {i}", seed=i, steps=25, timeout=90) for i in range(20)]
    deadline = time.monotonic() + 60
    while running_images(port) == 0:
        assert time.monotonic() < deadline, "the extra worker never started a running set"
        time.sleep(0.05)
    signalled_ms = time.time() * 1000  # before the signal: what finishes after it ran during the drain
    os.kill(pid, signal.SIGTERM)
    while registry.is_running(name) and time.monotonic() < deadline + 60:
        time.sleep(0.1)
    assert not registry.is_running(name), "the worker did not exit after finishing its running set"
    replies = worker_client.wait(sent, timeout=90)
    assert {reply.status for reply in replies.values()} == {"ok"}
    # The drained worker answered what was running when the signal came, after the signal.
    drained = [r for r in replies.values() if r.worker_id.endswith(f"-{pid}") and r.worker_finished_ms > signalled_ms]
    assert drained, "nothing of the running set was finished during the drain"
    assert "drained in" in registry.log_path(name).read_text()
