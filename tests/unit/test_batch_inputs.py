"""A batch's `input_file`: a key names only objects under its own locations (MAAS_BATCH_INPUTS), never the service's
buckets nor another key's inputs, and a refusal reads the same whether the object is missing or forbidden."""

from __future__ import annotations

import pytest
from google.api_core import exceptions

from api_server.batches.inputs import BatchInputPolicy
from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from contract.settings import Settings, api_key_digest

KEY_A, KEY_B = api_key_digest("key-a"), api_key_digest("key-b")
A, B = Caller(KEY_A[:12], KEY_A), Caller(KEY_B[:12], KEY_B)


class Storage:
    """Buckets of object names; a name in `forbidden` raises as GCS does for an object the service cannot read."""

    def __init__(self, objects: dict[str, set[str]], forbidden: set[str] = frozenset()) -> None:
        self.objects, self.forbidden = objects, forbidden

    def bucket(self, name: str) -> Storage._Bucket:
        return Storage._Bucket(self, name)

    class _Bucket:
        def __init__(self, storage: Storage, name: str) -> None:
            self._storage, self._name = storage, name

        def get_blob(self, name: str):
            if f"{self._name}/{name}" in self._storage.forbidden:
                raise exceptions.Forbidden("403 caller does not have storage.objects.get access")
            return object() if name in self._storage.objects.get(self._name, set()) else None


STORAGE = Storage(
    {
        "acme-maas-payloads": {"batches/batch-aaaa/input.jsonl"},
        "acme-maas-models": {"sd15/adapters/x.safetensors"},
        "inputs": {f"{A.key_id}/lines.jsonl", f"{B.key_id}/lines.jsonl"},
        "tenant-a": {"lines.jsonl"},
        "tenant-b": {"secret.jsonl"},
    },
    forbidden={"tenant-a/locked.jsonl"},
)


def policy(inputs: str) -> BatchInputPolicy:
    settings = Settings.from_env({"MAAS_PROJECT_ID": "acme", "MAAS_ENV": "production", "MAAS_BATCH_INPUTS": inputs})
    return BatchInputPolicy(STORAGE, settings.batch_inputs, {settings.model_bucket, settings.payload_bucket})


def refusal(check, uri: str, caller: Caller) -> tuple[int, str]:
    with pytest.raises(ApiError) as refused:
        check.check(uri, caller)
    return refused.value.status, refused.value.message


def test_a_key_reads_its_own_bucket_and_its_own_prefix_of_a_shared_one():
    check = policy(f"{KEY_A}=gs://tenant-a/,*=gs://inputs/{{key_id}}/")
    assert check.check("gs://tenant-a/lines.jsonl", A) == "gs://tenant-a/lines.jsonl"
    assert check.check(f"gs://inputs/{A.key_id}/lines.jsonl", A) == f"gs://inputs/{A.key_id}/lines.jsonl"
    assert check.check(f"gs://inputs/{B.key_id}/lines.jsonl", B) == f"gs://inputs/{B.key_id}/lines.jsonl"


@pytest.mark.parametrize(
    "uri",
    [
        "gs://acme-maas-payloads/batches/batch-aaaa/input.jsonl",  # another key's inline input, in the service's bucket
        "gs://acme-maas-models/sd15/adapters/x.safetensors",  # the service's model bucket
        "gs://tenant-b/secret.jsonl",  # another tenant's bucket
        "gs://inputs/{b}/lines.jsonl",  # another key's prefix of the shared bucket
        "gs://inputs/{a}/../{b}/lines.jsonl",  # out of its prefix by a dot segment
    ],
)
def test_a_key_never_names_the_services_buckets_nor_another_keys_inputs(uri):
    check = policy(f"{KEY_A}=gs://tenant-a/,*=gs://inputs/{{key_id}}/")
    status, message = refusal(check, uri.format(a=A.key_id, b=B.key_id), A)
    assert status == 422 and "not a readable object in this key's batch input locations" in message


def test_a_refusal_reads_the_same_for_a_missing_a_forbidden_and_an_existing_object_outside_the_keys_locations():
    check = policy(f"{KEY_A}=gs://tenant-a/")
    answers = {
        (status, message.replace(uri, "URI"))
        for uri in (
            "gs://tenant-a/missing.jsonl",
            "gs://tenant-a/locked.jsonl",
            "gs://tenant-b/secret.jsonl",
            "gs://tenant-b/missing.jsonl",
        )  # fmt: skip
        for status, message in [refusal(check, uri, A)]
    }
    assert answers == {(422, "input_file: URI is not a readable object in this key's batch input locations "
                              "(this key's: gs://tenant-a/)")}  # fmt: skip


def test_a_key_without_locations_is_told_to_send_its_lines_inline():
    status, message = refusal(policy(f"{KEY_A}=gs://tenant-a/"), "gs://tenant-a/lines.jsonl", B)
    assert status == 422 and message.endswith("(none for this key: send the lines inline)")


@pytest.mark.parametrize("bucket", ["acme-maas-payloads", "acme-maas-models"])
def test_settings_refuse_a_location_in_the_services_own_buckets(bucket):
    with pytest.raises(ValueError, match="the service's own bucket"):
        policy(f"*=gs://{bucket}/")


def test_the_local_stack_gives_each_key_its_own_prefix_of_the_batch_inputs_bucket_and_dataset_and_production_none():
    assert Settings.from_env({"MAAS_PROJECT_ID": "acme"}).batch_inputs == {
        "*": ("gs://acme-maas-batch-inputs/{key_id}/", "bq://acme.maas_batch_inputs.{key_id}_")
    }
    assert Settings.from_env({"MAAS_PROJECT_ID": "acme", "MAAS_ENV": "production"}).batch_inputs == {}
