"""The inference log table's schema, loaded from the JSON file Terraform also reads."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

SCHEMA_PATH = Path(__file__).with_name("inference_log_schema.json")
# The rollout audit table (who changed a model's traffic split, when, from what, to what); Terraform reads it too.
AUDIT_SCHEMA_PATH = Path(__file__).with_name("rollout_audit_schema.json")


@cache
def _schema_text() -> str:
    return SCHEMA_PATH.read_text()


def log_schema_fields() -> list[dict]:
    """A fresh copy each call: callers may change it; the file is read once per process."""
    return json.loads(_schema_text())


@cache
def _fields_by_name() -> dict[str, dict]:
    return {field["name"]: field for field in log_schema_fields()}


def bigquery_schema() -> list:
    from google.cloud import bigquery

    return [bigquery.SchemaField.from_api_repr(field) for field in log_schema_fields()]


def audit_bigquery_schema() -> list:
    from google.cloud import bigquery

    return [bigquery.SchemaField.from_api_repr(field) for field in json.loads(AUDIT_SCHEMA_PATH.read_text())]


def validate_row(row: dict) -> dict:
    """Reject rows BigQuery would refuse: the emulator accepts bad rows silently, so check here."""
    fields = _fields_by_name()
    unknown = set(row) - set(fields)
    if unknown:
        raise ValueError(f"unknown log columns: {sorted(unknown)}")
    for name, field in fields.items():
        value = row.get(name)
        if value is None:
            if field["mode"] == "REQUIRED":
                raise ValueError(f"log column {name} is required")
            continue
        expected = _PYTHON_TYPES[field["type"]]
        if not isinstance(value, expected) or (field["type"] != "BOOLEAN" and isinstance(value, bool)):
            raise ValueError(f"log column {name} must be {field['type']}, got {type(value).__name__}")
    return row


_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "STRING": (str,),
    "TIMESTAMP": (str,),
    "INTEGER": (int,),
    "FLOAT": (float, int),
    "BOOLEAN": (bool,),
}


# The table is partitioned by day on the request time and clustered for the usual filters (Terraform and
# the local bootstrap both follow these; tests/infra cross-checks Terraform).
PARTITION_FIELD = "created_at"
CLUSTERING_FIELDS = ["model", "api_key_id"]
