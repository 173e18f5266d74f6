"""A batch's `input_file` against the real GCS emulator: a key runs a file under its own prefix of the batch inputs
bucket, and is refused another key's file, another key's inline input and the service's own buckets, with the
same answer as for an object that does not exist."""

from __future__ import annotations

import json
import uuid

import pytest
import requests

from contract import google_clients, naming
from contract.settings import api_key_digest
from tests.conftest import TEST_API_KEYS, open_hold
from tests.e2e.test_batches import OTHER_KEY, create, line, output, wait

pytestmark = pytest.mark.stack


def submit(stack, headers: dict, uri: str) -> requests.Response:
    return requests.post(f"{stack.api_url}/v1/batches", json={"input_file": uri}, headers=headers, timeout=30)


def refused(stack, headers: dict, uri: str) -> tuple[int, str | None, str]:
    """The refusal's status, field and message, the URI itself replaced (so two refusals can be compared)."""
    response = submit(stack, headers, uri)
    error = response.json()["error"]
    return response.status_code, error.get("field"), error["message"].replace(uri, "URI")


def test_a_key_runs_only_its_own_inputs_and_cannot_tell_anothers_from_a_missing_one(stack, auth_headers, settings):
    storage = google_clients.storage_client(settings)
    own_prefix = f"{api_key_digest(TEST_API_KEYS[0])[:12]}/"
    other_prefix = f"{api_key_digest(TEST_API_KEYS[1])[:12]}/"
    name = f"{own_prefix}lines-{uuid.uuid4().hex[:8]}.jsonl"
    inputs = storage.bucket(naming.batch_input_bucket(settings.project_id))
    inputs.blob(name).upload_from_string(json.dumps(line("own-1")) + "\n", content_type="application/jsonl")
    own_file = f"gs://{inputs.name}/{name}"

    batch = create(stack, auth_headers, input_file=own_file)
    assert wait(stack, auth_headers, batch["id"])["status"] == "completed"
    assert [item["custom_id"] for item in output(stack, auth_headers, batch["id"], "results")] == ["own-1"]

    inline = create(stack, auth_headers, requests=[line("inline-1")])
    model_object = next(iter(storage.bucket(settings.model_bucket).list_blobs(max_results=1))).name
    missing = refused(stack, OTHER_KEY, f"gs://{inputs.name}/{other_prefix}no-such-{uuid.uuid4().hex[:8]}.jsonl")
    assert missing[:2] == (422, "input_file"), missing
    for uri in (
        own_file,  # another key's file in the batch inputs bucket
        inline["input_file"],  # another key's inline input, in the service's payload bucket
        f"gs://{settings.model_bucket}/{model_object}",  # the service's model bucket
        f"gs://{settings.payload_bucket}/{naming.batch_prefix(inline['id'])}batch.json",
    ):
        assert refused(stack, OTHER_KEY, uri) == missing, uri
    # The owner itself cannot run the service's own copy of its inline input either: it resubmits the lines.
    assert refused(stack, auth_headers, inline["input_file"])[:2] == (422, "input_file")


# A BigQuery table as the input (api_server/batches/tables.py).

TABLE_SCHEMA = [("custom_id", "STRING"), ("model", "STRING"), ("instances", "STRING"), ("parameters", "STRING")]


def make_table(bigquery, settings, key: str, rows: list[dict], columns=TABLE_SCHEMA) -> str:
    """A table of the key's own (`{key_id}_...` in the local batch inputs dataset) holding `rows`, as bq://."""
    from google.cloud.bigquery import SchemaField, Table

    name = f"{settings.project_id}.{naming.BATCH_INPUT_DATASET}.{api_key_digest(key)[:12]}_rows_{uuid.uuid4().hex[:8]}"
    bigquery.create_table(Table(name, schema=[SchemaField(column, kind) for column, kind in columns]))
    if rows:
        assert bigquery.insert_rows_json(name, rows) == []
    return f"bq://{name}"


def as_row(body: dict) -> dict:
    """A batch line as a table row: instances and parameters as JSON text in STRING columns."""
    return {**body, "instances": json.dumps(body["instances"]), "parameters": json.dumps(body.get("parameters", {}))}


def test_a_batch_runs_a_bigquery_tables_rows_as_lines_and_counts_the_tables_rows(stack, settings, bigquery):
    from maas_client import Client

    rows = [as_row(line(f"row-{index}", seed=index)) for index in range(1, 5)]
    rows.insert(2, {**as_row(line("bad-json")), "parameters": "{not json"})  # row 3: an error line, as bad JSONL
    rows.append(as_row(line("unknown-model", model="no-such-model")))  # row 6: refused as its predict would be
    table = make_table(bigquery, settings, TEST_API_KEYS[0], rows)
    with Client(stack.api_url, TEST_API_KEYS[0]) as client:
        view = client.batches.create(input_table=table)
        assert (view.input_table, view.input_file) == (table, None)
        done = client.batches.wait(view.id, timeout=60)
        results, errors = client.batches.results(view.id), client.batches.errors(view.id)
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.succeeded, counts.failed) == (6, 4, 2), "total: the table's row count"
    by_line = {item["line"]: item["custom_id"] for item in results + errors}
    assert by_line == {1: "row-1", 2: "row-2", 3: "bad-json", 4: "row-3", 5: "row-4", 6: "unknown-model"}
    assert all(item["status"] == "succeeded" and item["images"] for item in results)
    refused = {item["custom_id"]: item["error"] for item in errors}
    assert refused["bad-json"] == {"code": 422, "message": "parameters: the cell is not JSON text (a JSON object)",
                                   "field": "parameters"}  # fmt: skip
    assert refused["unknown-model"]["code"] == 404


def test_a_key_cannot_run_another_keys_table_nor_the_services_and_cannot_tell_them_from_a_missing_one(
    stack, auth_headers, settings, bigquery
):
    def refused_table(headers: dict, uri: str) -> tuple[int, str | None, str]:
        response = requests.post(f"{stack.api_url}/v1/batches", json={"input_table": uri}, headers=headers, timeout=30)
        error = response.json()["error"]
        return response.status_code, error.get("field"), error["message"].replace(uri, "URI")

    own = make_table(bigquery, settings, TEST_API_KEYS[0], [as_row(line("own-1"))])
    other_prefix = f"{settings.project_id}.{naming.BATCH_INPUT_DATASET}.{api_key_digest(TEST_API_KEYS[1])[:12]}_"
    missing = refused_table(OTHER_KEY, f"bq://{other_prefix}no_such_{uuid.uuid4().hex[:8]}")
    assert missing[:2] == (422, "input_table") and "not a readable table" in missing[2], missing
    for uri in (
        own,  # another key's table
        f"bq://{settings.project_id}.{settings.dataset}.{settings.log_table}",  # the service's inference log
        f"bq://{settings.project_id}.{settings.dataset}.{settings.audit_table}",
    ):
        assert refused_table(OTHER_KEY, uri) == missing, uri
    # The owner is told precisely what is wrong with its own table's columns.
    wrong = make_table(bigquery, settings, TEST_API_KEYS[0], [], [*TABLE_SCHEMA, ("prompt", "STRING")])
    assert refused_table(auth_headers, wrong) == (
        422, "input_table",
        "input_table: column prompt is not a batch line field; expected custom_id, model, instances, parameters",
    )  # fmt: skip


LINES = 150  # more than a page of rows (tables.PAGE_ROWS) and than the feeder's in-flight bound


def test_rows_added_to_the_table_after_submit_are_not_the_batchs(stack, auth_headers, settings, bigquery):
    # 150 sleep lines, the first held in the stand-in GPU's one call until the gate opens: the feeder stops at its
    # in-flight bound (below 100) inside the first page of rows (PAGE_ROWS, 100), so the second page is listed only
    # after the row added now, and it would be line 151 if the batch read the table rather than its snapshot.
    gate = f"snapshot-{uuid.uuid4().hex}"
    rows = [as_row(line(f"snap-{index}", model="sleep", seed=index)) for index in range(LINES)]
    rows[0]["instances"] = json.dumps([{"prompt": f"!hold {gate}"}])
    table = make_table(bigquery, settings, TEST_API_KEYS[0], rows)
    try:
        batch = requests.post(f"{stack.api_url}/v1/batches", json={"input_table": table}, headers=auth_headers,
                              timeout=60).json()  # fmt: skip
        assert (
            bigquery.insert_rows_json(table.removeprefix("bq://"), [as_row(line("added-later", model="sleep"))]) == []
        )
        assert [row["custom_id"] for row in bigquery.list_rows(table.removeprefix("bq://"))][-1] == "added-later"
    finally:
        open_hold(stack, gate)
    final = wait(stack, auth_headers, batch["id"], timeout=120)
    assert final["status"] == "completed" and final["input_table"] == table, final
    assert final["request_counts"]["total"] == LINES and final["request_counts"]["succeeded"] == LINES, final
    answered = {item["custom_id"] for item in output(stack, auth_headers, batch["id"], "results")}
    assert "added-later" not in answered and len(answered) == LINES


def test_an_empty_table_is_refused_at_submit(stack, auth_headers, settings, bigquery):
    empty = make_table(bigquery, settings, TEST_API_KEYS[0], [])
    response = requests.post(f"{stack.api_url}/v1/batches", json={"input_table": empty}, headers=auth_headers,
                             timeout=60)  # fmt: skip
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["field"], error["message"]) == ("input_table", f"input_table: {empty} holds no rows")
    listed = requests.get(f"{stack.api_url}/v1/batches", headers=auth_headers, timeout=30).json()
    assert all(batch.get("input_table") != empty for batch in listed["batches"]), "no batch was created for it"
