"""A BigQuery table as a batch's input: its columns checked at submit, each row mapped to a line (a bad row an error
line), the key entitled only to its own tables (never the service's dataset, one refusal whether missing or not),
and the runner reading rows by position: exactly once after a Redis loss, unread rows listed on cancel."""

from __future__ import annotations

import json
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from google.api_core import exceptions
from google.cloud.bigquery import SchemaField

from api_server.batches import tables
from api_server.batches.inputs import BatchInputPolicy
from api_server.batches.lines import InvalidLine, line_request_id, validate_line
from api_server.batches.tables import check_columns, row_line, table_lines
from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from contract.settings import Settings, api_key_digest
from tests.unit import batch_harness
from tests.unit.batch_harness import Harness

redis_server = batch_harness.redis_server  # one redis-server for the module
KEY_A, KEY_B = api_key_digest("key-a"), api_key_digest("key-b")
A, B = Caller(KEY_A[:12], KEY_A), Caller(KEY_B[:12], KEY_B)
TEXT_SCHEMA = [SchemaField("custom_id", "STRING"), SchemaField("model", "STRING"), SchemaField("instances", "STRING")]


# Rows as lines.


def test_a_rows_columns_are_its_lines_fields_with_json_text_parsed_and_nulls_left_out():
    data, refused = row_line(
        {"custom_id": "r1", "model": "sd15", "instances": '[{"prompt": "a chair"}]', "parameters": None}
    )
    assert refused is None
    assert json.loads(data) == {"custom_id": "r1", "model": "sd15", "instances": [{"prompt": "a chair"}]}
    # Typed columns (a REPEATED RECORD, a RECORD, a JSON column) come from the client as lists and dicts.
    data, refused = row_line(
        {"custom_id": "r2", "model": "sd15", "instances": [{"prompt": "a sofa"}], "parameters": {"seed": 7}}
    )
    assert refused is None and json.loads(data)["parameters"] == {"seed": 7}


def test_a_row_whose_json_text_is_not_json_is_an_error_line_that_keeps_its_custom_id():
    data, refused = row_line({"custom_id": "r3", "model": "sd15", "instances": "[{not json"})
    assert refused is not None and (refused.status, refused.field) == (422, "instances")
    assert refused.message == "instances: the cell is not JSON text (a JSON array)"
    line = next(table_lines(iter([{"custom_id": "r3", "model": "sd15", "instances": "[{not json"}]), 0, 1024))
    checked = validate_line(None, None, "batch-x", line, A, 1024)  # type: ignore[arg-type]
    assert isinstance(checked, InvalidLine) and checked.custom_id == "r3"
    assert checked.error.message == refused.message


def test_rows_are_numbered_from_the_cursor_with_row_positions_as_offsets_and_a_long_row_refused():
    rows = [{"custom_id": f"r{index}", "model": "m", "instances": "[]"} for index in range(3)]
    rows[1]["instances"] = json.dumps([{"prompt": "x" * 500}])
    lines = list(table_lines(iter(rows), 40, max_line_bytes=200))
    assert [(line.number, line.start_offset, line.end_offset) for line in lines] == [(41, 40, 41), (42, 41, 42),
                                                                                     (43, 42, 43)]  # fmt: skip
    assert lines[1].data is None and lines[0].data is not None  # too long: the predict's 413
    assert validate_line(None, None, "b", lines[1], A, 200).error.status == 413  # type: ignore[arg-type,union-attr]


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ([*TEXT_SCHEMA, SchemaField("prompt", "STRING")],
         "input_table: column prompt is not a batch line field; expected custom_id, model, instances, parameters"),
        (TEXT_SCHEMA[::2], "input_table: the table has no model column (a STRING)"),
        ([SchemaField("custom_id", "INT64"), *TEXT_SCHEMA[1:]], "input_table: column custom_id is INT64; expected STRING"),
        ([*TEXT_SCHEMA[:2], SchemaField("instances", "RECORD", fields=[SchemaField("prompt", "STRING")])],
         "input_table: column instances is RECORD; expected a JSON array (JSON, STRING of JSON text or ARRAY<STRUCT>)"),
        ([*TEXT_SCHEMA, SchemaField("parameters", "INT64")],
         "input_table: column parameters is INT64; expected a JSON object (JSON, STRING of JSON text or STRUCT)"),
    ],
)  # fmt: skip
def test_a_table_whose_columns_are_not_a_lines_fields_is_a_422_naming_the_column(schema, message):
    with pytest.raises(ApiError) as refused:
        check_columns(schema)
    assert (refused.value.status, refused.value.field, refused.value.message) == (422, "input_table", message)


def test_text_json_and_typed_columns_are_accepted():
    check_columns(TEXT_SCHEMA)
    check_columns(
        [
            *TEXT_SCHEMA[:2],
            SchemaField("instances", "RECORD", mode="REPEATED", fields=[SchemaField("prompt", "STRING")]),
            SchemaField("parameters", "JSON"),
        ]
    )


# Which tables a key may name.


class Tables:
    """The tables the service account can read (`schema` each); a name in `forbidden` raises as BigQuery does."""

    def __init__(self, tables: set[str], forbidden: set[str] = frozenset()) -> None:
        self.tables, self.forbidden = tables, forbidden

    def get_table(self, table_id: str):
        if table_id in self.forbidden:
            raise exceptions.Forbidden(f"403 Access Denied: Table {table_id}")
        if table_id not in self.tables:
            raise exceptions.NotFound(f"404 Not found: Table {table_id}")
        return SimpleNamespace(table_type="VIEW" if table_id.endswith("_view") else "TABLE", schema=TEXT_SCHEMA)


TABLES = Tables(
    {
        f"acme.inputs.{A.key_id}_lines", f"acme.inputs.{B.key_id}_lines", "acme.maas.inference_log",
        "acme.tenant_b.secret", "acme.inputs_other.lines", f"acme.inputs.{A.key_id}_view",
    },
    forbidden={f"acme.inputs.{A.key_id}_locked"},
)  # fmt: skip


def table_policy(inputs: str) -> BatchInputPolicy:
    settings = Settings.from_env({"MAAS_PROJECT_ID": "acme", "MAAS_ENV": "production", "MAAS_BATCH_INPUTS": inputs})
    return BatchInputPolicy(
        None, settings.batch_inputs, {settings.model_bucket}, TABLES, {f"acme.{settings.dataset}"}
    )  # fmt: skip


def table_refusal(policy: BatchInputPolicy, uri: str, caller: Caller) -> tuple[int, str | None, str]:
    with pytest.raises(ApiError) as refused:
        policy.check_table(uri, caller)
    return refused.value.status, refused.value.field, refused.value.message.replace(uri, "URI")


def test_a_key_names_its_own_tables_and_gets_one_refusal_for_another_keys_the_services_and_a_missing_one():
    policy = table_policy("*=bq://acme.inputs.{key_id}_")
    # The service's dataset among the key's locations (the settings refuse that; the check refuses it anyway).
    policy._inputs = {"*": ("bq://acme.inputs.{key_id}_", "bq://acme.maas.")}
    assert policy.check_table(f"bq://acme.inputs.{A.key_id}_lines", A) == f"bq://acme.inputs.{A.key_id}_lines"
    missing = table_refusal(policy, f"bq://acme.inputs.{A.key_id}_missing", A)
    assert missing == (422, "input_table", "input_table: URI is not a readable table in this key's batch input "
                       f"locations (this key's: bq://acme.inputs.{A.key_id}_, bq://acme.maas.)")  # fmt: skip
    for uri in (
        f"bq://acme.inputs.{B.key_id}_lines",  # another key's table
        "bq://acme.maas.inference_log",  # the service's own dataset, whatever the settings say
        "bq://acme.tenant_b.secret",  # a table outside the key's locations
        f"bq://acme.inputs.{A.key_id}_locked",  # one the service cannot read
    ):
        assert table_refusal(policy, uri, A) == missing, uri


def test_a_whole_dataset_location_does_not_cover_a_dataset_whose_name_begins_alike():
    policy = table_policy(f"{KEY_A}=bq://acme.inputs")
    assert policy.check_table(f"bq://acme.inputs.{B.key_id}_lines", A)
    assert table_refusal(policy, "bq://acme.inputs_other.lines", A)[:2] == (422, "input_table")


def test_a_view_or_a_bad_uri_is_a_422_and_a_key_without_table_locations_is_told_so():
    policy = table_policy("*=bq://acme.inputs.{key_id}_")
    assert "is a VIEW; name a table" in table_refusal(policy, f"bq://acme.inputs.{A.key_id}_view", A)[2]
    assert table_refusal(policy, "acme.inputs.lines", A)[2] == (
        "input_table: a bq://project.dataset.table URI of a BigQuery table"
    )
    assert table_refusal(table_policy("*=gs://inputs/"), f"bq://acme.inputs.{A.key_id}_lines", A)[2].endswith(
        "(none for this key)"
    )


def test_settings_refuse_a_table_location_in_the_services_dataset_and_the_local_stack_gives_each_key_a_prefix():
    with pytest.raises(ValueError, match="the service's own dataset"):
        table_policy("*=bq://acme.maas.inference")
    assert "bq://acme.maas_batch_inputs.{key_id}_" in Settings.from_env({"MAAS_PROJECT_ID": "acme"}).batch_inputs["*"]


# The runner reads rows by position.


@pytest.fixture
def client(redis_server):
    redis_server.flushall()
    return redis_server


def test_a_tables_rows_run_as_lines_and_a_bad_row_is_an_error_line(client):
    harness = Harness(client)
    batch_id = harness.submit_table(["t1", None, "t3"])
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("feed_done") == "1")
    for custom_id in ("t1", "t3"):
        harness.answer(batch_id, custom_id)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    assert harness.counts(batch_id) == {"total": 3, "succeeded": 2, "failed": 1, "cancelled": 0, "expired": 0}
    assert sorted((item["custom_id"], item["line"]) for item in harness.output(batch_id, "results")) == [
        ("t1", 1),
        ("t3", 3),
    ]
    [error] = harness.output(batch_id, "errors")
    assert (error["custom_id"], error["line"], error["error"]["field"]) == ("bad", 2, "instances")


def test_after_redis_loses_a_table_batch_reading_resumes_at_the_safe_row_and_rows_in_parts_are_skipped(client):
    harness = Harness(client, batch_max_in_flight=4)
    ids = [f"t{index}" for index in range(1, 9)]
    batch_id = harness.submit_table(ids)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("total") == "4")  # rows 1-4 in flight
    for custom_id in ids[1:4]:  # row 1 holds the safe cursor back while 2-4 reach a results part
        harness.answer(batch_id, custom_id)
    harness.runner._collect(batch_id, None)
    harness.runner._flush(batch_id, force=True)
    client.flushall()
    assert harness.store.restore(batch_id)
    harness.runner._drop(batch_id)
    read_from = len(harness.bigquery.pages)
    # Rows 1, 5, 6 and 7 fill the model's share again: rows 2-4 (in the part) were skipped, not counted twice.
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("total") == "7")
    assert harness.bigquery.pages[read_from][0] == 0, "read again from the safe row (row 1), by position"
    for custom_id in [ids[0], *ids[4:]]:
        harness.answer(batch_id, custom_id)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    assert harness.counts(batch_id) == {"total": 8, "succeeded": 8, "failed": 0, "cancelled": 0, "expired": 0}
    results = harness.output(batch_id, "results")
    assert Counter(item["custom_id"] for item in results) == Counter(ids), "each row answered once"
    assert harness.output(batch_id, "errors") == []
    assert sorted(harness.inference.published) == sorted(
        [line_request_id(batch_id, custom_id) for custom_id in ids] + [line_request_id(batch_id, "t1")]
    ), "only row 1 (its answer lost with Redis) published again"


def test_a_cancelled_table_batch_lists_every_row_it_never_read_and_total_is_the_tables_row_count(client):
    harness = Harness(client, batch_max_in_flight=2)
    ids = [f"t{index}" for index in range(1, 8)]
    batch_id = harness.submit_table(ids)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("total") == "2")
    harness.answer(batch_id, "t1")
    harness.store.request_cancel(batch_id)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "cancelled")
    assert harness.counts(batch_id) == {"total": 7, "succeeded": 1, "failed": 0, "cancelled": 6, "expired": 0}
    errors = harness.output(batch_id, "errors")
    assert sorted((item["line"], item["custom_id"]) for item in errors) == [(n, f"t{n}") for n in range(2, 8)]


def test_a_page_that_fails_mid_table_is_read_again_from_the_cursor_and_the_feed_does_not_end_early(client, monkeypatch):
    monkeypatch.setattr(tables, "PAGE_ROWS", 2)
    harness = Harness(client)
    ids = [f"t{index}" for index in range(1, 8)]
    batch_id = harness.submit_table(ids)
    harness.bigquery.fail_once_at = {4}  # rows 5-6's page fails once
    failures, deadline = 0, time.monotonic() + 30
    while harness.fields(batch_id).get("feed_done") != "1":
        assert time.monotonic() < deadline, "the feed did not end"
        assert harness.store.acquire(batch_id, harness.runner._token, 10) is not None
        try:
            harness.runner.step(batch_id)
        except ConnectionError:  # the runner's loop logs it and steps again
            failures += 1
    assert failures == 1 and harness.fields(batch_id)["total"] == "7", "every row read, none counted twice"
    for custom_id in ids:
        harness.answer(batch_id, custom_id)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    assert sorted(item["custom_id"] for item in harness.output(batch_id, "results")) == ids
