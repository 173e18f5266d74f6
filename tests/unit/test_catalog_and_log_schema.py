"""The catalog and the log schema: single sources of truth that the code, Terraform and Kubernetes share."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime

import pytest

from api_server.inference_log import InferenceLogRow
from contract.catalog import ModelCatalog, load_catalog
from contract.log_schema import log_schema_fields, validate_row


def test_catalog_has_a_text_to_image_and_an_image_to_image_model():
    tasks = {spec.task for spec in load_catalog().models.values()}
    assert tasks == {"text-to-image", "image-to-image"}


def test_model_names_are_valid_pubsub_and_kubernetes_names():
    for name in load_catalog().names():
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", name), name


def test_catalog_rejects_unknown_fields(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("schema_version: 1\nmodels:\n  m:\n    version: '1'\n    surprise: true\n")
    with pytest.raises(ValueError, match="surprise"):
        ModelCatalog.from_yaml(path)


def test_log_row_columns_are_the_schema_columns():
    assert {f.name for f in dataclasses.fields(InferenceLogRow)} == {f["name"] for f in log_schema_fields()}


def test_log_rows_are_validated_before_sending():
    row = InferenceLogRow(request_id="r", created_at=datetime.now(UTC), model="m", status="ok", http_status=200)
    assert validate_row(row.to_json())["created_at"].endswith("+00:00")
    with pytest.raises(ValueError, match="http_status"):
        validate_row({**row.to_json(), "http_status": "200"})
    with pytest.raises(ValueError, match="required"):
        validate_row({k: v for k, v in row.to_json().items() if k != "status"})
    with pytest.raises(ValueError, match="unknown"):
        validate_row({**row.to_json(), "colour": "blue"})
