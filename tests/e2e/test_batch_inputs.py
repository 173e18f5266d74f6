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
from tests.conftest import TEST_API_KEYS
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
