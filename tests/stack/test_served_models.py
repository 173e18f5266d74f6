"""What `make up` serves a user (emulators/stack.py as `make up` runs it) and what the test suite's stack serves:
the catalog's models and the local ones, with small defaults for the tiny pipelines; the tests' fixture models
only on the tests' stack (tests/conftest.py)."""

from __future__ import annotations

import os

import yaml

from contract.catalog import load_catalog
from contract.settings import Settings
from emulators import stack as stack_module
from emulators.stack import (
    LOCAL_CATALOG_OVERLAY,
    TEST_CATALOG_OVERLAY,
    StackConfig,
    api_component,
    banner,
    worker_components,
)
from tests.conftest import stack_config

PRODUCTION = load_catalog()  # contract/models.yaml alone: what Terraform and the Kubernetes renderer read
LOCAL_ONLY = {"noop", "sleep", "flux-versions", "sdxl-refiner", "sd15-lcm", "flux-schnell-cached"}
# The integration and e2e tests' models: rollouts, fallback, shadows, the re-dispatch tests' long ack deadline and
# the batch lines' stepped and slow synthetic models.
FIXTURES = {
    "canary", "canary-sticky", "fallback", "rollback-bad", "rollback-good", "rollback-jobs", "shadowed",
    "shadowed-once", "sleep-long-ack", "sleep-steps", "sleep-calls", "relay-draft", "relay-finish", "relay-polish",
    "relay-polish-canary", "sleep-admitted",
}  # fmt: skip
# Locally, the flows' models share a worker group each (SD 1.5's two, the SDXL base and refiner); the others have a
# deployment of their own, as in production.
USER_WORKERS = {"worker-sd15", "worker-sdxl", "worker-flux-schnell", "worker-sd35-txt2img", "worker-synthetic",
                "worker-flux-versions", "worker-sd15-lcm", "worker-new-families"}  # fmt: skip
# Models whose local limits are lower than the catalog's: Qwen-Image (and its image-to-image) shares the local
# `new-families` worker with Z-Image-Turbo's weights, and the memory plan holds its decode beside them only up to
# 1024x1024.
LOCAL_LIMITS = {"qwen-image", "qwen-image-img2img"}
# What the local overlay changes beside the defaults: the flows' worker groups (one pod's placement) and SD 1.5's
# image-to-image on the text-to-image weights (one set of components); the hardware the memory plan wants for a
# group, and FLUX.1 and SD 3.5 unquantized (compared with diffusers' own pipeline on the CPU).
LOCAL_GROUPING = {"worker_group", "gpu_sharing", "weights_path", "hardware", "quantization"}
# Control models on FLUX.1 [schnell] and SD 3.5 only where the card holds them (the local 80 GB entries; the L4s of
# production leave no room for their ControlNets' activations: docs/concepts/memory-plan.md).
LOCAL_CONTROLS = {"flux-schnell", "sd35-txt2img"}


def make_up_config(tmp_path) -> StackConfig:
    """The settings `make up` starts a stack with (`python -m emulators.stack up`: StackConfig.from_env)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MAAS_")}
    return StackConfig.from_env({**env, "MAAS_STACK_DIR": str(tmp_path)})


def served(env: dict[str, str]) -> list[str]:
    """The models a process of the stack serves: the catalog its environment names."""
    return Settings.from_env(env).catalog().names()


def test_make_up_lists_only_the_models_a_user_is_meant_to_see(tmp_path, monkeypatch):
    config = make_up_config(tmp_path)
    assert not config.test_fixtures
    names = set(config.catalog().names())
    assert names == set(PRODUCTION.names()) | LOCAL_ONLY
    assert not names & FIXTURES
    # The API and every worker it starts read that catalog, and no worker serves a test fixture.
    assert set(served(api_component(config).env)) == names
    workers = worker_components(config)
    assert {worker.name for worker in workers} == USER_WORKERS
    assert len(workers) == len(USER_WORKERS)
    for worker in workers:
        assert not set(worker.env["MAAS_MODELS"].split(",")) & FIXTURES, worker.name
        assert set(served(worker.env)) == names
    # What `make up` prints lists the same models.
    listed = next(line for line in banner(config, foreground=False).splitlines() if line.startswith("The stack is up"))
    assert set(listed.partition(", models ")[2].split(", ")) == names
    # The topics and subscriptions it creates are for the same catalog.
    created: list = []
    monkeypatch.setattr(os, "environ", dict(os.environ))  # bootstrap_resources sets the emulators' variables
    monkeypatch.setattr("emulators.bootstrap.bootstrap", lambda settings, catalog: created.append(catalog) or [])
    stack_module.bootstrap_resources(config)
    assert set(created[0].names()) == names


def test_the_test_suites_stack_still_serves_the_fixture_models_its_tests_use(tmp_path):
    config = stack_config(tmp_path)
    names = set(config.catalog().names())
    assert names == set(PRODUCTION.names()) | LOCAL_ONLY | FIXTURES
    assert set(served(api_component(config).env)) == names
    workers = {worker.name: worker for worker in worker_components(config)}
    assert set(workers) == USER_WORKERS | {
        "worker-rollouts",
        "worker-rollouts-shadow",
        "worker-relay",
        "worker-admission",
    }
    assert workers["worker-synthetic"].env["MAAS_MODELS"] == "noop,sleep,sleep-long-ack,sleep-steps,sleep-calls"
    # Probe ports: `make up`'s workers keep theirs, the fixtures' workers come after them.
    user = {worker.name: worker.port for worker in worker_components(make_up_config(tmp_path / "user"))}
    assert all(workers[name].port - config.port_offset == port for name, port in user.items())
    # Recorded with the stack, so a restart or the supervisor starts the same workers.
    config.save()
    assert StackConfig.load(tmp_path).test_fixtures
    # A developer's stack with the fixtures: MAAS_STACK_TEST_FIXTURES=1 make up.
    assert StackConfig.from_env({"MAAS_STACK_TEST_FIXTURES": "1"}).test_fixtures


def test_the_fixture_overlay_holds_only_fixtures_and_its_template_is_the_local_noop():
    fixtures = yaml.safe_load(TEST_CATALOG_OVERLAY.read_text())
    assert set(fixtures["models"]) == FIXTURES
    local = yaml.safe_load(LOCAL_CATALOG_OVERLAY.read_text())
    assert set(local["models"]) == LOCAL_ONLY
    # YAML anchors do not cross files: the fixtures' base is a copy of `noop`, kept equal to it.
    assert fixtures["templates"]["synthetic"] == local["models"]["noop"]


def test_the_tiny_local_models_have_small_defaults_and_production_keeps_its_own(tmp_path):
    local = make_up_config(tmp_path).catalog()
    for name in PRODUCTION.names():
        spec, production = local.get(name), PRODUCTION.get(name)
        # Seconds on a CPU, not minutes: at most 256x256 and 8 steps unless asked for more.
        assert spec.defaults.width * spec.defaults.height <= 256 * 256, name
        assert spec.defaults.num_inference_steps <= 8, name
        # Only the defaults (and the flows' grouping) change: limits, guidance and everything else stay the catalog's.
        assert spec.defaults.guidance_scale == production.defaults.guidance_scale, name
        if name in LOCAL_LIMITS:
            assert spec.limits.max_width < production.limits.max_width, name
        else:
            assert spec.limits == production.limits, name
        kept = {"defaults", *LOCAL_GROUPING} | ({"limits"} if name in LOCAL_LIMITS else set())
        if name in LOCAL_CONTROLS:
            assert production.controls is None and spec.controls is not None, name
            kept.add("controls")
        assert spec.model_dump(exclude=kept) == production.model_dump(exclude=kept), name
    assert local.get("sd15-img2img").weights_path == local.get("sd15-txt2img").weights_path
    assert {spec.deployment for spec in (local.get("sdxl-txt2img"), local.get("sdxl-refiner"))} == {"sdxl"}
    # The production catalog keeps the real models' defaults (Terraform and the cluster read only it).
    sdxl = PRODUCTION.get("sdxl-txt2img").defaults
    assert (sdxl.width, sdxl.height, sdxl.num_inference_steps) == (1024, 1024, 30)
    assert PRODUCTION.get("sd35-txt2img").defaults.width == PRODUCTION.get("flux-schnell").defaults.width == 1024
