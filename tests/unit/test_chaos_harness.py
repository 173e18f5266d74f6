"""The chaos harness's bookkeeping: what counts as answered, on time, documented, lost or doubled; what the
fuzzer runs and what its report keeps."""

from __future__ import annotations

from types import SimpleNamespace

from schemathesis.core.transforms import resolve_pointer
from schemathesis.filters import parse_expression

from chaos import fuzz
from chaos.traffic import GRACE_SECONDS, Outcome
from chaos.verdict import ScenarioResult, row_copies, table
from tests.unit.test_openapi_document import documented_operations


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


# schemathesis's output for a run with one dropped connection, one read timeout and one failed check (trimmed).
SCHEMATHESIS_OUTPUT = """Schemathesis v4.32.5
━━━━━━━━━━━━━━━━━━━━

 🚫  Fuzzing (in 31.04s)

     🚫 2 errors

==================================== ERRORS ====================================
______________________ POST /v1/models/{model}:predict _______________________
Network Error

Connection failed

    Connection aborted. Remote end closed connection without response

Reproduce with:

    curl -X POST -H 'Authorization: [Filtered]' -d '{"instances": []}' http://127.0.0.1:23080/v1/models/noop:predict

Need more help?
    Join our Discord server: https://discord.gg/R9ASRAmHnA
_________________________ GET /v1/jobs/{job_id} __________________________
Network Error

Read timed out after 10 seconds

=================================== FAILURES ===================================
____________________________ GET /v1/models/{model} ____________________________
1. Test Case ID: 4pyzfP

- ST101 Server error

=================================== SUMMARY ====================================

Errors:
  🚫 Network Error: 2

Test cases:
  3128 generated, 3127 passed, 1 errored

Seed: 93984805632460316767180212774639970590

============================== 2 errors in 267.89s =============================="""


def test_the_fuzz_report_names_each_error_and_failure_with_its_operation_and_reproduction():
    report = fuzz.findings(SCHEMATHESIS_OUTPUT)
    for named in (
        "POST /v1/models/{model}:predict", "Connection aborted. Remote end closed connection without response",
        "curl -X POST", "GET /v1/jobs/{job_id}", "Read timed out after 10 seconds", "GET /v1/models/{model}",
        "ST101 Server error", "Network Error: 2", "Seed: 93984805632460316767180212774639970590", "2 errors in 267.89s",
    ):  # fmt: skip
        assert named in report, named
    assert "discord" not in report and "Fuzzing (in" not in report
    # Output without its sections (schemathesis could not start) is kept as its end, not dropped.
    assert "could not load the schema" in fuzz.findings("Error\ncould not load the schema", "")


def test_the_admin_run_selects_exactly_the_admin_operations_with_the_admin_key():
    pointer, _, value = parse_expression(fuzz.ADMIN_OPERATIONS)
    operations = documented_operations()
    selected = {label for label, operation in operations.items() if resolve_pointer(operation, pointer) == value}
    assert selected == {
        "PUT /v1/models/{model}/traffic", "DELETE /v1/models/{model}/traffic", "PUT /v1/models/{model}/adapters/{name}",
        "PUT /v1/models/{model}/controls/{name}",
    }  # fmt: skip
    every, admin = fuzz.runs("user-key", "admin-key")
    assert "--header=Authorization: Bearer user-key" in fuzz.argv("st", "http://api", every, 5, 190)
    assert not any(arg.startswith("--include-by") for arg in fuzz.argv("st", "http://api", every, 5, 190))
    command = fuzz.argv("st", "http://api", admin, 5, 190)
    assert "--header=Authorization: Bearer admin-key" in command
    assert f"--include-by={fuzz.ADMIN_OPERATIONS}" in command and "--request-timeout=190" in command


def test_a_failed_scenarios_evidence_names_its_unanswered_and_unlogged_requests_and_keeps_the_logs(tmp_path):
    from chaos.evidence import keep

    logs = tmp_path / "stack" / "logs"
    logs.mkdir(parents=True)
    (logs / "api.log").write_text(
        '{"message": "POST /v1/models/sleep:predict 202", "request_id": "lost-job"}\n'
        '{"message": "GET /v1/jobs/lost-job 200", "request_id": "a-poll"}\n'
        '{"message": "POST /v1/models/sleep:predict 200", "request_id": "fine"}\n'
    )
    (logs / "worker-synthetic.log").write_text('{"message": "request no-row ok", "request_id": "no-row"}\n')
    job = outcome(202, None)
    job.request_id, job.job_id, job.reference, job.error = "lost-job", "lost-job", "chaos 1a2b", "job still queued"
    silent = outcome(None, None)
    silent.reference = "chaos 3c4d"  # no answer: no request id, only its prompt
    unlogged, fine = outcome(200, 1), outcome(200, 1)
    unlogged.request_id, fine.request_id = "no-row", "fine"
    late = outcome(202, 40.02)  # a job that ended after its deadline plus the grace: answered, but late
    late.request_id, late.job_id = "late-job", "late-job"
    result = ScenarioResult("worker SIGKILL every 10 s")
    result.record([job, silent, unlogged, fine, late])
    result.record_rows(["lost-job", "no-row", "fine", "late-job"], {"fine": 1, "late-job": 1})
    assert not result.passed

    folder = tmp_path / "runs" / "run-1" / "worker-kill"
    text = keep(
        result, [job, silent, unlogged, fine, late], {"lost-job": "worker-synthetic (pid 42)"}, logs, folder
    ).read_text()
    assert "| late-job | sleep | job | answered late (40.02 s after it was sent) |" in text

    assert "| lost-job | sleep | job | unanswered (job still queued) | worker-synthetic (pid 42) |" in text
    assert "| (none: no answer carried one) | sleep | sync | unanswered |" in text and "chaos 3c4d" in text
    assert "| no-row | sleep | sync | no log row |" in text
    assert "| fine |" not in text
    assert "POST /v1/models/sleep:predict 202" in text and "GET /v1/jobs/lost-job" not in text
    assert "request no-row ok" in text
    # The stack's logs are copied: the next run may overwrite the originals.
    (logs / "api.log").write_text("")
    assert "predict 202" in (folder / "logs" / "api.log").read_text()


def test_chaos_runs_in_a_test_slots_ports_and_folder_when_given_one():
    from chaos.__main__ import PORT_OFFSET, chaos_place

    offset, folder = chaos_place({"MAAS_TEST_PORT_OFFSET": "14000"})
    assert offset == 14000 and folder.name == ".stack-chaos-14000"
    offset, folder = chaos_place({})
    assert offset == PORT_OFFSET and folder.name == ".stack-chaos"
    offset, folder = chaos_place({"MAAS_TEST_PORT_OFFSET": "14000", "MAAS_CHAOS_PORT_OFFSET": "30000"})
    assert offset == 30000 and folder.name == ".stack-chaos"


class _DrainingLog:
    """A stand-in BigQuery whose raw table gains `per_query` more of the expected rows at each query, up to `until`."""

    def __init__(self, request_ids: list[str], per_query: int, until: int) -> None:
        self.request_ids, self.per_query, self.until, self.written = request_ids, per_query, until, 0

    def query(self, sql: str):
        self.written = min(self.written + self.per_query, self.until)
        present = [rid for rid in self.request_ids[: self.written] if f"'{rid}'" in sql]
        rows = [{"request_id": rid, "copies": 1} for rid in present]
        return SimpleNamespace(result=lambda: rows)


_LOG_SETTINGS = type("LogSettings", (), {"project_id": "p", "dataset": "d", "log_table": "t"})()


def test_rows_still_arriving_are_waited_for_past_the_wait_and_a_stall_ends_it():
    ids = [f"r{i:04d}" for i in range(40)]
    # Every query finds one more row: a slow drain that lasts far longer than the wait is followed to its end.
    assert len(row_copies(_DrainingLog(ids, 1, 40), _LOG_SETTINGS, ids, wait_seconds=0.05, poll_seconds=0.1)) == 40
    # A drain that stops at 25 rows: the wait ends with those 25, the other 15 are missing.
    assert len(row_copies(_DrainingLog(ids, 5, 25), _LOG_SETTINGS, ids, wait_seconds=0.3, poll_seconds=0.01)) == 25


def test_the_chaos_stack_serves_the_overload_model_as_the_tests_do_and_none_of_the_failing_fixtures():
    from chaos.__main__ import CHAOS_CATALOG_OVERLAY
    from emulators.stack import local_catalog

    chaos = local_catalog(extra_overlay=str(CHAOS_CATALOG_OVERLAY))
    tests = local_catalog(test_fixtures=True)
    assert chaos.get("sleep-admitted") is not None and chaos.get("sleep-admitted") == tests.get("sleep-admitted")
    assert chaos.get("rollback-jobs") is None and tests.get("rollback-jobs") is not None
