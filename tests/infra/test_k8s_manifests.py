"""The rendered Kubernetes manifests: schema-valid, and faithful to the model catalog and the article's design."""

from __future__ import annotations

import importlib.util
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

from contract.catalog import ModelSpec, load_catalog  # noqa: E402
from contract.naming import worker_subscription  # noqa: E402

# GKE's stable and regular release channels; kubernetes-validate bundles these schemas offline.
GKE_KUBERNETES_VERSIONS = ("1.32", "1.33", "1.34")
KEDA_API_VERSION = "keda.sh/v1alpha1"
PROJECT_ID = "test-project"
CATALOG = load_catalog()
MODELS = CATALOG.names()

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


def worker_deployment(manifests: list[Manifest], model: str) -> Manifest:
    return find(manifests, "Deployment", f"model-worker-{model}")


def worker_container(manifests: list[Manifest], model: str) -> Manifest:
    (container,) = worker_deployment(manifests, model)["spec"]["template"]["spec"]["containers"]
    return container


def pod_spec(deployment: Manifest) -> Manifest:
    return deployment["spec"]["template"]["spec"]


def millicores(quantity: str) -> int:
    return int(quantity.removesuffix("m")) if quantity.endswith("m") else int(float(quantity) * 1000)


def mebibytes(quantity: str) -> int:
    units = {"Mi": 1, "Gi": 1024}
    return int(quantity[:-2]) * units[quantity[-2:]]


def model_spec(model: str) -> ModelSpec:
    return CATALOG.models[model]


# --- schemas -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kubernetes_version", GKE_KUBERNETES_VERSIONS)
def test_every_native_manifest_validates_against_the_kubernetes_schema(
    manifests: list[Manifest], kubernetes_version: str
) -> None:
    native = [m for m in manifests if m["apiVersion"] != KEDA_API_VERSION]
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
            assert trigger["type"] == "gcp-pubsub"
            assert trigger.get("metricType", "AverageValue") in {"AverageValue", "Value", "Utilization"}
            assert trigger["authenticationRef"]["name"] in trigger_auth_names
            # KEDA rejects non-string metadata values.
            assert all(isinstance(value, str) for value in trigger["metadata"].values()), trigger
    for trigger_auth in of_kind(keda, "TriggerAuthentication"):
        assert trigger_auth["spec"] == {"podIdentity": {"provider": "gcp"}}


def test_manifest_names_are_unique(manifests: list[Manifest]) -> None:
    keys = [(m["kind"], m["metadata"].get("namespace"), m["metadata"]["name"]) for m in manifests]
    assert len(keys) == len(set(keys))


def test_every_namespaced_manifest_is_in_the_maas_namespace(manifests: list[Manifest]) -> None:
    cluster_scoped = {"Namespace", "PriorityClass"}
    for manifest in manifests:
        if manifest["kind"] not in cluster_scoped:
            assert manifest["metadata"]["namespace"] == "maas", manifest["metadata"]["name"]


# --- model workers -------------------------------------------------------------------------------


def test_every_catalog_model_gets_exactly_one_worker_deployment(manifests: list[Manifest]) -> None:
    workers = [m for m in of_kind(manifests, "Deployment") if m["metadata"]["name"].startswith("model-worker-")]
    assert sorted(m["metadata"]["name"] for m in workers) == sorted(f"model-worker-{model}" for model in MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_worker_runs_the_catalog_model_with_production_settings(manifests: list[Manifest], model: str) -> None:
    env = {entry["name"]: entry for entry in worker_container(manifests, model)["env"]}
    assert env["MAAS_MODEL"]["value"] == model
    for name in ("MAAS_PROJECT_ID", "MAAS_ENV", "MAAS_REDIS_URL"):
        assert env[name]["valueFrom"]["configMapKeyRef"] == {"name": "maas-config", "key": name}
    config = find(manifests, "ConfigMap", "maas-config")["data"]
    assert config["MAAS_ENV"] == "production"
    assert config["MAAS_PROJECT_ID"] == PROJECT_ID
    assert config["MAAS_REDIS_URL"].startswith("redis://")
    assert env["MAAS_WORKER_HEALTH_PORT"]["value"] == str(render.WORKER_HEALTH_PORT)


@pytest.mark.parametrize("model", MODELS)
def test_worker_writes_weights_and_caches_to_volumes_sized_for_them(manifests: list[Manifest], model: str) -> None:
    container = worker_container(manifests, model)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod_spec(worker_deployment(manifests, model))["volumes"]}
    for variable in ("MAAS_WEIGHTS_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME"):
        (mount_path,) = [path for path in mounts if env[variable].startswith(path + "/")]
        assert volumes[mounts[mount_path]]["name"] == "model-cache", variable
    assert volumes["model-cache"]["emptyDir"]["sizeLimit"] == render.MODEL_CACHE_SIZE


@pytest.mark.parametrize("model", MODELS)
def test_worker_runs_the_image_cloud_build_pushes(manifests: list[Manifest], model: str) -> None:
    image = worker_container(manifests, model)["image"]
    assert image == f"us-central1-docker.pkg.dev/{PROJECT_ID}/maas/worker:abc1234"


@pytest.mark.parametrize("model", MODELS)
def test_worker_has_startup_readiness_and_liveness_probes_on_the_worker_endpoints(
    manifests: list[Manifest], model: str
) -> None:
    container = worker_container(manifests, model)
    (health_port,) = container["ports"]
    assert health_port == {"name": "health", "containerPort": 8081, "protocol": "TCP"}
    paths = {
        "startupProbe": "/startupz",
        "readinessProbe": "/readyz",
        "livenessProbe": "/livez",
    }
    for probe_name, path in paths.items():
        assert container[probe_name]["httpGet"] == {"path": path, "port": "health"}, probe_name


@pytest.mark.parametrize("model", MODELS)
def test_startup_probe_allows_at_least_ten_minutes_for_the_weight_download(
    manifests: list[Manifest], model: str
) -> None:
    probe = worker_container(manifests, model)["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 10 * 60


@pytest.mark.parametrize("model", MODELS)
def test_worker_requests_one_gpu_and_guaranteed_resources(manifests: list[Manifest], model: str) -> None:
    resources = worker_container(manifests, model)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"] == resources["limits"]
    assert {"cpu", "memory", "ephemeral-storage"} <= set(resources["requests"])


@pytest.mark.parametrize("model", MODELS)
def test_worker_runs_at_high_priority(manifests: list[Manifest], model: str) -> None:
    assert pod_spec(worker_deployment(manifests, model))["priorityClassName"] == "maas-high-priority"


@pytest.mark.parametrize("model", MODELS)
def test_worker_is_placed_on_its_catalog_gpu_pool(manifests: list[Manifest], model: str) -> None:
    spec = pod_spec(worker_deployment(manifests, model))
    accelerator = {"l4": "nvidia-l4", "a100": "nvidia-tesla-a100"}[model_spec(model).hardware]
    assert spec["nodeSelector"]["cloud.google.com/gke-accelerator"] == accelerator
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


@pytest.mark.parametrize("model", MODELS)
def test_gpu_sharing_decides_between_time_shared_and_dedicated_gpus(manifests: list[Manifest], model: str) -> None:
    spec = pod_spec(worker_deployment(manifests, model))
    selector = spec["nodeSelector"]
    if model_spec(model).gpu_sharing:
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


@pytest.mark.parametrize("model", MODELS)
def test_termination_grace_period_exceeds_the_models_drain_time(manifests: list[Manifest], model: str) -> None:
    grace = pod_spec(worker_deployment(manifests, model))["terminationGracePeriodSeconds"]
    assert grace > model_spec(model).drain_seconds


@pytest.mark.parametrize("model", MODELS)
def test_worker_uses_workload_identity(manifests: list[Manifest], model: str) -> None:
    assert pod_spec(worker_deployment(manifests, model))["serviceAccountName"] == "model-worker"
    account = find(manifests, "ServiceAccount", "model-worker")
    assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == (
        f"maas-worker@{PROJECT_ID}.iam.gserviceaccount.com"
    )


@pytest.mark.parametrize("model", MODELS)
def test_worker_replica_count_is_left_to_the_autoscaler(manifests: list[Manifest], model: str) -> None:
    assert "replicas" not in worker_deployment(manifests, model)["spec"]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_has_a_disruption_budget_selecting_its_workers(manifests: list[Manifest], model: str) -> None:
    budget = find(manifests, "PodDisruptionBudget", f"model-worker-{model}")
    pod_labels = worker_deployment(manifests, model)["spec"]["template"]["metadata"]["labels"]
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["maas/model"] == model


@pytest.mark.parametrize("model", MODELS)
def test_scaled_object_watches_the_models_worker_subscription(manifests: list[Manifest], model: str) -> None:
    scaled = find(manifests, "ScaledObject", f"model-worker-{model}")
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"model-worker-{model}"
    expected = f"projects/{PROJECT_ID}/subscriptions/{worker_subscription(model)}"
    triggers = scaled["spec"]["triggers"]
    assert {trigger["metadata"]["subscriptionName"] for trigger in triggers} == {expected}
    assert {trigger["metadata"]["mode"] for trigger in triggers} == {"SubscriptionSize", "OldestUnackedMessageAge"}


@pytest.mark.parametrize("model", MODELS)
def test_scaled_object_replica_bounds_come_from_the_catalog(manifests: list[Manifest], model: str) -> None:
    spec = find(manifests, "ScaledObject", f"model-worker-{model}")["spec"]
    replicas = model_spec(model).replicas
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (replicas.min, replicas.max)


@pytest.mark.parametrize("model", MODELS)
def test_oldest_request_age_target_is_within_the_request_timeout(manifests: list[Manifest], model: str) -> None:
    triggers = find(manifests, "ScaledObject", f"model-worker-{model}")["spec"]["triggers"]
    (age,) = [t for t in triggers if t["metadata"]["mode"] == "OldestUnackedMessageAge"]
    # An age compared per replica would mean nothing: it must be compared as a raw value.
    assert age["metricType"] == "Value"
    assert 0 < float(age["metadata"]["value"]) < model_spec(model).request_timeout_seconds


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
    assert names == ["capacity-reservation-a100", "capacity-reservation-l4"]


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
    machines = {"g2-standard-8": (8, 32), "a2-highgpu-1g": (12, 85)}
    for pool in render.GPU_POOLS.values():
        vcpus, gigabytes = machines[pool.machine_type]
        assert 0.7 * vcpus * 1000 <= pool.node_cpu_millis < vcpus * 1000
        assert 0.7 * gigabytes * 1000**3 <= pool.node_memory_mib * 1024**2 < gigabytes * 1000**3


@pytest.mark.parametrize("model", MODELS)
def test_a_worker_fits_where_a_buffer_pod_of_its_pool_was(manifests: list[Manifest], model: str) -> None:
    worker = worker_container(manifests, model)["resources"]["requests"]
    (buffer,) = [
        m for m in capacity_buffers(manifests) if m["metadata"]["labels"]["maas/gpu-pool"] == model_spec(model).hardware
    ]
    held = pod_spec(buffer)["containers"][0]["resources"]["requests"]
    assert millicores(worker["cpu"]) <= millicores(held["cpu"])
    assert mebibytes(worker["memory"]) <= mebibytes(held["memory"])


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


def test_render_cli_writes_one_file_per_model_and_removes_stale_ones(tmp_path: Path) -> None:
    (tmp_path / "20-model-worker-retired.yaml").write_text("---\n")
    assert render.main(["--out", str(tmp_path), "--project-id", PROJECT_ID, "--buffer-replicas", "l4=3"]) == 0
    written = sorted(path.name for path in tmp_path.glob("*.yaml"))
    assert written == sorted(
        ["00-cluster.yaml", "10-capacity-reservation.yaml", *(f"20-model-worker-{model}.yaml" for model in MODELS)]
    )
    buffers = list(yaml.safe_load_all((tmp_path / "10-capacity-reservation.yaml").read_text()))
    assert find(buffers, "Deployment", "capacity-reservation-l4")["spec"]["replicas"] == 3


def test_render_cli_prints_every_manifest_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert render.main(["--project-id", PROJECT_ID, "--image", "example.com/worker:1"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(of_kind(printed, "ScaledObject")) == len(MODELS)
    assert {worker_container(printed, model)["image"] for model in MODELS} == {"example.com/worker:1"}


def test_rendering_is_deterministic() -> None:
    settings = render.RenderSettings(project_id=PROJECT_ID)
    first = {name: render.dump(group) for name, group in render.render_all(settings).items()}
    second = {name: render.dump(group) for name, group in render.render_all(settings).items()}
    assert first == second


@pytest.mark.parametrize("model", MODELS)
def test_every_maas_variable_given_to_the_worker_is_read_by_the_settings(manifests: list[Manifest], model: str) -> None:
    # A misspelt variable would be ignored silently and the worker would fall back to a local default.
    settings_source = (REPO_ROOT / "contract" / "settings.py").read_text()
    names = [entry["name"] for entry in worker_container(manifests, model)["env"] if entry["name"].startswith("MAAS_")]
    assert [name for name in names if f'"{name}"' not in settings_source] == []
