"""The catalog and the log schema: single sources of truth that the code, Terraform and Kubernetes share."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime

import pytest

from api_server.inference_log.writer import InferenceLogRow
from contract.catalog import ModelCatalog, load_catalog
from contract.log_schema import log_schema_fields, validate_row


def test_catalog_has_a_model_of_every_task():
    from typing import get_args

    from contract.model_spec import TASK_INPUTS, Task

    tasks = {spec.task for spec in load_catalog().models.values()}
    assert tasks == set(get_args(Task)) == set(TASK_INPUTS) == {"text-to-image", "image-to-image", "inpaint", "edit"}


def test_model_names_are_valid_pubsub_and_kubernetes_names():
    for name in load_catalog().names():
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", name), name


def test_catalog_rejects_unknown_fields(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("schema_version: 1\nmodels:\n  m:\n    version: '1'\n    surprise: true\n")
    with pytest.raises(ValueError, match="surprise"):
        ModelCatalog.from_yaml(path)


def catalog_with(tmp_path, **changes):
    import yaml

    from contract.catalog import DEFAULT_CATALOG_PATH

    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    raw["models"]["sd15-txt2img"].update(changes)
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    return ModelCatalog.from_yaml(path)


def test_catalog_scheduling_is_step_or_request_with_a_clear_error(tmp_path):
    assert catalog_with(tmp_path, scheduling="request").get("sd15-txt2img").scheduling == "request"
    with pytest.raises(ValueError, match=r"sd15-txt2img: scheduling 'iteration' is not one of step, request"):
        catalog_with(tmp_path, scheduling="iteration")


def test_catalog_refuses_step_scheduling_for_a_scheduler_that_cannot_step_per_item(tmp_path):
    with pytest.raises(ValueError, match=r"sd15-txt2img: scheduling: step needs .* HeunDiscreteScheduler cannot"):
        catalog_with(tmp_path, scheduling="step", scheduler="HeunDiscreteScheduler")
    assert catalog_with(tmp_path, scheduling="request", scheduler="HeunDiscreteScheduler")
    with pytest.raises(ValueError, match="scheduler 'FancyScheduler' is not one of"):
        catalog_with(tmp_path, scheduler="FancyScheduler")


def test_catalog_refuses_synthetic_runner_switches_where_they_would_do_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"sd15-txt2img: `fails` .* the diffusers runner ignores it: remove it"):
        catalog_with(tmp_path, fails=True)
    with pytest.raises(ValueError, match=r"sd15-txt2img: `call_seconds` .* the diffusers runner ignores it"):
        catalog_with(tmp_path, call_seconds=2.0)
    with pytest.raises(ValueError, match=r"sd15-txt2img: version '2': `fails` .* diffusers runner ignores it"):
        catalog_with(tmp_path, versions={"1": {}, "2": {"fails": True}}, traffic={"1": 90, "2": 10})
    with pytest.raises(ValueError, match=r"sd15-txt2img: `call_seconds` .* the noop runner ignores it"):
        catalog_with(tmp_path, runner="noop", call_seconds=2.0)
    # Where they act: a failing synthetic version, a sleep runner's time per call.
    sleeping = catalog_with(tmp_path, runner="sleep", call_seconds=2.0, fails=True).get("sd15-txt2img")
    assert (sleeping.call_seconds, sleeping.fails) == (2.0, True)


def test_catalog_batching_gain_is_between_one_and_the_batch_size(tmp_path):
    # sd15-txt2img batches 8 images: a full batch runs at 1 to 8 times one image's rate.
    assert catalog_with(tmp_path, batching_gain=8).get("sd15-txt2img").batching_gain == 8
    assert catalog_with(tmp_path, batching_gain=2.5).get("sd15-txt2img").batching_gain == 2.5
    for bad in (0.5, 0, -1, float("nan")):
        with pytest.raises(ValueError, match="batching_gain"):
            catalog_with(tmp_path, batching_gain=bad)
    for bad in (8.5, float("inf")):
        with pytest.raises(ValueError, match=r"sd15-txt2img: batching_gain \S+ exceeds max_batch_size 8"):
            catalog_with(tmp_path, batching_gain=bad)
    with pytest.raises(ValueError, match="batching_gain"):
        catalog_with(tmp_path, batching_gain="fast")


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
