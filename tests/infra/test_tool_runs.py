"""The tools the infrastructure tests run (checkov) are bounded by the CPU they use, so a busy machine that
slows them down does not fail them, while a runaway or a hung one still ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.infra.tool_runs import StalledError, run_bounded_by_cpu

# Runs the command after its arguments `share` of each second, as a machine kept busy by others lets it run.
STARVED = """
import signal, subprocess, sys, time
share, argv = float(sys.argv[1]), sys.argv[2:]
child = subprocess.Popen(argv)
while child.poll() is None:
    time.sleep(share)
    child.send_signal(signal.SIGSTOP)
    time.sleep(1 - share)
    child.send_signal(signal.SIGCONT)
sys.exit(child.returncode)
"""
# Needs 0.3 s of CPU, whatever the wall clock says.
BUSY = "import time\nwhile time.process_time() < 0.3: pass\nprint('done')"


def starved(share: float) -> list[str]:
    return [sys.executable, "-c", STARVED, str(share), sys.executable, "-c", BUSY]


def test_a_tool_slowed_down_by_a_busy_machine_is_not_failed_by_the_wall_clock():
    # Given a tenth of the CPU, 0.3 s of work takes at least 2 s: a wall-clock limit with 5x headroom over the
    # work (1.5 s) fails it, as the 120 s one failed checkov's 4 s on a loaded machine...
    process = subprocess.Popen(starved(0.1), stdout=subprocess.PIPE, text=True, start_new_session=True)
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=1.5)
    os.killpg(process.pid, signal.SIGKILL)  # and its stopped child
    process.communicate()
    # ...while a bound on the CPU it uses lets it finish.
    started = time.monotonic()
    result = run_bounded_by_cpu(starved(0.1), cpu_seconds=2, stall_seconds=10)
    assert (result.returncode, result.stdout) == (0, "done\n"), result.stderr
    assert time.monotonic() - started >= 2


def test_a_runaway_tool_is_ended_at_its_cpu_limit():
    result = run_bounded_by_cpu([sys.executable, "-c", "while True: pass"], cpu_seconds=1)
    assert result.returncode == -signal.SIGXCPU


def test_a_tool_that_stops_using_cpu_is_killed_as_hung():
    with pytest.raises(StalledError, match="used no CPU for 2s"):
        run_bounded_by_cpu([sys.executable, "-c", "import time; time.sleep(600)"], cpu_seconds=10, stall_seconds=2)


def test_a_hung_tool_is_left_even_when_a_process_that_left_its_group_holds_its_output(tmp_path):
    pid_file = tmp_path / "escaped.pid"
    escaped = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)"
    )
    with pytest.raises(StalledError):
        run_bounded_by_cpu([sys.executable, "-c", escaped], cpu_seconds=10, stall_seconds=2)
    escaped_pid = int(pid_file.read_text())
    try:
        os.kill(escaped_pid, 0)  # still there: the run ended without waiting for it to close the output
    finally:
        os.kill(escaped_pid, signal.SIGKILL)
