"""The property-based part of `make chaos`: schemathesis over the live stack's `/openapi.json`.

Every operation is fuzzed with an API key (the admin operations then check their 403), and the admin operations
again with an admin key, so traffic splits and adapter registration are fuzzed past authentication. The
report keeps each error and failure whole, as schemathesis names it: the operation, what went wrong (a
response that broke a check, a dropped connection, a read timeout) and the curl that reproduces it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CHECKS = "not_a_server_error,response_schema_conformance"
# The operations the document marks admin-only (`ADMIN_ONLY` in api_server/process/openapi.py), as schemathesis selects
# them: a JSON pointer into each operation and the value it must have.
ADMIN_OPERATIONS = "/security/0/admin_key == []"
# schemathesis's output sections kept in the report; the rest (progress, capabilities, help links) is not.
KEPT_SECTIONS = ("ERRORS", "FAILURES", "SUMMARY")
MAX_REPORT_LINES = 300
RUN_TIMEOUT_SECONDS = 1800
_SECTION = re.compile(r"^=+ (.+?) =+$")
_NOISE = ("Need more help?", "discord.gg")


@dataclass(frozen=True)
class FuzzRun:
    """One schemathesis run: the key it authenticates with, and which operations (None: all of them)."""

    label: str
    key: str
    include_by: str | None = None


@dataclass(frozen=True)
class FuzzResult:
    run: FuzzRun
    returncode: int
    findings: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    def report(self) -> str:
        return f"schemathesis, {self.run.label}: exit {self.returncode}\n{self.findings}"


def runs(api_key: str, admin_key: str) -> list[FuzzRun]:
    return [
        FuzzRun("every operation, API key (the admin ones answer it 403)", api_key),
        FuzzRun("admin operations, admin key", admin_key, ADMIN_OPERATIONS),
    ]


def argv(binary: str, api_url: str, run: FuzzRun, examples: int, request_timeout: float) -> list[str]:
    """`request_timeout`: longer than any answer may take (a sync predict waits up to its model's
    `request_timeout_seconds` before it becomes a job), so a slow answer is not reported as a network error."""
    command = [
        binary, "run", f"{api_url}/openapi.json", f"--max-examples={examples}", f"--checks={CHECKS}",
        f"--header=Authorization: Bearer {run.key}", f"--request-timeout={request_timeout:g}",
    ]  # fmt: skip
    return command + ([f"--include-by={run.include_by}"] if run.include_by else [])


def findings(stdout: str, stderr: str = "") -> str:
    """What a run found, from its output: the errors, failures and summary sections whole, and its closing
    verdict; the output's end when it has none of them (schemathesis could not start)."""
    kept: list[str] = []
    keeping = False
    for line in stdout.splitlines():
        if heading := _SECTION.match(line.strip()):
            keeping = heading.group(1) in KEPT_SECTIONS
        if keeping and line.strip() and not any(noise in line for noise in _NOISE):
            kept.append(line.rstrip())
    if not kept:
        kept = [*stdout.strip().splitlines()[-12:], *stderr.strip().splitlines()[-12:]]
    elif _SECTION.match(verdict := stdout.strip().splitlines()[-1].strip()):
        kept.append(verdict)  # e.g. "1 error in 267.89s": what the run found, and how long it took
    if len(kept) > MAX_REPORT_LINES:
        left_out = len(kept) - MAX_REPORT_LINES
        kept = [*kept[:MAX_REPORT_LINES], f"... {left_out} more lines (run schemathesis with its seed to see them)"]
    return "\n".join(kept)


def fuzz(api_url: str, fuzz_runs: list[FuzzRun], examples: int, request_timeout: float) -> list[FuzzResult]:
    """Each run against the stack, in turn; [] when schemathesis is not installed."""
    binary = Path(sys.executable).with_name("schemathesis")
    if not binary.exists():
        return []
    results = []
    for run in fuzz_runs:
        command = argv(str(binary), api_url, run, examples, request_timeout)
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            stopped = f"stopped after {RUN_TIMEOUT_SECONDS} s"
            results.append(FuzzResult(run, -1, f"{stopped}\n{findings(output)}"))
            continue
        results.append(FuzzResult(run, completed.returncode, findings(completed.stdout, completed.stderr)))
    return results
