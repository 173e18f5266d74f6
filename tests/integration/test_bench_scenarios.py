"""Every `make bench` scenario runs: the suite itself (`bench.suite --smoke`, each scenario's own code at its smallest
size) against this session's stack, so a scenario that crashes fails the tests, not the next person's benchmark."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from emulators.stack import ROOT

# A bound, not a pace: on a machine crowded by other suites (load average 35-56 on 2 cores) scenarios 1-16 took
# 15 minutes; past this the suite is stopped and reported with what it printed.
SUITE_SECONDS = 1800


def test_every_bench_scenario_runs_at_its_smallest_size(stack, tmp_path):
    env = {**os.environ, "MAAS_STACK_DIR": str(stack.stack_dir), "MAAS_STACK_PORT_OFFSET": str(stack.port_offset),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    log = tmp_path / "suite.log"
    with log.open("w") as out:
        # Its own session, so a suite cut off by the timeout takes the scenario processes it started with it.
        suite = subprocess.Popen([sys.executable, "-m", "bench.suite", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                                 env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            returncode = suite.wait(timeout=SUITE_SECONDS)
        except subprocess.TimeoutExpired:
            # SIGINT first: the suite's `finally` stops the API processes it started (they have sessions of their own).
            os.killpg(suite.pid, signal.SIGINT)
            try:
                suite.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(suite.pid, signal.SIGKILL)
                suite.wait()
            returncode = None
    printed = log.read_text()
    said = printed[-8000:]
    assert returncode == 0, said
    # This session's stack, not one of the bench's own: the suite's first line, past the tail a long log keeps.
    assert "Using the running stack" in printed, said
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["smoke"]
    scenarios = {(row["scenario"], row["mode"]) for row in result["rows"]}
    assert {("pubsub floor", None), ("naive per-request", None), ("noop", "per-instance"), ("sleep", "per-instance"),
            ("sd15-txt2img", "per-instance"), ("noop", "per-request"), ("noop cache hits", "per-instance"),
            ("noop async job submit-to-result", "per-instance")} <= scenarios, scenarios  # fmt: skip
    sections = ("direct", "adapters", "step_caches", "edit_scheduling", "event_streams", "batches", "batch_beside",
                "flows")  # fmt: skip
    for section in sections:
        assert result[section], section
    assert set(result["step_caches"]) == {"flux.first_block", "flux.taylorseer", "sd35.first_block", "sd15.deepcache"}
    assert set(result["edit_scheduling"]["mixes"]) == {"inpaint", "edit"}  # both schedulings of each ran
    assert {family["family"] for family in result["adapters"]["families"]} == {"sd15", "flux"}  # the smoke's two
    assert len(result["open_loop"]) == 2, result["open_loop"].keys()
