"""The outcome table (`contract/outcomes.py`) is the vocabulary the log schema, the docs and the views use."""

from __future__ import annotations

import re
from pathlib import Path

from contract.log_schema import log_schema_fields
from contract.outcomes import FINISHED_JOB_STATES, OUTCOMES, Outcome

ROOT = Path(__file__).resolve().parents[2]


# The page that tells a caller what each HTTP status means (the docs site's requests guide).
STATUS_PAGE = ROOT / "docs" / "guides" / "requests.md"


def documented_status_table() -> dict[int, str]:
    """The requests guide's `| status | when |` table: HTTP status to what it says."""
    text = STATUS_PAGE.read_text()
    table = text.split("| status | when |", 1)[1].split("\n\n", 1)[0]
    return {int(match[1]): match[2] for match in re.finditer(r"^\| (\d{3}) \| (.+) \|$", table, re.MULTILINE)}


def test_every_outcome_has_one_mapping():
    assert set(OUTCOMES) == set(Outcome)
    assert {"succeeded", "failed", "expired", "cancelled"} == FINISHED_JOB_STATES


def test_the_documented_status_table_lists_every_status_an_outcome_answers_with_202_included():
    table = documented_status_table()
    assert {spec.http_status for spec in OUTCOMES.values()} <= set(table)
    assert "job" in table[202]


def test_the_log_schema_names_every_log_status():
    [status] = [field for field in log_schema_fields() if field["name"] == "status"]
    for spec in OUTCOMES.values():
        assert re.search(rf"\b{spec.log_status}\b", status["description"]), spec.log_status


def test_worker_replies_and_refusals_map_to_one_outcome_each():
    assert Outcome.for_reply("expired", "expired") is Outcome.EXPIRED
    assert Outcome.for_reply("cancelled", "cancelled") is Outcome.CANCELLED
    assert Outcome.for_reply("error", "dead_lettered") is Outcome.DEAD_LETTERED
    assert Outcome.for_reply("error", "inference_failed") is Outcome.WORKER_ERROR
    # The request's own input, refused by the worker: a 422 and a failed job, logged `error` / `bad_input` as before.
    refused = Outcome.for_reply("error", "bad_input")
    assert (refused.spec.http_status, refused.spec.log_status, refused.spec.error_kind) == (422, "error", "bad_input")
    assert refused.spec.job_state == "failed"
    assert Outcome.for_http_status(429) is Outcome.RATE_LIMITED
    assert Outcome.for_http_status(504) is Outcome.TIMEOUT
    assert Outcome.for_http_status(418) is Outcome.REJECTED
