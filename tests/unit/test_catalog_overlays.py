"""Catalog overlays (MAAS_CATALOG_OVERLAY): files applied in order over models.yaml, each adding models and changing
fields of the entries before it (`overrides`); the local stack's small defaults and the tests' fixtures use them."""

from __future__ import annotations

import pytest
import yaml

from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog, overlay_paths
from contract.settings import Settings


def write(path, document: dict):
    path.write_text(yaml.safe_dump(document))
    return path


def test_overrides_merge_into_an_entry_key_by_key_and_leave_the_rest(tmp_path):
    overlay = write(tmp_path / "small.yaml", {"overrides": {"sdxl-txt2img": {"defaults": {"width": 128}}}})
    production = ModelCatalog.from_yaml().get("sdxl-txt2img")
    spec = ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay).get("sdxl-txt2img")
    assert (spec.defaults.width, spec.defaults.height) == (128, production.defaults.height)
    assert spec.defaults.num_inference_steps == production.defaults.num_inference_steps
    assert spec.model_dump(exclude={"defaults"}) == production.model_dump(exclude={"defaults"})


def test_overlays_apply_in_order_and_a_later_one_may_override_an_earlier_ones_model(tmp_path):
    noop = yaml.safe_load(DEFAULT_CATALOG_PATH.with_name("models.local.yaml").read_text())["models"]["noop"]
    first = write(tmp_path / "first.yaml", {"models": {"extra": noop}})
    second = write(tmp_path / "second.yaml", {"overrides": {"extra": {"request_timeout_seconds": 90}}})
    # MAAS_CATALOG_OVERLAY: comma-separated, as the local stack sets it for the tests' stack.
    catalog = Settings.from_env({"MAAS_CATALOG_OVERLAY": f"{first},{second}"}).catalog()
    assert catalog.get("extra").request_timeout_seconds == 90
    assert overlay_paths(f" {first} ,{second},") == [first, second]
    with pytest.raises(ValueError, match="overrides 'extra', which no catalog file before it lists"):
        ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, [second, first])


def test_an_overlay_with_an_unknown_key_is_refused(tmp_path):
    overlay = write(tmp_path / "typo.yaml", {"override": {"sdxl-txt2img": {"defaults": {"width": 128}}}})
    with pytest.raises(ValueError, match=r"unknown keys \['override'\]"):
        ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)


def test_an_override_is_validated_like_the_entry(tmp_path):
    overlay = write(tmp_path / "bad.yaml", {"overrides": {"flux-schnell": {"defaults": {"width": 250}}}})
    with pytest.raises(ValueError, match="multiple of 16"):
        ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)


LOCAL = DEFAULT_CATALOG_PATH.with_name("models.local.yaml")


def test_a_model_entry_appended_to_the_local_overlay_is_refused_naming_its_section_and_what_a_model_needs(tmp_path):
    # What an operator appends to models.local.yaml to add a versioned model: it lands in the last section, flows.
    appended = tmp_path / "models.local.yaml"
    appended.write_text(LOCAL.read_text() + """\
  sd15-versioned:
    pipeline: StableDiffusionPipeline
    weights_path: sd15-txt2img/1
    versions: {"1": {}, "2": {}}
""")  # fmt: skip
    with pytest.raises(ValueError) as refused:
        ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, appended)
    message = str(refused.value)
    assert message.startswith(f"{appended}: 'sd15-versioned' sits in the `flows:` section"), message
    assert "it is a model entry (pipeline, versions, weights_path), and a flow needs `stages`" in message
    assert "Move it under `models:`, where a model entry needs task, hardware, gpu_sharing, max_batch_size" in message
    assert "(it has none of them: a YAML merge `<<: *anchor` of another entry gives them)" in message
    assert "stages: Field required" not in message


def test_an_override_appended_under_flows_is_pointed_to_overrides(tmp_path):
    appended = tmp_path / "models.local.yaml"
    appended.write_text(LOCAL.read_text() + "  sd15-txt2img:\n    worker_group: sd15-alone\n")
    with pytest.raises(ValueError, match=r"or, to change the listed model 'sd15-txt2img', under `overrides:`"):
        ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, appended)
    # A real flow there still loads.
    assert ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, LOCAL).flow("sd15-hires") is not None
