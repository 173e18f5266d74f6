"""Runs `bench.suite --smoke` (every scenario of a part at its smallest size) as the bench tests do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from emulators.stack import ROOT

# A bound, not a pace: on a machine crowded by other suites (load average 35-56 on 2 cores) scenarios 1-16 took
# 15 minutes; past this the suite is stopped and reported with what it printed.
SUITE_SECONDS = 1800


def run_smoke(part: str, out_dir: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """The smoke run of one part: its results.json and everything it printed (asserted to have exited 0)."""
    log = out_dir / "suite.log"
    with log.open("w") as out:
        # Its own session, so a suite cut off by the timeout takes the scenario processes it started with it.
        argv = [sys.executable, "-m", "bench.suite", "--smoke", "--part", part, "--out", str(out_dir)]
        suite = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
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
    assert returncode == 0, printed[-8000:]
    result = json.loads((out_dir / "results.json").read_text())
    assert result["meta"]["smoke"] and result["meta"]["part"] == part
    return result, printed
