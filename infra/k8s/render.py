"""Renders the Kubernetes manifests for the model workers from the model catalog and the base templates.

One worker Deployment (with its disruption budget, autoscaler and metrics scrape) per catalog
deployment: a `worker_group` shared by several models, or a model of its own. Beside it, a batch Deployment
(`model-batch-*`, issue 35) on the Spot node pool, pulling only its models' batch subscriptions, scaled from
zero by KEDA on their backlog. Only contract/models.yaml is read; the local overlay's synthetic models never
reach a cluster.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from contract.batch_capacity import BATCH_BACKLOG_CALLS  # noqa: E402
from contract.catalog import ModelCatalog, load_catalog  # noqa: E402
from contract.hardware import MAX_SHARED_CLIENTS_PER_GPU  # noqa: E402
from contract.memory_plan import deployment_plan  # noqa: E402
from contract.model_spec import ModelSpec  # noqa: E402
from contract.naming import INTERACTIVE_PRIORITIES, PRIORITIES, worker_subscription  # noqa: E402
from contract.settings import ADAPTER_HOST_CACHE_BYTES  # noqa: E402

BASE_DIR = Path(__file__).resolve().with_name("base")

Manifest = dict[str, Any]

WORKER_HEALTH_PORT = 8081
TRIGGER_AUTHENTICATION = "maas-gcp-workload-identity"
# Cloud Monitoring's PromQL API (Managed Service for Prometheus); Pub/Sub's metrics are queryable there.
PROMETHEUS_SERVER_ADDRESS = "https://monitoring.googleapis.com/v1/projects/{project_id}/location/global/prometheus"
BACKLOG_METRIC = "pubsub_googleapis_com:subscription_num_undelivered_messages"
OLDEST_UNACKED_AGE_METRIC = "pubsub_googleapis_com:subscription_oldest_unacked_message_age"
# The workers' own gauge (model_worker/serving/metrics.py), scraped by Managed Prometheus.
FLOWS_AHEAD_METRIC = "maas_worker_flows_ahead"
METRICS_SCRAPE_INTERVAL = "30s"
# A Deployment name, and so a worker group name, must be a DNS label.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
SUBSCRIPTION_NAME = re.compile(r"[a-z0-9-]+")
# Seconds a worker may take to download its weights, load and warm the pipeline before it is restarted.
WORKER_STARTUP_BUDGET_SECONDS = 15 * 60
WORKER_STARTUP_PERIOD_SECONDS = 10
# Time to publish the last replies and exit after the drain ends, before the kubelet sends SIGKILL.
WORKER_EXIT_MARGIN_SECONDS = 30
# The node-local weights cache holds twice a deployment's weights files (the memory plan's `file_bytes`: a new upload
# downloads beside the old), and at least this much; ephemeral storage adds room for logs and temporary files.
MIN_MODEL_CACHE_GIB = 20
EPHEMERAL_STORAGE_BESIDE_CACHE_GIB = 4
DEFAULT_MAX_SHARED_CLIENTS_PER_GPU = MAX_SHARED_CLIENTS_PER_GPU  # the memory plan's share of a time-shared GPU
# Host memory a serving worker holds besides its LoRA adapters and its weights at load: Python, torch and CUDA's host side, the pipeline's
# bookkeeping once its weights are on the GPU, a batch's payloads and images. An estimate with room to spare (a
# tiny-model worker is about 1 GiB); the adapters' share is counted from the catalog and the cache budget.
WORKER_PROCESS_MEMORY_MIB = 6 * 1024
MIB = 1024 * 1024
# The share of a worker's batched capacity its backlog target stands for: at the target a worker holds this
# share of the requests it would need in flight to serve at its full-batch rate (`batching_gain`, one request's
# rate being one). The rest is headroom for a rise the autoscaler sees two minutes late and answers with pods
# minutes later. Chosen by simulation (bench/capacity, docs/results/capacity.md): on the seed's day on the L4 profile
# 0.6 answered every request within the SLO and 0.7 only 97%; on the H100 profile 0.6 keeps the GPU-hours of the
# old one-batch target and answers 99.98% in time where that one answered 95%.
BACKLOG_TARGET_UTILIZATION = 0.6
GPU_SHARING_STRATEGY_LABEL = "cloud.google.com/gke-gpu-sharing-strategy"
MAX_SHARED_CLIENTS_LABEL = "cloud.google.com/gke-max-shared-clients-per-gpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
# Batch workers (issue 35): GKE labels Spot nodes with this; Terraform's Spot pools carry the taint below, so only
# batch workers land there and no interactive worker runs on capacity that can vanish with 30 s notice.
SPOT_LABEL = "cloud.google.com/gke-spot"
SPOT_TAINT_KEY = "maas-capacity"
SPOT_TAINT_VALUE = "spot"
# GKE gives a preempted Spot node's (non-system) pods 15 s; a larger grace period has no effect there.
SPOT_TERMINATION_GRACE_SECONDS = 15
# A batch worker's KEDA target: unacked batch lines per worker, `BATCH_BACKLOG_CALLS` full calls of its models
# (contract/batch_capacity.py). The feeder bounds a batch's lines in flight per model at the batch Deployment's
# max replicas times that target, so a batch can bring up every Spot worker; a line's window is hours, so there is
# no age trigger.
BATCH_COOLDOWN_SECONDS = 300


@dataclass(frozen=True)
class GpuPool:
    """A GKE GPU node pool shape; cpu and memory are what one node leaves for pods after system daemons."""

    name: str
    accelerator: str
    machine_type: str
    node_cpu_millis: int
    node_memory_mib: int


# Allocatable of one node (GKE reservations) less roughly 0.5 vCPU and 1-2 GiB for the GPU node's
# DaemonSets (device plugin, metadata server, logging, metrics), so one pod of this size fits exactly.
GPU_POOLS: dict[str, GpuPool] = {
    # g2-standard-8: 8 vCPU, 32 GB, one L4 (24 GB).
    "l4": GpuPool("l4", "nvidia-l4", "g2-standard-8", node_cpu_millis=6500, node_memory_mib=24 * 1024),
    # a2-highgpu-1g: 12 vCPU, 85 GB, one A100 (40 GB).
    "a100": GpuPool("a100", "nvidia-tesla-a100", "a2-highgpu-1g", node_cpu_millis=10000, node_memory_mib=64 * 1024),
    # a2-ultragpu-1g: 12 vCPU, 170 GB, one A100 (80 GB).
    "a100-80": GpuPool(
        "a100-80", "nvidia-a100-80gb", "a2-ultragpu-1g", node_cpu_millis=10000, node_memory_mib=128 * 1024
    ),
    # a3-highgpu-1g: 26 vCPU, 234 GB, one H100 (80 GB).
    "h100": GpuPool("h100", "nvidia-h100-80gb", "a3-highgpu-1g", node_cpu_millis=22000, node_memory_mib=180 * 1024),
}


@dataclass(frozen=True)
class RenderSettings:
    """Deployment-specific values the catalog does not know: project, images, namespace, Redis, buffer size."""

    project_id: str = "maas-project"
    region: str = "us-central1"
    namespace: str = "maas"
    image_tag: str = "latest"
    worker_image: str | None = None
    redis_url: str = "redis://redis.invalid:6379/0"
    max_shared_clients_per_gpu: int = DEFAULT_MAX_SHARED_CLIENTS_PER_GPU
    # Buffer replicas per pool; a pool left out gets one if the catalog uses it, none otherwise.
    buffer_replicas: dict[str, int] = field(default_factory=dict)
    # Every worker's host cache of LoRA adapters, in bytes (its MAAS_ADAPTER_HOST_CACHE_BYTES), counted in its memory.
    adapter_host_cache_bytes: int = ADAPTER_HOST_CACHE_BYTES
    # Spot batch workers per deployment at most (None: the catalog's max_replicas; 0: no batch Deployments).
    batch_max_replicas: int | None = None

    @property
    def image(self) -> str:
        """The worker image Cloud Build pushes, unless one is given explicitly."""
        if self.worker_image:
            return self.worker_image
        return f"{self.region}-docker.pkg.dev/{self.project_id}/maas/worker:{self.image_tag}"

    @property
    def worker_google_service_account(self) -> str:
        return f"maas-worker@{self.project_id}.iam.gserviceaccount.com"


def render_template(template_name: str, values: dict[str, Any]) -> list[Manifest]:
    """Fills a base template and parses its documents.

    Every placeholder stands for a whole YAML value and is filled with JSON (a subset of YAML), so
    strings are quoted safely and mappings or lists drop in as flow collections.
    """
    text = (BASE_DIR / template_name).read_text()
    filled = Template(text).substitute({key: json.dumps(value) for key, value in values.items()})
    return [doc for doc in yaml.safe_load_all(filled) if doc is not None]


def gpu_toleration() -> list[dict[str, str]]:
    # GKE taints GPU nodes so that only pods asking for a GPU land there.
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def dedicated_gpu_affinity() -> dict[str, Any]:
    """Keeps a pod off time-shared nodes, where its GPU would be shared with other models."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": GPU_SHARING_STRATEGY_LABEL, "operator": "DoesNotExist"}]}
                ]
            }
        }
    }


def resources(cpu_millis: int, memory_mib: int, *, ephemeral_storage: str | None = None) -> dict[str, Any]:
    """Requests equal to limits: Guaranteed QoS, the last class the kubelet evicts under node pressure."""
    memory = f"{memory_mib // 1024}Gi" if memory_mib % 1024 == 0 else f"{memory_mib}Mi"
    amounts: dict[str, str | int] = {"cpu": f"{cpu_millis}m", "memory": memory}
    if ephemeral_storage:
        amounts["ephemeral-storage"] = ephemeral_storage
    amounts["nvidia.com/gpu"] = 1
    return {"requests": dict(amounts), "limits": dict(amounts)}


def cluster_manifests(settings: RenderSettings) -> list[Manifest]:
    """The namespace, priority classes, shared configuration and identities."""
    manifests = render_template("namespace.yaml", {"namespace": settings.namespace})
    manifests += render_template("priority-classes.yaml", {})
    manifests += render_template(
        "shared-config.yaml",
        {
            "namespace": settings.namespace,
            "project_id": settings.project_id,
            "redis_url": settings.redis_url,
            "worker_google_service_account": settings.worker_google_service_account,
            "trigger_authentication": TRIGGER_AUTHENTICATION,
        },
    )
    return manifests


def capacity_reservation_manifests(settings: RenderSettings, catalog: ModelCatalog) -> list[Manifest]:
    """One buffer Deployment per GPU pool, each pod sized to a whole node of that pool."""
    used_pools = {spec.hardware for spec in catalog.units()}
    manifests: list[Manifest] = []
    for pool in GPU_POOLS.values():
        replicas = settings.buffer_replicas.get(pool.name, 1 if pool.name in used_pools else 0)
        manifests += render_template(
            "capacity-reservation.yaml",
            {
                "name": f"capacity-reservation-{pool.name}",
                "namespace": settings.namespace,
                "pool": pool.name,
                "replicas": replicas,
                "node_selector": {ACCELERATOR_LABEL: pool.accelerator},
                # The big-volume models run on dedicated GPUs, so that is where warm nodes pay off.
                "affinity": dedicated_gpu_affinity(),
                "tolerations": gpu_toleration(),
                "resources": resources(pool.node_cpu_millis, pool.node_memory_mib),
            },
        )
    return manifests


@dataclass(frozen=True)
class WorkerDeployment:
    """The models one worker Deployment serves, and the settings it takes from them.

    Every value that sizes or times the Deployment comes from its most demanding member: the
    largest replica bounds and drain, and the smallest backlog target and request timeout as autoscaling
    targets (so a group scales up no later than any of its models would alone).
    """

    name: str
    models: tuple[ModelSpec, ...]
    batch: bool = False  # the Spot batch Deployment of these models (pulls and scales on `-batch` only)
    # The catalog's flows with a stage served here (contract/flows.py): a flow whose stages all are runs in one
    # of these pods, stage after stage; one that starts here arrives on its first stage's queue, this
    # Deployment's backlog (no queue of its own), and a later stage elsewhere is published to by these pods.
    flows: tuple[str, ...] = ()
    # Its queues that run a flow's later stage (index 1 on): a flow reaches such a queue only when the stage
    # before it finishes, so the workers holding it before then count it (`maas_worker_flows_ahead`) and this
    # Deployment's backlog adds that count.
    later_stage_queues: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError(f"worker deployment {self.name!r} serves no model")
        if not DNS_LABEL.fullmatch(self.name) or len(worker_name(self.name)) > 63:
            raise ValueError(
                f"worker deployment {self.name!r} (a worker_group or model name) must be a DNS label of at most "
                f"{63 - len(worker_name(''))} characters: lower-case letters, digits and '-'"
            )
        placements = {(spec.hardware, spec.gpu_sharing) for spec in self.models}
        if len(placements) > 1:
            found = ", ".join(f"{spec.name}: {spec.hardware}, gpu_sharing={spec.gpu_sharing}" for spec in self.models)
            raise ValueError(
                f"worker_group {self.name!r} mixes hardware: its models run in one pod, so they must share "
                f"`hardware` and `gpu_sharing` ({found})"
            )

    @property
    def model_names(self) -> list[str]:
        """What the worker's MAAS_MODELS names: each model, or each version's queue (`model--version`)."""
        return [spec.queue for spec in self.models]

    @property
    def hardware(self) -> str:
        return self.models[0].hardware

    @property
    def gpu_sharing(self) -> bool:
        return self.models[0].gpu_sharing

    @property
    def min_replicas(self) -> int:
        return max(spec.replicas.min for spec in self.models)

    @property
    def max_replicas(self) -> int:
        return max(spec.replicas.max for spec in self.models)

    @property
    def drain_seconds(self) -> int:
        return max(spec.drain_seconds for spec in self.models)

    @property
    def backlog_per_worker(self) -> float:
        """Unacked requests per worker that call for another one: the smallest of its models' targets."""
        return min(backlog_target(spec) for spec in self.models)

    @property
    def oldest_request_age_seconds(self) -> int:
        """A request that has waited a third of the shortest timeout means the workers are falling behind."""
        return max(1, min(spec.request_timeout_seconds for spec in self.models) // 3)

    @property
    def largest_adapter_bytes(self) -> int:
        """The largest adapter file any of its models accepts (0: none takes adapters)."""
        return max((spec.adapters.max_bytes for spec in self.models if spec.adapters), default=0)

    @property
    def resource_name(self) -> str:
        """Its Deployment's (and budget's, autoscaler's, scrape's) name."""
        return batch_worker_name(self.name) if self.batch else worker_name(self.name)

    @property
    def priorities(self) -> tuple[str, ...]:
        """What its workers pull (MAAS_WORKER_PRIORITIES): every priority on-demand, batch lines only on Spot."""
        return ("batch",) if self.batch else PRIORITIES

    @property
    def subscriptions(self) -> list[str]:
        """Every worker subscription the Deployment pulls: each model's, at each of its priorities."""
        return [worker_subscription(model, priority) for model in self.model_names for priority in self.priorities]

    @property
    def scaled_subscriptions(self) -> list[str]:
        """The subscriptions whose backlog scales it. On-demand: the interactive ones only, so a batch backlog
        (which on-demand workers take only when idle) never adds on-demand GPU-hours; Spot: the batch ones."""
        priorities = ("batch",) if self.batch else INTERACTIVE_PRIORITIES
        return [worker_subscription(model, priority) for model in self.model_names for priority in priorities]

    @property
    def batch_backlog_per_worker(self) -> int:
        """Unacked batch lines per Spot worker that call for another: `BATCH_BACKLOG_CALLS` full calls."""
        return BATCH_BACKLOG_CALLS * min(spec.max_batch_size for spec in self.models)

    @property
    def version(self) -> str | None:
        versions = {spec.version for spec in self.models}
        return versions.pop() if len(versions) == 1 else None


def backlog_target(spec: ModelSpec) -> float:
    """A model's KEDA backlog target, unacked requests per worker (queued, held or running: a worker acks after
    its reply): `BACKLOG_TARGET_UTILIZATION` of its `batching_gain`. Where batching buys nothing (gain 1) a
    worker is full with one request running, so the target is under one; where a full batch costs little more
    than one image, the worker can take about `batching_gain` requests in the time of one."""
    return round(BACKLOG_TARGET_UTILIZATION * spec.batching_gain, 2)


def worker_deployments(catalog: ModelCatalog) -> list[WorkerDeployment]:
    later = {stage.model for flow in catalog.flows.values() for stage in flow.stages[1:]}
    return [
        WorkerDeployment(
            name,
            tuple(specs),
            flows=flows_served_by(catalog, name),
            later_stage_queues=tuple(spec.queue for spec in specs if spec.name in later),
        )  # fmt: skip
        for name, specs in catalog.deployments().items()
    ]


def flows_served_by(catalog: ModelCatalog, deployment: str) -> tuple[str, ...]:
    """The flows one of whose stages' models (any version) the deployment serves."""
    served = {spec.name for spec in catalog.deployments()[deployment]}
    return tuple(name for name, flow in sorted(catalog.flows.items()) if served & set(flow.models))


def worker_labels(deployment: WorkerDeployment) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": app_name(deployment),
        "app.kubernetes.io/instance": deployment.resource_name,
        "app.kubernetes.io/part-of": "maas",
        "maas/deployment": deployment.name,
        "maas/gpu-pool": deployment.hardware,
    }
    if deployment.version:
        labels["app.kubernetes.io/version"] = deployment.version
    if deployment.batch:
        labels["maas/capacity"] = SPOT_TAINT_VALUE
    return labels


def app_name(deployment: WorkerDeployment) -> str:
    """The pods' app label: distinct for batch workers, so neither Deployment's selector picks the other's pods."""
    return "model-batch" if deployment.batch else "model-worker"


def worker_selector(deployment: WorkerDeployment) -> dict[str, str]:
    return {"app.kubernetes.io/name": app_name(deployment), "maas/deployment": deployment.name}


def worker_name(deployment: str) -> str:
    return f"model-worker-{deployment}"


def batch_worker_name(deployment: str) -> str:
    """Shorter than `worker_name`, so every name that fits a DNS label there fits here too."""
    return f"model-batch-{deployment}"


def subscription_matcher(deployment: WorkerDeployment, project_id: str) -> str:
    """PromQL label matchers selecting the subscriptions that scale the Deployment (an anchored regex of names)."""
    # Names are joined into a regex inside a PromQL string literal: only characters that mean nothing to
    # either are allowed, so nothing needs escaping (PromQL strings reject Python's `\-`).
    unsafe = [name for name in deployment.scaled_subscriptions if not SUBSCRIPTION_NAME.fullmatch(name)]
    if unsafe:
        raise ValueError(f"subscription names must be lower-case letters, digits and '-' for PromQL: {unsafe}")
    names = "|".join(deployment.scaled_subscriptions)
    return f'{{monitored_resource="pubsub_subscription",project_id="{project_id}",subscription_id=~"{names}"}}'


def backlog_query(deployment: WorkerDeployment, project_id: str) -> str:
    # `or vector(0)`: a subscription Cloud Monitoring has no sample for yet counts as empty, not as an error.
    backlog = f"sum({BACKLOG_METRIC}{subscription_matcher(deployment, project_id)}) or vector(0)"
    if deployment.batch or not deployment.later_stage_queues:
        return backlog
    # The interactive flows held in an earlier stage by another group's workers, on their way to these queues.
    queues = "|".join(deployment.later_stage_queues)
    ahead = f'sum({FLOWS_AHEAD_METRIC}{{project_id="{project_id}",queue=~"{queues}",priority!="batch"}}) or vector(0)'
    return f"({backlog}) + ({ahead})"


def oldest_request_age_query(deployment: WorkerDeployment, project_id: str) -> str:
    return f"max({OLDEST_UNACKED_AGE_METRIC}{subscription_matcher(deployment, project_id)}) or vector(0)"


def adapter_memory_mib(deployment: WorkerDeployment, settings: RenderSettings) -> int:
    """Host memory a worker's LoRA adapters may take: the cache's budget, and beside it one load holding about twice
    its file (the download, then the file and its parsed tensors: model_worker/adapters/loader.py)."""
    if not deployment.largest_adapter_bytes:
        return 0
    return math.ceil((settings.adapter_host_cache_bytes + 2 * deployment.largest_adapter_bytes) / MIB)


def weights_staging_mib(deployment: WorkerDeployment) -> int:
    """Host memory its weights pass through at load, from the memory plan: a pipeline loads (and is quantized) on
    the CPU before it moves to the GPU, one model after another (contract/memory_plan.py, `host_staging_bytes`)."""
    return math.ceil(deployment_plan(deployment.name, list(deployment.models)).host_staging_bytes / MIB)


def model_cache_gib(deployment: WorkerDeployment) -> int:
    """The weights cache volume's size: twice its models' files (a new upload beside the old), at least 20 GiB."""
    files = sum(unit.file_bytes for unit in deployment_plan(deployment.name, list(deployment.models)).units)
    return max(MIN_MODEL_CACHE_GIB, math.ceil(2 * files / 1024**3))


def worker_memory_mib(deployment: WorkerDeployment, settings: RenderSettings) -> int:
    """Host memory one worker of the deployment needs: the process, and the larger of its weights at load (the
    memory plan's) and its adapters while it serves (the adapter cache fills after the load), in whole GiB."""
    needed = WORKER_PROCESS_MEMORY_MIB + max(weights_staging_mib(deployment), adapter_memory_mib(deployment, settings))
    return math.ceil(needed / 1024) * 1024


def flow_annotations(deployment: WorkerDeployment) -> dict[str, str]:
    """`maas/flows`: the flows with a stage in this Deployment (none: no annotation)."""
    return {"maas/flows": ",".join(deployment.flows)} if deployment.flows else {}


def model_worker_manifests(deployment: WorkerDeployment, settings: RenderSettings) -> list[Manifest]:
    """The Deployment, PodDisruptionBudget, ScaledObject and PodMonitoring of one worker deployment."""
    pool = GPU_POOLS[deployment.hardware]
    node_selector = {ACCELERATOR_LABEL: pool.accelerator}
    clients_per_node = 1
    affinity: dict[str, Any] = dedicated_gpu_affinity()
    tolerations = gpu_toleration()
    if deployment.batch:
        # Whole Spot GPUs (the Spot pool is not time-shared), whatever the on-demand placement.
        node_selector[SPOT_LABEL] = "true"
        tolerations.append(
            {"key": SPOT_TAINT_KEY, "operator": "Equal", "value": SPOT_TAINT_VALUE, "effect": "NoSchedule"}
        )
    elif deployment.gpu_sharing:
        clients_per_node = settings.max_shared_clients_per_gpu
        node_selector[GPU_SHARING_STRATEGY_LABEL] = "time-sharing"
        node_selector[MAX_SHARED_CLIENTS_LABEL] = str(clients_per_node)
        affinity = {}
    share_mib = pool.node_memory_mib // clients_per_node
    plan = deployment_plan(deployment.name, list(deployment.models), clients_per_node)
    if (problem := plan.problem()) is not None:
        raise ValueError(f"worker deployment {deployment.name!r}: {problem}")
    largest = deployment.largest_adapter_bytes
    if largest > settings.adapter_host_cache_bytes:
        raise ValueError(
            f"worker deployment {deployment.name!r}: adapter files of up to {largest} bytes (the catalog's "
            f"max_bytes) do not fit a host cache of {settings.adapter_host_cache_bytes} bytes"
        )
    memory_mib = worker_memory_mib(deployment, settings)
    if memory_mib > share_mib:
        raise ValueError(
            f"worker deployment {deployment.name!r} needs {memory_mib} MiB of host memory ({WORKER_PROCESS_MEMORY_MIB} "
            f"MiB for the worker, and the larger of {weights_staging_mib(deployment)} MiB for its weights at load and "
            f"{adapter_memory_mib(deployment, settings)} MiB for a {settings.adapter_host_cache_bytes}-byte adapter "
            f"cache and a load of its largest file) but its pod on {pool.name} gets {share_mib} MiB: lower the adapter "
            "cache or the catalog's max_bytes, or quantize its weights"
        )
    # The startup probe keeps counting from the container's start, so a rounded-up threshold still
    # covers the whole budget.
    startup_failure_threshold = math.ceil(WORKER_STARTUP_BUDGET_SECONDS / WORKER_STARTUP_PERIOD_SECONDS)
    if deployment.batch:
        grace, priority_class, cooldown = (
            SPOT_TERMINATION_GRACE_SECONDS,
            "maas-default-priority",
            BATCH_COOLDOWN_SECONDS,
        )
        min_replicas = 0
        max_replicas = deployment.max_replicas if settings.batch_max_replicas is None else settings.batch_max_replicas
        backlog_per_worker: float = deployment.batch_backlog_per_worker
    else:
        grace, priority_class, cooldown = (
            deployment.drain_seconds + WORKER_EXIT_MARGIN_SECONDS,
            "maas-high-priority",
            600,
        )
        min_replicas, max_replicas = deployment.min_replicas, deployment.max_replicas
        backlog_per_worker = deployment.backlog_per_worker
    manifests = render_template(
        "model-worker.yaml",
        {
            "name": deployment.resource_name,
            "namespace": settings.namespace,
            "models": ",".join(deployment.model_names),
            "labels": worker_labels(deployment),
            "annotations": {"maas/models": ",".join(deployment.model_names), **flow_annotations(deployment)},
            "selector": worker_selector(deployment),
            "image": settings.image,
            "termination_grace_period_seconds": grace,
            "priority_class_name": priority_class,
            "worker_priorities": ",".join(deployment.priorities),
            "batch_images": "0",  # full batches on Spot and on an idle on-demand worker alike
            "cooldown_seconds": cooldown,
            "node_selector": node_selector,
            "affinity": affinity,
            "tolerations": tolerations,
            "health_port": WORKER_HEALTH_PORT,
            "health_port_text": str(WORKER_HEALTH_PORT),
            "resources": resources(
                pool.node_cpu_millis // clients_per_node,
                memory_mib,
                ephemeral_storage=f"{model_cache_gib(deployment) + EPHEMERAL_STORAGE_BESIDE_CACHE_GIB}Gi",
            ),
            "adapter_host_cache_bytes": str(settings.adapter_host_cache_bytes),
            "startup_period_seconds": WORKER_STARTUP_PERIOD_SECONDS,
            "startup_failure_threshold": startup_failure_threshold,
            "model_cache_size": f"{model_cache_gib(deployment)}Gi",
            "min_replicas": min_replicas,
            "max_replicas": max_replicas,
            "trigger_authentication": TRIGGER_AUTHENTICATION,
            "prometheus_server_address": PROMETHEUS_SERVER_ADDRESS.format(project_id=settings.project_id),
            "backlog_query": backlog_query(deployment, settings.project_id),
            "oldest_request_age_query": oldest_request_age_query(deployment, settings.project_id),
            # KEDA requires trigger metadata values to be strings.
            "backlog_per_worker": format(backlog_per_worker, "g"),
            "oldest_request_age_seconds": str(deployment.oldest_request_age_seconds),
            "metrics_scrape_interval": METRICS_SCRAPE_INTERVAL,
        },
    )
    if deployment.batch:
        # A batch line waits hours by design: only the backlog scales Spot workers, not the oldest line's age.
        for manifest in manifests:
            if manifest["kind"] == "ScaledObject":
                triggers = manifest["spec"]["triggers"]
                manifest["spec"]["triggers"] = [t for t in triggers if t["name"] == "backlog-per-worker"]
    return manifests


def batch_worker_manifests(deployment: WorkerDeployment, settings: RenderSettings) -> list[Manifest]:
    """The Spot batch Deployment of a worker deployment's models (none when `batch_max_replicas` is 0)."""
    if settings.batch_max_replicas == 0:
        return []
    return model_worker_manifests(WorkerDeployment(deployment.name, deployment.models, batch=True), settings)


def render_all(settings: RenderSettings, catalog: ModelCatalog | None = None) -> dict[str, list[Manifest]]:
    """Every manifest, grouped by output file; file names sort in the order `kubectl apply` needs."""
    catalog = catalog or load_catalog()
    files: dict[str, list[Manifest]] = {
        "00-cluster.yaml": cluster_manifests(settings),
        "10-capacity-reservation.yaml": capacity_reservation_manifests(settings, catalog),
    }
    for deployment in worker_deployments(catalog):
        files[f"20-{worker_name(deployment.name)}.yaml"] = model_worker_manifests(deployment, settings)
        if batch := batch_worker_manifests(deployment, settings):
            files[f"30-{batch_worker_name(deployment.name)}.yaml"] = batch
    return files


def dump(manifests: Sequence[Manifest]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False, explicit_start=True)


def buffer_replica_count(value: str) -> tuple[str, int]:
    """Parses one `POOL=COUNT` pair, e.g. `l4=3`."""
    pool, _, count = value.partition("=")
    if pool not in GPU_POOLS or not count.isdigit():
        raise argparse.ArgumentTypeError(f"expected POOL=COUNT with POOL in {sorted(GPU_POOLS)}, got {value!r}")
    return pool, int(count)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="directory to write one file per group into; stdout if omitted")
    parser.add_argument("--project-id", default=RenderSettings.project_id)
    parser.add_argument("--region", default=RenderSettings.region, help="Artifact Registry region")
    parser.add_argument("--namespace", default=RenderSettings.namespace)
    parser.add_argument(
        "--image-tag", default=RenderSettings.image_tag, help="worker image tag, e.g. the commit's short SHA"
    )
    parser.add_argument("--image", help="full worker image reference; overrides --region/--project-id/--image-tag")
    parser.add_argument("--redis-url", default=RenderSettings.redis_url, help="Memorystore URL, redis://HOST:6379/0")
    parser.add_argument(
        "--max-shared-clients-per-gpu",
        type=int,
        default=DEFAULT_MAX_SHARED_CLIENTS_PER_GPU,
        help="must match the time-sharing node pool's setting",
    )
    parser.add_argument(
        "--buffer-replicas",
        nargs="*",
        default=[],
        type=buffer_replica_count,
        metavar="POOL=COUNT",
        help="capacity buffer pods per GPU pool (default: 1 per pool the catalog uses)",
    )
    parser.add_argument(
        "--adapter-host-cache-bytes",
        type=int,
        default=ADAPTER_HOST_CACHE_BYTES,
        help="each worker's host cache of LoRA adapters, counted in its pod's memory (MAAS_ADAPTER_HOST_CACHE_BYTES)",
    )
    parser.add_argument(
        "--batch-max-replicas",
        type=int,
        default=None,
        help="Spot batch workers per deployment at most (default: the catalog's max_replicas; 0: no batch Deployments)",
    )
    parser.add_argument("--catalog", help="model catalog file (default: contract/models.yaml; never the local overlay)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = RenderSettings(
        project_id=args.project_id,
        region=args.region,
        namespace=args.namespace,
        image_tag=args.image_tag,
        worker_image=args.image,
        redis_url=args.redis_url,
        max_shared_clients_per_gpu=args.max_shared_clients_per_gpu,
        buffer_replicas=dict(args.buffer_replicas),
        adapter_host_cache_bytes=args.adapter_host_cache_bytes,
        batch_max_replicas=args.batch_max_replicas,
    )
    files = render_all(settings, load_catalog(args.catalog))
    if args.out is None:
        sys.stdout.write(dump([manifest for manifests in files.values() for manifest in manifests]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("*.yaml"):
        stale.unlink()  # a model or group removed from the catalog must not leave its manifests behind
    for file_name, manifests in files.items():
        (args.out / file_name).write_text(dump(manifests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
