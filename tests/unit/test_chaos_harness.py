"""The chaos harness's bookkeeping: what counts as answered, on time, documented, lost or doubled."""

from __future__ import annotations

from chaos.traffic import GRACE_SECONDS, Outcome
from chaos.verdict import ScenarioResult, table


def outcome(status: int | None, waited: float | None, deadline: float = 30.0, job_status: str | None = None):
    answered_at = None if waited is None else 1000.0 + waited
    return Outcome("sleep", 1000.0, deadline, status=status, answered_at=answered_at, job_status=job_status)


def test_an_answer_within_the_deadline_plus_grace_is_on_time_and_one_after_is_not():
    assert outcome(200, 30 + GRACE_SECONDS).on_time
    assert not outcome(200, 30 + GRACE_SECONDS + 0.1).on_time
    assert not outcome(None, None).on_time


def test_results_count_ok_explicit_errors_unanswered_and_undocumented():
    result = ScenarioResult("s")
    result.record(
        [outcome(200, 1), outcome(503, 1), outcome(504, 60), outcome(None, None), outcome(418, 1),
         outcome(202, 5, job_status="succeeded"), outcome(202, 5, job_status="cancelled")]
    )  # fmt: skip
    assert result.sent == 7 and result.ok == 2
    assert dict(result.errors_by_status) == {503: 1, "202:cancelled": 1}
    assert result.unanswered == 2 and result.undocumented == 1
    assert not result.passed


def test_rows_missing_and_doubled_fail_a_scenario():
    result = ScenarioResult("s")
    result.record([outcome(200, 1)])
    result.record_rows(["a", "b", "c"], {"a": 1, "b": 2})
    assert (result.rows, result.duplicate_rows, result.missing_rows) == (3, 1, 1)
    assert not result.passed
    clean = ScenarioResult("clean")
    clean.record([outcome(200, 1), outcome(503, 2)])
    clean.record_rows(["a", "b"], {"a": 1, "b": 1})
    assert clean.passed


def test_the_table_has_a_line_per_scenario_with_its_verdict():
    good, bad = ScenarioResult("good"), ScenarioResult("bad")
    bad.leaked_subscriptions = 1
    text = table([good, bad])
    assert text.splitlines()[0].startswith("| scenario | sent | ok |")
    assert "| good |" in text and text.splitlines()[2].endswith("PASS |") and text.splitlines()[3].endswith("FAIL |")


def test_a_killed_workers_held_requests_are_timed_from_the_kill_to_their_answer():
    answered = [outcome(200, waited) for waited in (5.0, 9.0, 40.0)]
    for request_id, item in zip("abc", answered, strict=True):
        item.request_id = request_id
    result = ScenarioResult("kill")
    # Killed at 1003 s holding a, b and d (d never answered: counted as unanswered elsewhere); c's holder was
    # killed at 1030 s while no other worker was up.
    result.record_recovery([(1003.0, {"a", "b", "d"}, True), (1030.0, {"c"}, False)], answered)
    assert sorted(result.recovery_seconds) == [2.0, 6.0] and result.stranded_seconds == [10.0]
    assert result.recovery() == "2: 6.0 / 6.0 (no other worker up: 1: 10.0 / 10.0)"
    assert ScenarioResult("none").recovery() == "-"
