"""A batch's lines in flight per model follow the capacity its batch workers can use (contract/batch_capacity.py):
the batch Deployment's max replicas × the model's max_batch_size × BATCH_BACKLOG_CALLS, not a fixed 64, so a batch
can bring up every Spot worker the manifests allow; `MAAS_BATCH_MAX_IN_FLIGHT` still overrides it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from contract.batch_capacity import BATCH_BACKLOG_CALLS, batch_in_flight_bound
from contract.catalog import DEFAULT_CATALOG_PATH, load_catalog
from contract.settings import Settings
from tests.unit import batch_harness
from tests.unit.batch_harness import Harness
from tests.unit.test_step_scheduler import CATALOG

redis_server = batch_harness.redis_server  # one redis-server for the module
ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = load_catalog(str(DEFAULT_CATALOG_PATH))


@pytest.fixture
def client(redis_server):
    redis_server.flushall()
    return redis_server


def renderer():
    spec = importlib.util.spec_from_file_location("maas_k8s_render_capacity", ROOT / "infra" / "k8s" / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_settings_default_to_the_derived_bound_and_read_the_batch_replicas():
    assert Settings.from_env({}).batch_max_in_flight == 0  # 0: derived
    assert Settings.from_env({}).batch_worker_max_replicas is None  # the catalog's replicas.max
    settings = Settings.from_env({"MAAS_BATCH_WORKER_MAX_REPLICAS": "3", "MAAS_BATCH_MAX_IN_FLIGHT": "10"})
    assert (settings.batch_worker_max_replicas, settings.batch_max_in_flight) == (3, 10)
    assert Settings.from_env({"MAAS_BATCH_WORKER_MAX_REPLICAS": "0"}).batch_worker_max_replicas == 0


@pytest.mark.parametrize("batch_max_replicas", [None, 3])
def test_each_production_model_can_fill_every_spot_worker_its_batch_deployment_may_run(batch_max_replicas):
    """The bound over the rendered KEDA target per worker reaches the rendered maxReplicaCount, for every model."""
    render = renderer()
    files = render.render_all(render.RenderSettings(project_id="p", batch_max_replicas=batch_max_replicas))
    for spec in PRODUCTION.units():
        name = f"model-batch-{spec.deployment}"
        (scaled,) = [
            doc for doc in files[f"30-{name}.yaml"] if doc["kind"] == "ScaledObject" and doc["metadata"]["name"] == name
        ]
        replicas = scaled["spec"]["maxReplicaCount"]
        per_worker = int(scaled["spec"]["triggers"][0]["metadata"]["threshold"])
        bound = batch_in_flight_bound(PRODUCTION, spec, batch_max_replicas)
        assert bound == replicas * spec.max_batch_size * BATCH_BACKLOG_CALLS, spec.queue
        assert bound >= replicas * per_worker, f"{spec.queue}: {bound} lines bring up fewer than {replicas} workers"


def test_the_bound_follows_replicas_and_batch_size_and_the_explicit_setting_wins():
    sd15 = PRODUCTION.get("sd15-txt2img")
    assert batch_in_flight_bound(PRODUCTION, sd15) == sd15.replicas.max * sd15.max_batch_size * BATCH_BACKLOG_CALLS
    assert batch_in_flight_bound(PRODUCTION, sd15, 2) == 2 * sd15.max_batch_size * BATCH_BACKLOG_CALLS
    assert batch_in_flight_bound(PRODUCTION, sd15, 2, explicit=10) == 10
    # No batch Deployments: the on-demand workers, which take batch lines when idle, are the capacity.
    assert batch_in_flight_bound(PRODUCTION, sd15, 0) == batch_in_flight_bound(PRODUCTION, sd15)
    # A worker group runs as many workers as its largest member allows, for each member.
    sleep, noop = CATALOG.get("sleep"), CATALOG.get("noop")
    largest = max(spec.replicas.max for spec in CATALOG.deployments()[sleep.deployment])
    assert batch_in_flight_bound(CATALOG, sleep) == largest * sleep.max_batch_size * BATCH_BACKLOG_CALLS
    assert batch_in_flight_bound(CATALOG, noop) == largest * noop.max_batch_size * BATCH_BACKLOG_CALLS


def test_the_feeder_publishes_up_to_the_derived_bound_and_then_waits(client):
    settings = Settings.from_env({"MAAS_BATCH_WORKER_MAX_REPLICAS": "5"})
    harness = Harness(client, batch_worker_max_replicas=settings.batch_worker_max_replicas)
    sleep = CATALOG.get("sleep")
    bound = 5 * sleep.max_batch_size * BATCH_BACKLOG_CALLS
    assert bound > 64  # the old fixed bound
    batch_id = harness.submit([f"c{index}" for index in range(bound + 20)])
    harness.step_until(batch_id, lambda: len(harness.inference.published) >= bound)
    harness.runner.step(batch_id)  # a further step publishes nothing: the share is full
    assert len(harness.inference.published) == bound
    assert harness.runner.in_flight_bound(sleep) == bound
    harness.runner.stop()


def test_the_explicit_setting_bounds_the_feeder(client):
    harness = Harness(client, batch_max_in_flight=7, batch_worker_max_replicas=5)
    batch_id = harness.submit([f"c{index}" for index in range(30)])
    harness.step_until(batch_id, lambda: len(harness.inference.published) >= 7)
    harness.runner.step(batch_id)
    assert len(harness.inference.published) == 7
    harness.runner.stop()


def test_the_local_stacks_api_sizes_batches_by_its_own_workers_not_the_catalogs_replicas(tmp_path):
    from emulators.stack import StackConfig, api_component, local_catalog

    catalog = local_catalog()
    sleep = catalog.get("sleep")
    assert sleep.replicas.max == 2  # what production would scale to; a local stack starts one worker
    for replicas in (1, 3):
        env = api_component(StackConfig(stack_dir=tmp_path, worker_replicas=replicas)).env
        workers = Settings.from_env(env).batch_worker_max_replicas
        assert workers == replicas
        assert batch_in_flight_bound(catalog, sleep, workers) == replicas * sleep.max_batch_size * BATCH_BACKLOG_CALLS
    # An operator's own setting still wins.
    chosen = StackConfig(stack_dir=tmp_path, environment={"MAAS_BATCH_WORKER_MAX_REPLICAS": "5"})
    assert Settings.from_env(api_component(chosen).env).batch_worker_max_replicas == 5
