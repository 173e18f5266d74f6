"""What a failed scenario keeps: the requests that failed it, by id, with what each process logged about them, and
a copy of the stack's logs taken before anything (the next scenario, the next run, `down`) reuses the stack.

The folder is `chaos/results/runs/<run>/<scenario>/`: `evidence.md` and `logs/` (every process's log as it was)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from chaos.traffic import Outcome
from chaos.verdict import ScenarioResult

# Log lines quoted per request and per log file: enough to follow it through a kill, few enough to read.
LINES_PER_LOG = 40
# The client's own polls of a job name it twice a second and say nothing about where the request went.
POLL = re.compile(r"GET /v1/jobs/")


@dataclass(frozen=True)
class FailedRequest:
    """One request that failed a scenario: unanswered (or answered with an undocumented status) or unlogged."""

    request_id: str | None
    model: str
    kind: str
    why: str
    reference: str = ""
    job_id: str | None = None
    held_by: str | None = None

    @property
    def needles(self) -> list[str]:
        """What its lines in the logs carry: the request id, else the job id or the client's prompt."""
        return [needle for needle in (self.request_id, self.job_id, self.reference) if needle]


def failed_requests(
    result: ScenarioResult, outcomes_by_id: dict[str, Outcome], held_by: dict[str, str]
) -> list[FailedRequest]:
    """Every unanswered and every unlogged request of a result, each once, the unanswered first."""
    failed: list[FailedRequest] = []
    seen: set[str] = set()
    for outcome in result.unanswered_outcomes:
        if not outcome.answered:
            why = "unanswered"
        elif not outcome.on_time:
            why = f"answered late ({outcome.answered_at - outcome.sent_at:.2f} s after it was sent)"
        else:
            why = f"undocumented status {outcome.status}"
        if outcome.error:
            why += f" ({outcome.error})"
        failed.append(
            FailedRequest(
                outcome.request_id, outcome.model, outcome.kind, why, outcome.reference, outcome.job_id,
                held_by.get(outcome.request_id or ""),
            )
        )  # fmt: skip
        seen.add(outcome.request_id or outcome.reference)
    for request_id in result.missing_row_ids:
        if request_id in seen:
            continue
        outcome = outcomes_by_id.get(request_id)
        failed.append(
            FailedRequest(
                request_id, outcome.model if outcome else "?", outcome.kind if outcome else "?", "no log row",
                outcome.reference if outcome else "", outcome.job_id if outcome else None, held_by.get(request_id),
            )
        )  # fmt: skip
    return failed


def log_lines(log_dir: Path, needles: Iterable[str]) -> dict[str, list[str]]:
    """Per log file (by process name), the lines that mention any needle."""
    pattern = re.compile("|".join(re.escape(needle) for needle in needles))
    found: dict[str, list[str]] = {}
    if not pattern.pattern:
        return found
    for path in sorted(log_dir.glob("*.log")):
        text = path.read_text(errors="replace").splitlines()
        lines = [line for line in text if pattern.search(line) and not POLL.search(line)]
        if lines:
            found[path.stem] = lines[-LINES_PER_LOG:]
    return found


def keep(
    result: ScenarioResult,
    outcomes: list[Outcome],
    held_by: dict[str, str],
    log_dir: Path,
    folder: Path,
) -> Path:
    """Copies the stack's logs to `folder/logs` and writes `folder/evidence.md`, naming every failed request with
    its model, kind, the worker that held it and the lines each process logged about it. Returns the evidence."""
    folder.mkdir(parents=True, exist_ok=True)
    if log_dir.is_dir():
        shutil.copytree(log_dir, folder / "logs", dirs_exist_ok=True)
    by_id = {outcome.request_id: outcome for outcome in outcomes if outcome.request_id}
    failed = failed_requests(result, by_id, held_by)
    lines = [f"# {result.name}: FAIL", "", f"Logs as they were when the scenario ended: {folder / 'logs'}", ""]
    lines += [
        "| request id | model | kind | why | held by (at a kill) | job | client prompt |",
        "|---|---|---|---|---|---|---|",
    ]
    for request in failed:
        cells = [request.request_id or "(none: no answer carried one)", request.model, request.kind, request.why,
                 request.held_by or "-", request.job_id or "-", request.reference or "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for request in failed:
        lines += ["", f"## {request.request_id or request.reference}", ""]
        logged = log_lines(folder / "logs", request.needles)
        if not logged:
            lines.append("No process logged it.")
        for process, process_lines in logged.items():
            lines += [f"{process}:", "```", *process_lines, "```"]
    if not failed:
        lines.append("(every request was answered and logged: the scenario failed on another count, see the table)")
    text = "\n".join(lines) + "\n"
    (folder / "evidence.md").write_text(text)
    return folder / "evidence.md"


def keep_evidence(ctx, result: ScenarioResult, outcomes: list[Outcome]) -> None:
    """A failed scenario's evidence and the stack's logs (`ctx`: the scenario's ChaosContext), copied before the next
    scenario reuses the stack."""
    if result.passed or ctx.evidence_dir is None:
        return
    folder = ctx.evidence_dir / "".join(c if c.isalnum() else "-" for c in result.name).strip("-")
    kept = keep(result, outcomes, ctx.held_by, ctx.registry.log_dir, folder)
    result.notes.append(f"evidence kept in {kept}")
