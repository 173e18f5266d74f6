"""Runs a command-line tool to its end bounded by the CPU time it uses, never by the wall clock.

On a machine shared with other work a CPU-bound tool's wall time is its CPU time times the contention: checkov
needs about 4 s of CPU here, and took 3 s alone but 62 s beside three other runs of the infrastructure tests,
so a wall-clock timeout (its 120 s one was) fails a healthy run whenever the machine is busy enough. Two
things bound a run instead: RLIMIT_CPU ends a runaway (the kernel sends SIGXCPU at the limit), and a run whose
processes have used no CPU at all for `stall_seconds` is waiting on something that will not come and is
killed (a starved process still moves, a little). Linux only: CPU time is read from /proc.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

STALL_SECONDS = 60.0


class StalledError(AssertionError):
    """The tool's processes used no CPU for `stall_seconds`: it waits on something that will not come."""


def run_bounded_by_cpu(
    argv: list[str], cpu_seconds: int, stall_seconds: float = STALL_SECONDS, **popen
) -> subprocess.CompletedProcess:
    """Runs `argv` in a process group of its own; returns its output (returncode -SIGXCPU: it ran out of CPU)."""

    def limit_cpu() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))  # SIGXCPU, then SIGKILL

    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=limit_cpu, **popen)  # fmt: skip
    try:
        ticks, moved = -1, time.monotonic()
        while True:
            try:
                stdout, stderr = process.communicate(timeout=1)
                return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                now = group_cpu_ticks(process.pid)
                if now != ticks:
                    ticks, moved = now, time.monotonic()
                elif time.monotonic() - moved > stall_seconds:
                    raise StalledError(f"{argv[0]} used no CPU for {stall_seconds:.0f}s: killed as hung") from None
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)  # the whole group: a forked worker must not outlive the run
            # Not communicate(): a descendant that left the group may hold the pipes open for ever.
            process.stdout.close()
            process.stderr.close()
            process.wait()


def group_cpu_ticks(group: int) -> int:
    """CPU time, in clock ticks, of the live processes of process group `group` (and the children they reaped)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) == group:  # pgrp
            ticks += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return ticks
