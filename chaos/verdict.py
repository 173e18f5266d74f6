"""What a scenario proved: every request answered in time, one log row per request, nothing leaked."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from chaos.traffic import Outcome


@dataclass
class ScenarioResult:
    name: str
    sent: int = 0
    ok: int = 0
    errors_by_status: Counter = field(default_factory=Counter)
    unanswered: int = 0
    undocumented: int = 0
    rows: int = 0
    duplicate_rows: int = 0
    missing_rows: int = 0
    leaked_subscriptions: int = 0
    ran_after_deadline: int = 0
    seconds: float = 0.0
    # For each request a SIGKILLed worker held: seconds from the kill to its answer reaching the client.
    recovery_seconds: list[float] = field(default_factory=list)
    stranded_seconds: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    expected_failures: set[int] = field(default_factory=set)
    # The requests that failed the scenario, kept so a failed run can name them (chaos/evidence.py).
    unanswered_outcomes: list[Outcome] = field(default_factory=list)
    missing_row_ids: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (
            self.unanswered
            or self.undocumented
            or self.duplicate_rows
            or self.missing_rows
            or self.leaked_subscriptions
            or self.ran_after_deadline
        )

    def record(self, outcomes: list[Outcome]) -> None:
        self.sent += len(outcomes)
        for outcome in outcomes:
            if not outcome.on_time:
                self.unanswered += 1
                self.unanswered_outcomes.append(outcome)
            elif not outcome.documented:
                self.undocumented += 1
                self.unanswered_outcomes.append(outcome)
            elif outcome.status == 200 or outcome.job_status == "succeeded":
                self.ok += 1
            else:
                self.errors_by_status[
                    outcome.status if outcome.job_status is None else f"202:{outcome.job_status}"
                ] += 1

    def record_recovery(self, kills: list[tuple[float, set[str], bool]], outcomes: list[Outcome]) -> None:
        """Kill-to-answer time of each request a killed worker held (an unanswered one counts as unanswered),
        apart for kills while no other worker of the deployment was ready."""
        answered = {o.request_id: o.answered_at for o in outcomes if o.request_id and o.answered}
        for killed_at, held, other_ready in kills:
            times = self.recovery_seconds if other_ready else self.stranded_seconds
            times += [answered[r] - killed_at for r in held if r in answered]

    def recovery(self) -> str:
        """`n: p50 / max` seconds (and the same for kills with no other worker up), or `-` when no kill caught a
        request."""

        def summary(times: list[float]) -> str:
            ordered = sorted(times)
            return f"{len(ordered)}: {ordered[len(ordered) // 2]:.1f} / {ordered[-1]:.1f}"

        text = summary(self.recovery_seconds) if self.recovery_seconds else "-"
        if self.stranded_seconds:
            text += f" (no other worker up: {summary(self.stranded_seconds)})"
        return text

    def record_rows(self, expected_ids: list[str], copies: dict[str, int]) -> None:
        self.rows = sum(copies.values())
        self.duplicate_rows = sum(count - 1 for count in copies.values() if count > 1)
        self.missing_row_ids = [request_id for request_id in expected_ids if request_id not in copies]
        self.missing_rows = len(self.missing_row_ids)


COLUMNS = (
    "scenario", "sent", "ok", "errors (status: n)", "unanswered", "rows", "dup rows", "missing rows",
    "leaked subs", "run late", "held at kill: n, answered after (p50 / max s)", "result",
)  # fmt: skip


def table(results: list[ScenarioResult]) -> str:
    """A markdown table, one line per scenario."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for result in results:
        errors = ", ".join(f"{status}: {count}" for status, count in sorted(result.errors_by_status.items(), key=str))
        cells = [
            result.name, result.sent, result.ok, errors or "-", result.unanswered + result.undocumented, result.rows,
            result.duplicate_rows, result.missing_rows, result.leaked_subscriptions, result.ran_after_deadline,
            result.recovery(), "PASS" if result.passed else "FAIL",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def row_copies(
    bigquery, settings, request_ids: list[str], wait_seconds: float, poll_seconds: float = 1.0
) -> dict[str, int]:
    """Rows per request id in the raw table (not a view: duplicates must show), waiting for late writes.

    A row is missing only when none has arrived for `wait_seconds`: the spool drains at whatever rate the machine
    allows (thousands of rows after a BigQuery restart take minutes on a crowded machine), so each round that
    finds more rows than the last starts the wait again. Only a stall, not a slow drain, ends it early."""
    if not request_ids:
        return {}
    table_name = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    deadline = time.monotonic() + wait_seconds
    copies: dict[str, int] = {}
    while True:
        found: dict[str, int] = {}
        for start in range(0, len(request_ids), 500):
            ids = ", ".join(f"'{request_id}'" for request_id in request_ids[start : start + 500])
            sql = f"SELECT request_id, COUNT(*) AS copies FROM {table_name} WHERE request_id IN ({ids}) GROUP BY 1"
            try:
                rows = [dict(row) for row in bigquery.query(sql).result()]
                # The emulator has been seen to answer right after a resume with a malformed row: ask again.
                found.update({row["request_id"]: row["copies"] for row in rows if "request_id" in row})
            except Exception:  # noqa: BLE001 - a query sent while a fault still holds the emulator: ask again
                found.update({key: value for key, value in copies.items() if key in request_ids[start : start + 500]})
                time.sleep(poll_seconds / 2)
        if len(found) > len(copies):
            deadline = time.monotonic() + wait_seconds  # still draining: a stall, not a slow drain, ends the wait
        copies = found
        if len(copies) >= len(request_ids) or time.monotonic() > deadline:
            return copies
        time.sleep(poll_seconds)


def late_runs(bigquery, settings, request_ids: list[str], timeouts: dict[str, float]) -> int:
    """Requests a worker started after their deadline (model timeout past receipt), from their log rows."""
    if not request_ids:
        return 0
    table_name = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    late = 0
    for start in range(0, len(request_ids), 500):
        ids = ", ".join(f"'{request_id}'" for request_id in request_ids[start : start + 500])
        sql = (
            f"SELECT model, endpoint, created_at, worker_started_at FROM {table_name} "
            f"WHERE request_id IN ({ids}) AND worker_started_at IS NOT NULL"
        )
        for row in bigquery.query(sql).result():
            if row["endpoint"] == "job":
                continue  # a sync request turned job keeps running by design (the job deadline applies)
            waited = (row["worker_started_at"] - row["created_at"]).total_seconds()
            late += waited > timeouts.get(row["model"], 60)
    return late


def leaked_reply_subscriptions(subscriber, project_id: str, settle_seconds: float = 5.0) -> list[str]:
    """Per-request reply subscriptions still present once the traffic has stopped and settled."""
    from contract import naming

    prefix = naming.reply_subscription("")
    deadline = time.monotonic() + settle_seconds
    while True:
        names = [
            subscription.name.rsplit("/", 1)[-1]
            for subscription in subscriber.list_subscriptions(request={"project": f"projects/{project_id}"})
            if subscription.name.rsplit("/", 1)[-1].startswith(prefix)
        ]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.5)
