"""The rendered Kubernetes manifests: schema-valid, and faithful to the model catalog and the article's design."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog, load_catalog  # noqa: E402
from contract.model_spec import ModelSpec  # noqa: E402
from contract.naming import INTERACTIVE_PRIORITIES, PRIORITIES, worker_subscription  # noqa: E402

# GKE's stable and regular release channels; kubernetes-validate bundles these schemas offline.
GKE_KUBERNETES_VERSIONS = ("1.32", "1.33", "1.34")
KEDA_API_VERSION = "keda.sh/v1alpha1"
# CRDs: kubernetes-validate ships no schema for them, so they are checked by hand below.
CRD_API_VERSIONS = {KEDA_API_VERSION, "monitoring.googleapis.com/v1"}
PROJECT_ID = "test-project"
CATALOG = load_catalog()
MODELS = CATALOG.names()
# Worker deployments: a catalog worker_group, or a model of its own.
DEPLOYMENTS = list(CATALOG.deployments())
LOCAL_OVERLAY = DEFAULT_CATALOG_PATH.with_name("models.local.yaml")
TEST_OVERLAY = REPO_ROOT / "tests" / "models.fixtures.yaml"

Manifest = dict[str, Any]


def load_renderer() -> ModuleType:
    # Loaded by path: `infra/` is not a package, and `tests/infra` would shadow it if it were.
    spec = importlib.util.spec_from_file_location("maas_k8s_render", REPO_ROOT / "infra" / "k8s" / "render.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render = load_renderer()


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    files = render.render_all(render.RenderSettings(project_id=PROJECT_ID, image_tag="abc1234"))
    return [manifest for group in files.values() for manifest in group]


def find(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def worker_deployment(manifests: list[Manifest], deployment: str) -> Manifest:
    return find(manifests, "Deployment", f"model-worker-{deployment}")


def worker_container(manifests: list[Manifest], deployment: str) -> Manifest:
    (container,) = worker_deployment(manifests, deployment)["spec"]["template"]["spec"]["containers"]
    return container


def worker_env(manifests: list[Manifest], deployment: str) -> dict[str, Manifest]:
    return {entry["name"]: entry for entry in worker_container(manifests, deployment)["env"]}


def pod_spec(deployment: Manifest) -> Manifest:
    return deployment["spec"]["template"]["spec"]


def millicores(quantity: str) -> int:
    return int(quantity.removesuffix("m")) if quantity.endswith("m") else int(float(quantity) * 1000)


def mebibytes(quantity: str) -> int:
    units = {"Mi": 1, "Gi": 1024}
    return int(quantity[:-2]) * units[quantity[-2:]]


def model_spec(model: str) -> ModelSpec:
    return CATALOG.models[model]


def members(deployment: str) -> list[ModelSpec]:
    return CATALOG.deployments()[deployment]


def with_local_overlay() -> ModelCatalog:
    """The catalog plus the local stack's models and the tests' (`noop`, `sleep`, `sleep-long-ack`, `sleep-steps`,
    `sleep-calls`: one worker group, a real one)."""
    return ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay=[LOCAL_OVERLAY, TEST_OVERLAY])


def catalog_with(**changes: dict[str, Any]) -> ModelCatalog:
    """models.yaml with some models' fields changed, e.g. catalog_with(a={"worker_group": "g"})."""
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    for model, fields in changes.items():
        raw["models"][model].update(fields)
    raw["models"] = {name: {**spec, "name": name} for name, spec in raw["models"].items()}
    return ModelCatalog.model_validate(raw)


# --- schemas -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kubernetes_version", GKE_KUBERNETES_VERSIONS)
def test_every_native_manifest_validates_against_the_kubernetes_schema(
    manifests: list[Manifest], kubernetes_version: str
) -> None:
    native = [m for m in manifests if m["apiVersion"] not in CRD_API_VERSIONS]
    assert native
    for manifest in native:
        # strict: unknown fields (a misspelt probe, say) fail instead of being silently dropped.
        kubernetes_validate.validate(manifest, kubernetes_version, strict=True)


def test_keda_resources_are_structurally_valid(manifests: list[Manifest]) -> None:
    # kubernetes-validate has no schemas for CRDs, so the KEDA objects are checked by hand here.
    keda = [m for m in manifests if m["apiVersion"] == KEDA_API_VERSION]
    assert {m["kind"] for m in keda} == {"ScaledObject", "TriggerAuthentication"}
    trigger_auth_names = {m["metadata"]["name"] for m in of_kind(keda, "TriggerAuthentication")}
    for manifest in keda:
        assert set(manifest) == {"apiVersion", "kind", "metadata", "spec"}
        assert manifest["metadata"]["name"] and manifest["metadata"]["namespace"] == "maas"
    for scaled_object in of_kind(keda, "ScaledObject"):
        spec = scaled_object["spec"]
        target = spec["scaleTargetRef"]
        assert target["apiVersion"] == "apps/v1" and target["kind"] == "Deployment"
        find(manifests, "Deployment", target["name"])
        assert isinstance(spec["minReplicaCount"], int) and isinstance(spec["maxReplicaCount"], int)
        assert spec["triggers"]
        for trigger in spec["triggers"]:
            # gcp-pubsub is deprecated upstream (it relies on Cloud Monitoring's MQL).
            assert trigger["type"] == "prometheus"
            assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold", "activationThreshold"}
            assert trigger.get("metricType", "AverageValue") in {"AverageValue", "Value", "Utilization"}
            assert trigger["authenticationRef"]["name"] in trigger_auth_names
            # KEDA rejects non-string metadata values.
            assert all(isinstance(value, str) for value in trigger["metadata"].values()), trigger
    for trigger_auth in of_kind(keda, "TriggerAuthentication"):
        assert trigger_auth["spec"] == {"podIdentity": {"provider": "gcp"}}


def test_pod_monitorings_are_structurally_valid(manifests: list[Manifest]) -> None:
    # Managed Service for Prometheus' CRD; kubernetes-validate has no schema for it either.
    monitorings = [m for m in manifests if m["apiVersion"] == "monitoring.googleapis.com/v1"]
    assert {m["kind"] for m in monitorings} == {"PodMonitoring"}
    for monitoring in monitorings:
        assert set(monitoring) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(monitoring["spec"]) == {"selector", "endpoints"}
        assert set(monitoring["spec"]["selector"]) == {"matchLabels"}
        for endpoint in monitoring["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "scheme", "interval", "timeout"}
            assert re.fullmatch(r"\d+(ms|s|m)", endpoint["interval"])


def test_manifest_names_are_unique(manifests: list[Manifest]) -> None:
    keys = [(m["kind"], m["metadata"].get("namespace"), m["metadata"]["name"]) for m in manifests]
    assert len(keys) == len(set(keys))


def test_every_namespaced_manifest_is_in_the_maas_namespace(manifests: list[Manifest]) -> None:
    cluster_scoped = {"Namespace", "PriorityClass"}
    for manifest in manifests:
        if manifest["kind"] not in cluster_scoped:
            assert manifest["metadata"]["namespace"] == "maas", manifest["metadata"]["name"]


# --- model workers -------------------------------------------------------------------------------


def test_every_catalog_deployment_gets_exactly_one_worker_deployment(manifests: list[Manifest]) -> None:
    workers = [m for m in of_kind(manifests, "Deployment") if m["metadata"]["name"].startswith("model-worker-")]
    assert sorted(m["metadata"]["name"] for m in workers) == sorted(f"model-worker-{name}" for name in DEPLOYMENTS)


def test_every_catalog_model_is_served_by_exactly_one_worker_deployment(manifests: list[Manifest]) -> None:
    served = [model for name in DEPLOYMENTS for model in worker_env(manifests, name)["MAAS_MODELS"]["value"].split(",")]
    assert sorted(served) == MODELS


def test_only_the_production_catalog_is_rendered(manifests: list[Manifest]) -> None:
    # models.local.yaml's synthetic models are for the local stack; a cluster never runs them (a local-only entry may
    # sit in a production group's worker, as flux-schnell-cached does: that group is rendered, without it).
    local_only = {spec.name: spec.deployment for spec in with_local_overlay().models.values()}
    for model in MODELS:
        del local_only[model]
    assert local_only
    names = {m["metadata"]["name"] for m in manifests}
    assert not {f"model-worker-{deployment}" for deployment in set(local_only.values()) - set(DEPLOYMENTS)} & names
    text = render.dump(manifests)
    assert not [model for model in local_only if f"maas-requests-{model}-" in text]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_runs_the_catalog_models_with_production_settings(manifests: list[Manifest], deployment: str) -> None:
    env = worker_env(manifests, deployment)
    assert env["MAAS_MODELS"]["value"] == ",".join(spec.name for spec in members(deployment))
    assert "MAAS_MODEL" not in env, "MAAS_MODEL is gone: the worker reads MAAS_MODELS"
    for name in ("MAAS_PROJECT_ID", "MAAS_ENV", "MAAS_REDIS_URL"):
        assert env[name]["valueFrom"]["configMapKeyRef"] == {"name": "maas-config", "key": name}
    config = find(manifests, "ConfigMap", "maas-config")["data"]
    assert config["MAAS_ENV"] == "production"
    assert config["MAAS_PROJECT_ID"] == PROJECT_ID
    assert config["MAAS_REDIS_URL"].startswith("redis://")
    assert env["MAAS_WORKER_HEALTH_PORT"]["value"] == str(render.WORKER_HEALTH_PORT)


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_writes_weights_and_caches_to_volumes_sized_for_them(manifests: list[Manifest], deployment: str) -> None:
    container = worker_container(manifests, deployment)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod_spec(worker_deployment(manifests, deployment))["volumes"]}
    for variable in ("MAAS_WEIGHTS_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME"):
        (mount_path,) = [path for path in mounts if env[variable].startswith(path + "/")]
        assert volumes[mounts[mount_path]]["name"] == "model-cache", variable
    # Twice the deployment's weights files (the memory plan's, in the serving dtype), at least 20 GiB.
    files = sum(unit.file_bytes for unit in CATALOG.deployment_plans()[deployment].units)
    cache = mebibytes(volumes["model-cache"]["emptyDir"]["sizeLimit"]) * 2**20
    assert cache >= max(2 * files, 20 * 2**30)
    assert mebibytes(container["resources"]["requests"]["ephemeral-storage"]) * 2**20 > cache


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_runs_the_image_cloud_build_pushes(manifests: list[Manifest], deployment: str) -> None:
    image = worker_container(manifests, deployment)["image"]
    assert image == f"us-central1-docker.pkg.dev/{PROJECT_ID}/maas/worker:abc1234"


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_has_startup_readiness_and_liveness_probes_on_the_worker_endpoints(
    manifests: list[Manifest], deployment: str
) -> None:
    container = worker_container(manifests, deployment)
    (health_port,) = container["ports"]
    assert health_port == {"name": "health", "containerPort": 8081, "protocol": "TCP"}
    paths = {
        "startupProbe": "/startupz",
        "readinessProbe": "/readyz",
        "livenessProbe": "/livez",
    }
    for probe_name, path in paths.items():
        assert container[probe_name]["httpGet"] == {"path": path, "port": "health"}, probe_name


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_startup_probe_allows_at_least_ten_minutes_for_the_weight_download(
    manifests: list[Manifest], deployment: str
) -> None:
    probe = worker_container(manifests, deployment)["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 10 * 60


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_requests_one_gpu_and_guaranteed_resources(manifests: list[Manifest], deployment: str) -> None:
    resources = worker_container(manifests, deployment)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"] == resources["limits"]
    assert {"cpu", "memory", "ephemeral-storage"} <= set(resources["requests"])


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_runs_at_high_priority(manifests: list[Manifest], deployment: str) -> None:
    assert pod_spec(worker_deployment(manifests, deployment))["priorityClassName"] == "maas-high-priority"


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_is_placed_on_its_catalog_gpu_pool(manifests: list[Manifest], deployment: str) -> None:
    spec = pod_spec(worker_deployment(manifests, deployment))
    for model in members(deployment):
        accelerator = {
            "l4": "nvidia-l4",
            "a100": "nvidia-tesla-a100",
            "a100-80": "nvidia-a100-80gb",
            "h100": "nvidia-h100-80gb",
        }[model.hardware]
        assert spec["nodeSelector"]["cloud.google.com/gke-accelerator"] == accelerator
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_gpu_sharing_decides_between_time_shared_and_dedicated_gpus(manifests: list[Manifest], deployment: str) -> None:
    spec = pod_spec(worker_deployment(manifests, deployment))
    selector = spec["nodeSelector"]
    (sharing,) = {model.gpu_sharing for model in members(deployment)}
    if sharing:
        assert selector["cloud.google.com/gke-gpu-sharing-strategy"] == "time-sharing"
        assert int(selector["cloud.google.com/gke-max-shared-clients-per-gpu"]) >= 2
    else:
        assert "cloud.google.com/gke-gpu-sharing-strategy" not in selector
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert {"key": "cloud.google.com/gke-gpu-sharing-strategy", "operator": "DoesNotExist"} in term[
            "matchExpressions"
        ]


def test_catalog_exercises_both_gpu_placements() -> None:
    # Otherwise the test above checks only one branch.
    assert {spec.gpu_sharing for spec in CATALOG.models.values()} == {True, False}


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_termination_grace_period_exceeds_every_models_drain_time(manifests: list[Manifest], deployment: str) -> None:
    grace = pod_spec(worker_deployment(manifests, deployment))["terminationGracePeriodSeconds"]
    assert grace > max(model.drain_seconds for model in members(deployment))


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_uses_workload_identity(manifests: list[Manifest], deployment: str) -> None:
    assert pod_spec(worker_deployment(manifests, deployment))["serviceAccountName"] == "model-worker"
    account = find(manifests, "ServiceAccount", "model-worker")
    assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == (
        f"maas-worker@{PROJECT_ID}.iam.gserviceaccount.com"
    )


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_replica_count_is_left_to_the_autoscaler(manifests: list[Manifest], deployment: str) -> None:
    assert "replicas" not in worker_deployment(manifests, deployment)["spec"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_deployment_has_a_disruption_budget_selecting_its_workers(
    manifests: list[Manifest], deployment: str
) -> None:
    budget = find(manifests, "PodDisruptionBudget", f"model-worker-{deployment}")
    pod_labels = worker_deployment(manifests, deployment)["spec"]["template"]["metadata"]["labels"]
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["maas/deployment"] == deployment


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_worker_metrics_are_scraped_by_managed_prometheus_on_the_probe_port(
    manifests: list[Manifest], deployment: str
) -> None:
    monitoring = find(manifests, "PodMonitoring", f"model-worker-{deployment}")
    pod_labels = worker_deployment(manifests, deployment)["spec"]["template"]["metadata"]["labels"]
    assert monitoring["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitoring["spec"]["endpoints"]
    (port,) = worker_container(manifests, deployment)["ports"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


def scaled_object_triggers(manifests: list[Manifest], deployment: str) -> dict[str, Manifest]:
    scaled = find(manifests, "ScaledObject", f"model-worker-{deployment}")
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"model-worker-{deployment}"
    return {trigger["name"]: trigger for trigger in scaled["spec"]["triggers"]}


def queried_subscriptions(query: str) -> set[str]:
    (names,) = re.findall(r'subscription_id=~"([^"]*)"', query)
    return set(names.split("|"))


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_scaled_object_queries_every_subscription_of_the_deployment_in_managed_prometheus(
    manifests: list[Manifest], deployment: str
) -> None:
    # The interactive queues only: a batch backlog never scales on-demand GPUs (the Spot batch Deployment's job).
    expected = {
        worker_subscription(model.name, priority)
        for model in members(deployment)
        for priority in INTERACTIVE_PRIORITIES
    }
    triggers = scaled_object_triggers(manifests, deployment)
    assert set(triggers) == {"backlog-per-worker", "oldest-request-age"}
    for trigger in triggers.values():
        metadata = trigger["metadata"]
        assert metadata["serverAddress"] == (
            f"https://monitoring.googleapis.com/v1/projects/{PROJECT_ID}/location/global/prometheus"
        )
        assert queried_subscriptions(metadata["query"]) == expected
        assert f'project_id="{PROJECT_ID}"' in metadata["query"]
        assert 'monitored_resource="pubsub_subscription"' in metadata["query"]
    backlog = triggers["backlog-per-worker"]["metadata"]["query"]
    assert backlog.startswith("sum(pubsub_googleapis_com:subscription_num_undelivered_messages{")
    age = triggers["oldest-request-age"]["metadata"]["query"]
    assert age.startswith("max(pubsub_googleapis_com:subscription_oldest_unacked_message_age{")


def test_a_deployment_serving_a_flows_later_stage_counts_the_flows_held_before_it_in_its_backlog(tmp_path) -> None:
    """A flow reaches its second stage's queue only when its first stage finishes: the workers holding it count it
    (`maas_worker_flows_ahead`, per queue), and the second stage's Deployment adds that to its backlog, so it is
    scaled (from zero too) while the first stage runs, not one stage late."""
    overlay = tmp_path / "flows.yaml"
    overlay.write_text(yaml.safe_dump({"flows": {"hires": {"stages": [
        {"name": "base", "model": "sd15-txt2img", "resize": {"scale": 2, "space": "pixel"}},
        {"name": "hires", "model": "sd15-img2img"},
    ]}}}))  # fmt: skip
    catalog = ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)
    files = render.render_all(render.RenderSettings(project_id=PROJECT_ID, image_tag="abc1234"), catalog)
    rendered = [manifest for group in files.values() for manifest in group]
    later = scaled_object_triggers(rendered, "sd15-img2img")["backlog-per-worker"]["metadata"]["query"]
    assert later.endswith(
        f' + (sum(maas_worker_flows_ahead{{project_id="{PROJECT_ID}",queue=~"sd15-img2img",priority!="batch"}}) '
        "or vector(0))"
    )
    assert queried_subscriptions(later) == {worker_subscription("sd15-img2img", p) for p in INTERACTIVE_PRIORITIES}
    first = scaled_object_triggers(rendered, "sd15-txt2img")["backlog-per-worker"]["metadata"]["query"]
    assert "maas_worker_flows_ahead" not in first  # the flow is its first stage's own backlog
    batch = [m for m in of_kind(rendered, "ScaledObject") if m["metadata"]["name"].startswith("model-batch-")]
    assert batch and all("maas_worker_flows_ahead" not in str(m["spec"]["triggers"]) for m in batch)


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_backlog_target_follows_the_catalog_batching_gain(manifests: list[Manifest], deployment: str) -> None:
    trigger = scaled_object_triggers(manifests, deployment)["backlog-per-worker"]
    assert trigger["metricType"] == "AverageValue"
    target = min(render.BACKLOG_TARGET_UTILIZATION * model.batching_gain for model in members(deployment))
    assert float(trigger["metadata"]["threshold"]) == pytest.approx(target, abs=0.005)


@pytest.mark.parametrize(("gain", "threshold"), [(1, "0.6"), (1.5, "0.9"), (3.08, "1.85"), (4, "2.4")])
def test_a_larger_batching_gain_renders_a_proportionally_larger_backlog_target(gain: float, threshold: str) -> None:
    # No gain from batching (a compute-bound call): a worker is full with one request running, so the target is
    # under one; a full batch costing little more than one image lets a worker take several.
    model = MODELS[0]
    group = render.render_all(
        render.RenderSettings(project_id=PROJECT_ID), catalog_with(**{model: {"batching_gain": gain}})
    )
    triggers = scaled_object_triggers(group[f"20-model-worker-{model}.yaml"], model)
    assert triggers["backlog-per-worker"]["metadata"]["threshold"] == threshold


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_scaled_object_replica_bounds_come_from_the_catalog(manifests: list[Manifest], deployment: str) -> None:
    spec = find(manifests, "ScaledObject", f"model-worker-{deployment}")["spec"]
    assert spec["minReplicaCount"] == max(model.replicas.min for model in members(deployment))
    assert spec["maxReplicaCount"] == max(model.replicas.max for model in members(deployment))


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_oldest_request_age_target_is_within_every_request_timeout(manifests: list[Manifest], deployment: str) -> None:
    age = scaled_object_triggers(manifests, deployment)["oldest-request-age"]
    # An age compared per replica would mean nothing: it must be compared as a raw value.
    assert age["metricType"] == "Value"
    assert 0 < float(age["metadata"]["threshold"]) < min(model.request_timeout_seconds for model in members(deployment))


# --- worker groups -------------------------------------------------------------------------------


# The synthetic worker group's models: the local overlay's and the tests'.
SYNTHETIC = ("noop", "sleep", "sleep-long-ack", "sleep-steps", "sleep-calls")


def test_a_worker_group_is_one_deployment_serving_all_its_models() -> None:
    catalog = with_local_overlay()
    groups = {name: [spec.name for spec in specs] for name, specs in catalog.deployments().items()}
    assert groups["synthetic"] == list(SYNTHETIC)
    files = render.render_all(render.RenderSettings(project_id=PROJECT_ID), catalog)
    assert "20-model-worker-synthetic.yaml" in files
    assert not {"20-model-worker-noop.yaml", "20-model-worker-sleep.yaml"} & set(files)
    group = files["20-model-worker-synthetic.yaml"]
    assert sorted(m["kind"] for m in group) == ["Deployment", "PodDisruptionBudget", "PodMonitoring", "ScaledObject"]
    assert worker_env(group, "synthetic")["MAAS_MODELS"]["value"] == ",".join(SYNTHETIC)
    deployment = worker_deployment(group, "synthetic")
    assert deployment["metadata"]["annotations"]["maas/models"] == ",".join(SYNTHETIC)
    models = SYNTHETIC
    expected = {worker_subscription(model, priority) for model in models for priority in INTERACTIVE_PRIORITIES}
    for trigger in scaled_object_triggers(group, "synthetic").values():
        assert queried_subscriptions(trigger["metadata"]["query"]) == expected


def test_a_worker_group_takes_the_most_demanding_settings_of_its_models() -> None:
    a, b = "sd15-img2img", "sd15-txt2img"  # two that fit one L4 together (the memory plan)
    catalog = catalog_with(
        **{
            a: {
                "worker_group": "pair",
                "hardware": "l4",
                "gpu_sharing": False,
                "max_batch_size": 8,
                "batching_gain": 4,
            },
            b: {
                "worker_group": "pair",
                "hardware": "l4",
                "gpu_sharing": False,
                "max_batch_size": 4,
                "batching_gain": 2,
            },
        }
    )
    specs = catalog.deployments()["pair"]
    group = render.render_all(render.RenderSettings(project_id=PROJECT_ID), catalog)["20-model-worker-pair.yaml"]
    grace = pod_spec(worker_deployment(group, "pair"))["terminationGracePeriodSeconds"]
    assert grace == max(spec.drain_seconds for spec in specs) + render.WORKER_EXIT_MARGIN_SECONDS
    scaled = find(group, "ScaledObject", "model-worker-pair")["spec"]
    assert scaled["maxReplicaCount"] == max(spec.replicas.max for spec in specs)
    triggers = scaled_object_triggers(group, "pair")
    assert triggers["backlog-per-worker"]["metadata"]["threshold"] == "1.2"  # b's: 0.6 x its gain of 2
    shortest = min(spec.request_timeout_seconds for spec in specs)
    assert triggers["oldest-request-age"]["metadata"]["threshold"] == str(shortest // 3)


def test_a_worker_group_mixing_hardware_is_refused_with_a_clear_error() -> None:
    a, b = "sd15-txt2img", "sd15-img2img"  # small enough to share a GPU's plan, so the renderer's own check is reached
    catalog = catalog_with(
        **{a: {"worker_group": "mixed", "hardware": "l4"}, b: {"worker_group": "mixed", "hardware": "a100"}}
    )
    with pytest.raises(ValueError, match=r"worker_group 'mixed' mixes hardware"):
        render.render_all(render.RenderSettings(project_id=PROJECT_ID), catalog)


def test_a_worker_group_name_that_is_no_kubernetes_name_is_refused() -> None:
    catalog = catalog_with(**{MODELS[0]: {"worker_group": "Not_A_Name"}})
    with pytest.raises(ValueError, match="DNS label"):
        render.render_all(render.RenderSettings(project_id=PROJECT_ID), catalog)


# --- priority classes and the capacity buffer ----------------------------------------------------


def test_priority_classes_rank_buffer_below_default_below_workers(manifests: list[Manifest]) -> None:
    values = {m["metadata"]["name"]: m["value"] for m in of_kind(manifests, "PriorityClass")}
    assert values["maas-low-priority"] < values["maas-default-priority"] < values["maas-high-priority"]


def test_no_priority_class_claims_the_cluster_wide_default(manifests: list[Manifest]) -> None:
    assert not any(m["globalDefault"] for m in of_kind(manifests, "PriorityClass"))


def test_buffer_never_preempts_and_workers_do(manifests: list[Manifest]) -> None:
    assert find(manifests, "PriorityClass", "maas-low-priority")["preemptionPolicy"] == "Never"
    assert find(manifests, "PriorityClass", "maas-high-priority")["preemptionPolicy"] == "PreemptLowerPriority"


def capacity_buffers(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in of_kind(manifests, "Deployment") if m["metadata"]["name"].startswith("capacity-reservation-")]


def test_there_is_a_capacity_buffer_per_gpu_pool(manifests: list[Manifest]) -> None:
    names = sorted(m["metadata"]["name"] for m in capacity_buffers(manifests))
    assert names == sorted(f"capacity-reservation-{pool}" for pool in render.GPU_POOLS)
    assert set(render.GPU_POOLS) == {"l4", "a100", "a100-80", "h100"}


def test_capacity_buffer_has_the_lowest_priority_of_all_priority_classes(manifests: list[Manifest]) -> None:
    values = {m["metadata"]["name"]: m["value"] for m in of_kind(manifests, "PriorityClass")}
    for buffer in capacity_buffers(manifests):
        buffer_class = pod_spec(buffer)["priorityClassName"]
        assert values[buffer_class] == min(values.values())
        # Pods with no class get 0 (there is no global default), so the buffer must sit below that too.
        assert values[buffer_class] < 0


def test_capacity_buffer_pods_hold_a_whole_gpu_node_and_leave_at_once(manifests: list[Manifest]) -> None:
    for buffer in capacity_buffers(manifests):
        pool = render.GPU_POOLS[buffer["metadata"]["labels"]["maas/gpu-pool"]]
        spec = pod_spec(buffer)
        assert spec["terminationGracePeriodSeconds"] == 0
        assert spec["nodeSelector"]["cloud.google.com/gke-accelerator"] == pool.accelerator
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        (container,) = spec["containers"]
        assert container["image"] == "registry.k8s.io/pause:3.10"
        requests = container["resources"]["requests"]
        assert requests["nvidia.com/gpu"] == 1
        assert millicores(requests["cpu"]) == pool.node_cpu_millis
        assert mebibytes(requests["memory"]) == pool.node_memory_mib


def test_gpu_pool_sizes_fit_their_machine_types() -> None:
    # vCPU and GB of the machine types, which a pod can never fully claim.
    machines = {
        "g2-standard-8": (8, 32),
        "a2-highgpu-1g": (12, 85),
        "a2-ultragpu-1g": (12, 170),
        "a3-highgpu-1g": (26, 234),
    }
    for pool in render.GPU_POOLS.values():
        vcpus, gigabytes = machines[pool.machine_type]
        assert 0.7 * vcpus * 1000 <= pool.node_cpu_millis < vcpus * 1000
        assert 0.7 * gigabytes * 1000**3 <= pool.node_memory_mib * 1024**2 < gigabytes * 1000**3


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_a_worker_fits_where_a_buffer_pod_of_its_pool_was(manifests: list[Manifest], deployment: str) -> None:
    worker = worker_container(manifests, deployment)["resources"]["requests"]
    pool = worker_deployment(manifests, deployment)["metadata"]["labels"]["maas/gpu-pool"]
    assert pool == members(deployment)[0].hardware
    (buffer,) = [m for m in capacity_buffers(manifests) if m["metadata"]["labels"]["maas/gpu-pool"] == pool]
    held = pod_spec(buffer)["containers"][0]["resources"]["requests"]
    assert millicores(worker["cpu"]) <= millicores(held["cpu"])
    assert mebibytes(worker["memory"]) <= mebibytes(held["memory"])


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_a_workers_memory_counts_its_adapter_cache_and_a_load_beside_it(
    manifests: list[Manifest], deployment: str
) -> None:
    """The worker's host cache of adapters is bounded in bytes (the settings' default, set on the Deployment), and
    its pod's memory holds the worker, that budget and one load of the largest file its models accept (a load holds
    about twice its file)."""
    from contract.settings import ADAPTER_HOST_CACHE_BYTES, Settings

    container = worker_container(manifests, deployment)
    value = worker_env(manifests, deployment)["MAAS_ADAPTER_HOST_CACHE_BYTES"]["value"]
    budget = Settings.from_env({"MAAS_ADAPTER_HOST_CACHE_BYTES": value}).adapter_host_cache_bytes
    assert budget == ADAPTER_HOST_CACHE_BYTES
    largest = max((spec.adapters.max_bytes for spec in members(deployment) if spec.adapters), default=0)
    assert largest <= budget, "an adapter file the cache cannot hold would be loaded again for every request"
    adapters = budget + 2 * largest if largest else 0
    memory = mebibytes(container["resources"]["requests"]["memory"]) * 2**20
    assert render.WORKER_PROCESS_MEMORY_MIB * 2**20 + adapters <= memory
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_a_workers_memory_holds_its_weights_at_load_as_the_memory_plan_counts_them(
    manifests: list[Manifest], deployment: str
) -> None:
    """The pipeline loads (and is quantized) in host memory before it moves to the GPU: the pod's memory holds the
    worker and the largest of its models' planned weights."""
    memory = mebibytes(worker_container(manifests, deployment)["resources"]["requests"]["memory"]) * 2**20
    staging = max(unit.weights_bytes for unit in CATALOG.deployment_plans()[deployment].units)
    assert render.WORKER_PROCESS_MEMORY_MIB * 2**20 + staging <= memory


def test_flux_on_an_l4_gets_the_memory_its_fp8_weights_need_and_no_more_than_a_node() -> None:
    (container,) = pod_spec(
        next(
            m
            for m in render.render_all(render.RenderSettings(project_id=PROJECT_ID))[
                "20-model-worker-flux-schnell.yaml"
            ]
            if m["kind"] == "Deployment"
        )
    )["containers"]
    # 6 GiB for the worker and 16.04 GiB of weights (transformer and T5 in float8), in whole GiB.
    assert container["resources"]["requests"]["memory"] == "23Gi"
    assert mebibytes("23Gi") <= render.GPU_POOLS["l4"].node_memory_mib


def test_a_deployment_whose_gpu_plan_does_not_fit_its_share_of_a_time_shared_gpu_is_refused() -> None:
    # SD 1.5 plans 8.11 GiB (with its ControlNets' residuals): a quarter of an L4 (5.37 GiB) is too little.
    with pytest.raises(ValueError, match=r"'sd15-txt2img'.* needs 8\.11 GiB on l4 .* shared by 4 time-sharing pods"):
        render.render_all(render.RenderSettings(project_id=PROJECT_ID, max_shared_clients_per_gpu=4))


def test_the_adapter_cache_budget_is_rendered_and_one_the_pods_cannot_hold_is_refused() -> None:
    five_gib = 5 * 1024**3
    files = render.render_all(render.RenderSettings(project_id=PROJECT_ID, adapter_host_cache_bytes=five_gib))
    rendered = [manifest for group in files.values() for manifest in group]
    assert {worker_env(rendered, d)["MAAS_ADAPTER_HOST_CACHE_BYTES"]["value"] for d in DEPLOYMENTS} == {str(five_gib)}
    # SD 1.5's time-shared L4 pod gets 12 GiB: the worker and 20 GiB of adapters do not fit.
    with pytest.raises(ValueError, match=r"'sd15-txt2img' needs \d+ MiB of host memory .* gets 12288 MiB"):
        render.render_all(render.RenderSettings(project_id=PROJECT_ID, adapter_host_cache_bytes=20 * 1024**3))
    # A cache smaller than SDXL's largest adapter file (1 GiB) could never keep one.
    with pytest.raises(ValueError, match="'sdxl-txt2img': adapter files of up to 1073741824 bytes"):
        render.render_all(render.RenderSettings(project_id=PROJECT_ID, adapter_host_cache_bytes=512 * 1024**2))


def test_buffers_are_warm_only_for_pools_the_catalog_uses(manifests: list[Manifest]) -> None:
    used = {spec.hardware for spec in CATALOG.models.values()}
    for buffer in capacity_buffers(manifests):
        pool = buffer["metadata"]["labels"]["maas/gpu-pool"]
        assert (buffer["spec"]["replicas"] > 0) == (pool in used)


# --- the renderer --------------------------------------------------------------------------------


def test_base_templates_name_no_catalog_model() -> None:
    # Per-model YAML is generated from the catalog, never written by hand.
    for template in (REPO_ROOT / "infra" / "k8s" / "base").glob("*.yaml"):
        text = template.read_text()
        assert not [model for model in MODELS if model in text], template.name


def test_render_cli_writes_one_file_per_deployment_and_removes_stale_ones(tmp_path: Path) -> None:
    (tmp_path / "20-model-worker-retired.yaml").write_text("---\n")
    assert render.main(["--out", str(tmp_path), "--project-id", PROJECT_ID, "--buffer-replicas", "l4=3"]) == 0
    written = sorted(path.name for path in tmp_path.glob("*.yaml"))
    assert written == sorted(
        [
            "00-cluster.yaml",
            "10-capacity-reservation.yaml",
            *(f"20-model-worker-{name}.yaml" for name in DEPLOYMENTS),
            *(f"30-model-batch-{name}.yaml" for name in DEPLOYMENTS),
        ]
    )
    buffers = list(yaml.safe_load_all((tmp_path / "10-capacity-reservation.yaml").read_text()))
    assert find(buffers, "Deployment", "capacity-reservation-l4")["spec"]["replicas"] == 3


def test_render_cli_prints_every_manifest_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    budget = str(3 * 1024**3)
    assert render.main(["--project-id", PROJECT_ID, "--image", "example.com/worker:1",
                        "--adapter-host-cache-bytes", budget, "--batch-max-replicas", "2"]) == 0  # fmt: skip
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(of_kind(printed, "ScaledObject")) == 2 * len(DEPLOYMENTS)  # on-demand and Spot batch
    assert {
        m["spec"]["maxReplicaCount"] for m in of_kind(printed, "ScaledObject") if "batch" in m["metadata"]["name"]
    } == {2}
    assert {worker_container(printed, name)["image"] for name in DEPLOYMENTS} == {"example.com/worker:1"}
    assert {worker_env(printed, name)["MAAS_ADAPTER_HOST_CACHE_BYTES"]["value"] for name in DEPLOYMENTS} == {budget}


def test_rendering_is_deterministic() -> None:
    settings = render.RenderSettings(project_id=PROJECT_ID)
    first = {name: render.dump(group) for name, group in render.render_all(settings).items()}
    second = {name: render.dump(group) for name, group in render.render_all(settings).items()}
    assert first == second


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_maas_variable_given_to_the_worker_is_read_by_the_settings(
    manifests: list[Manifest], deployment: str
) -> None:
    # A misspelt variable would be ignored silently and the worker would fall back to a local default.
    settings_source = (REPO_ROOT / "contract" / "settings.py").read_text()
    env = worker_container(manifests, deployment)["env"]
    names = [entry["name"] for entry in env if entry["name"].startswith("MAAS_")]
    assert [name for name in names if f'"{name}"' not in settings_source] == []


# --- model versions ------------------------------------------------------------------------------


def versioned_catalog(tmp_path: Path) -> ModelCatalog:
    """models.yaml with sd15-txt2img given two versions, the second with its own weights and replica bounds."""
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    entry = raw["models"]["sd15-txt2img"]
    entry.pop("version")
    entry["versions"] = {"1": {}, "2": {"weights_path": "sd15-txt2img/2", "replicas": {"min": 0, "max": 5}}}
    entry["traffic"] = {"1": 90, "2": 10}
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    return ModelCatalog.from_yaml(path)


def test_each_version_gets_its_own_deployment_subscriptions_and_scaling(tmp_path: Path) -> None:
    catalog = versioned_catalog(tmp_path)
    files = render.render_all(render.RenderSettings(project_id=PROJECT_ID), catalog)
    assert {"20-model-worker-sd15-txt2img--1.yaml", "20-model-worker-sd15-txt2img--2.yaml"} <= set(files)
    assert "20-model-worker-sd15-txt2img.yaml" not in files
    for version, max_replicas in (("1", 40), ("2", 5)):
        name = f"sd15-txt2img--{version}"
        group = files[f"20-model-worker-{name}.yaml"]
        assert worker_env(group, name)["MAAS_MODELS"]["value"] == name
        assert worker_deployment(group, name)["metadata"]["labels"]["app.kubernetes.io/version"] == version
        assert find(group, "ScaledObject", f"model-worker-{name}")["spec"]["maxReplicaCount"] == max_replicas
        expected = {worker_subscription(name, priority) for priority in INTERACTIVE_PRIORITIES}
        for trigger in scaled_object_triggers(group, name).values():
            assert queried_subscriptions(trigger["metadata"]["query"]) == expected
        for manifest in group:
            if manifest["kind"] in ("Deployment", "PodDisruptionBudget"):
                kubernetes_validate.validate(manifest, GKE_KUBERNETES_VERSIONS[-1], strict=True)


# --- batch workers on Spot (issue 35) --------------------------------------------------------------


def batch_group(manifests: list[Manifest], deployment: str) -> dict[str, Manifest]:
    name = f"model-batch-{deployment}"
    return {kind: find(manifests, kind, name) for kind in ("Deployment", "PodDisruptionBudget", "ScaledObject")}


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_each_deployment_gets_a_spot_batch_deployment_pulling_only_its_batch_subscriptions(
    manifests: list[Manifest], deployment: str
) -> None:
    batch = batch_group(manifests, deployment)
    spec = pod_spec(batch["Deployment"])
    (container,) = spec["containers"]
    env = {entry["name"]: entry for entry in container["env"]}
    assert env["MAAS_WORKER_PRIORITIES"]["value"] == "batch"
    assert env["MAAS_MODELS"] == worker_env(manifests, deployment)["MAAS_MODELS"]
    assert worker_env(manifests, deployment)["MAAS_WORKER_PRIORITIES"]["value"] == ",".join(PRIORITIES)
    # Full batches on Spot, and on an idle on-demand worker (an interactive request takes it at the next step).
    assert (
        env["MAAS_BATCH_IMAGES"]["value"] == "0"
        and worker_env(manifests, deployment)["MAAS_BATCH_IMAGES"]["value"] == "0"
    )
    # Spot nodes only, which carry a taint no interactive worker tolerates.
    assert spec["nodeSelector"][render.SPOT_LABEL] == "true"
    spot_toleration = {"key": "maas-capacity", "operator": "Equal", "value": "spot", "effect": "NoSchedule"}
    assert spot_toleration in spec["tolerations"]
    assert spot_toleration not in pod_spec(worker_deployment(manifests, deployment))["tolerations"]
    assert render.SPOT_LABEL not in pod_spec(worker_deployment(manifests, deployment))["nodeSelector"]
    # GKE gives a preempted Spot node's pods 15 s: the worker hands its batch lines back within it.
    assert spec["terminationGracePeriodSeconds"] == 15
    assert spec["priorityClassName"] == "maas-default-priority"
    # Neither Deployment's selector (nor its budget's, nor its scrape's) picks the other's pods.
    batch_labels = batch["Deployment"]["spec"]["template"]["metadata"]["labels"]
    interactive_selector = worker_deployment(manifests, deployment)["spec"]["selector"]["matchLabels"]
    assert not interactive_selector.items() <= batch_labels.items()
    assert batch["Deployment"]["spec"]["selector"]["matchLabels"].items() <= batch_labels.items()


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_a_batch_deployment_scales_from_zero_on_its_batch_backlog_only(manifests: list[Manifest], deployment: str):
    scaled = batch_group(manifests, deployment)["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == f"model-batch-{deployment}"
    assert scaled["minReplicaCount"] == 0
    assert scaled["maxReplicaCount"] == max(model.replicas.max for model in members(deployment))
    (trigger,) = scaled["triggers"]  # no age trigger: a batch line waits hours by design
    assert trigger["name"] == "backlog-per-worker" and trigger["metadata"]["activationThreshold"] == "0"
    expected = {worker_subscription(model.name, "batch") for model in members(deployment)}
    assert queried_subscriptions(trigger["metadata"]["query"]) == expected
    batch_size = min(model.max_batch_size for model in members(deployment))
    assert trigger["metadata"]["threshold"] == str(render.BATCH_BACKLOG_CALLS * batch_size)


def test_batch_deployments_follow_the_batch_replica_setting() -> None:
    none = render.render_all(render.RenderSettings(project_id=PROJECT_ID, batch_max_replicas=0))
    assert not [name for name in none if name.startswith("30-")]
    three = render.render_all(render.RenderSettings(project_id=PROJECT_ID, batch_max_replicas=3))
    for deployment in DEPLOYMENTS:
        scaled = find(three[f"30-model-batch-{deployment}.yaml"], "ScaledObject", f"model-batch-{deployment}")
        assert scaled["spec"]["maxReplicaCount"] == 3


# --- flows ---------------------------------------------------------------------------------------

HIRES_FLOW = {
    "stages": [
        {"name": "base", "model": "sd15-txt2img", "fixes": {"num_inference_steps": 8},
         "resize": {"scale": 2, "space": "pixel"}},
        {"name": "hires", "model": "sd15-img2img", "fixes": {"strength": 0.5}},
    ]
}  # fmt: skip


def test_a_flow_adds_no_deployment_and_its_group_runs_it_scaled_on_its_first_stages_backlog(tmp_path) -> None:
    # One worker group serves both stages: the flow runs in its pods; its requests are its first stage's backlog.
    overlay = tmp_path / "flows.yaml"
    group = {"worker_group": "sd15", "hardware": "l4", "gpu_sharing": False}
    overlay.write_text(yaml.safe_dump({"overrides": {"sd15-txt2img": group, "sd15-img2img": group},
                                       "flows": {"sd15-hires": HIRES_FLOW}}))  # fmt: skip
    catalog = ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)
    without = catalog.model_copy(update={"flows": {}})
    settings = render.RenderSettings(project_id=PROJECT_ID)
    files = render.render_all(settings, catalog)
    assert set(files) == set(render.render_all(settings, without))  # no deployment, queue or scaler of its own
    manifests = files["20-model-worker-sd15.yaml"]
    assert worker_deployment(manifests, "sd15")["metadata"]["annotations"]["maas/flows"] == "sd15-hires"
    query = scaled_object_triggers(manifests, "sd15")["backlog-per-worker"]["metadata"]["query"]
    assert worker_subscription("sd15-txt2img", "normal") in query
    others = [m for name, group in files.items() if name != "20-model-worker-sd15.yaml" for m in group]
    assert all("maas/flows" not in (m["metadata"].get("annotations") or {}) for m in others)


def test_a_flow_across_two_deployments_is_named_on_both(tmp_path) -> None:
    # models.yaml serves the two stages from two deployments: the first stage's pods forward to the second's queue.
    overlay = tmp_path / "flows.yaml"
    overlay.write_text(yaml.safe_dump({"flows": {"sd15-hires": HIRES_FLOW}}))
    catalog = ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)
    assert not catalog.flow_runs_in_one_worker(catalog.flow("sd15-hires"))
    files = render.render_all(render.RenderSettings(project_id=PROJECT_ID), catalog)
    for deployment in ("sd15-txt2img", "sd15-img2img"):
        manifest = worker_deployment(files[f"20-model-worker-{deployment}.yaml"], deployment)
        assert manifest["metadata"]["annotations"]["maas/flows"] == "sd15-hires"
