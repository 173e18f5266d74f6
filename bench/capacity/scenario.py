"""The simulated deployments as the catalog and the rendered manifests make them: batch limits, timeouts, and the
ScaledObject's thresholds, replica bounds and HPA behaviour read from `infra/k8s/render.py`'s output."""

from __future__ import annotations

from dataclasses import replace

from bench.capacity.profiles import CostProfile
from bench.capacity.simulator import ModelDeployment, ScalerSettings
from bench.capacity.traffic import RequestClass
from contract.catalog import ModelCatalog, load_catalog
from contract.model_spec import ModelSpec
from infra.k8s.render import (
    DEFAULT_MAX_SHARED_CLIENTS_PER_GPU,
    RenderSettings,
    WorkerDeployment,
    model_worker_manifests,
    worker_deployments,
)

SEED_MODEL = "sd15-img2img"
# The seed's day: 1.4 million SD 1.5 image-to-image requests, 512x512, 25 steps, strength 0.75, one image each.
SEED_REQUESTS = 1_400_000
SEED_MIX = [RequestClass(SEED_MODEL, 25, 512, 512, 0.75)]
# Issue 43's fallback in the simulation: the same model in a few steps (an LCM LoRA's 4), on a deployment of its own
# scaled as the model's. The catalog names no image-to-image fallback yet: this is the one a catalog entry would add.
FALLBACK_STEPS = 4


def fallback_deployment(deployment: ModelDeployment) -> ModelDeployment:
    """The fallback of a deployment: its model's few-step variant (`<model>-lcm`), batched and scaled as it is."""
    return replace(deployment, model=f"{deployment.model}-lcm")


def fallback_class(mix: list[RequestClass], deployment: ModelDeployment, steps: int = FALLBACK_STEPS) -> RequestClass:
    """What a refused request of the model becomes on its fallback: its most frequent class in `steps` steps."""
    first = max((c for c in mix if c.model == deployment.model), key=lambda c: c.share)
    return replace(first, model=fallback_deployment(deployment).model, steps=steps)


def deployed_scaler(manifests: list[dict], buffer_nodes: int) -> ScalerSettings:
    """The ScaledObject of one rendered worker deployment, as simulator settings."""
    scaled = next(m for m in manifests if m["kind"] == "ScaledObject")
    spec = scaled["spec"]
    triggers = {t["name"]: t for t in spec["triggers"]}
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    up_policies = {p["type"]: p for p in up["policies"]}
    down_percent = next(p for p in down["policies"] if p["type"] == "Percent")
    return ScalerSettings(
        name="deployed",
        min_replicas=spec["minReplicaCount"],
        max_replicas=spec["maxReplicaCount"],
        backlog_per_replica=float(triggers["backlog-per-worker"]["metadata"]["threshold"]),
        oldest_age_seconds=float(triggers["oldest-request-age"]["metadata"]["threshold"]),
        sync_seconds=float(spec["pollingInterval"]),
        up_percent=float(up_policies["Percent"]["value"]),
        up_pods=int(up_policies["Pods"]["value"]),
        up_period=float(up_policies["Pods"]["periodSeconds"]),
        up_window=float(up["stabilizationWindowSeconds"]),
        down_percent=float(down_percent["value"]),
        down_period=float(down_percent["periodSeconds"]),
        down_window=float(down["stabilizationWindowSeconds"]),
        buffer_nodes=buffer_nodes,
    )


def catalog_deployments(
    models: set[str],
    catalog: ModelCatalog | None = None,
    buffer_nodes: int = 1,
    metric_delay_seconds: float = 120.0,
    max_replicas: int | None = None,
    batching_gains: dict[str, float] | None = None,
) -> list[ModelDeployment]:
    """One simulated deployment per catalog model named in `models` (each model is a deployment of its own in
    `models.yaml`); `max_replicas` overrides the catalog's (e.g. to hold the seed's 150 GPUs), `batching_gains`
    a model's `batching_gain` (another device's: the manifests are rendered from the catalog entry with it)."""
    catalog = catalog or load_catalog()
    found = []
    for deployment in worker_deployments(catalog):
        if not set(deployment.model_names) & models:
            continue
        if len(deployment.models) != 1:
            raise ValueError(f"{deployment.name}: a worker group of several models is not simulated")
        if batching_gains and deployment.models[0].name in batching_gains:
            spec = with_batching_gain(deployment.models[0], batching_gains[deployment.models[0].name])
            deployment = WorkerDeployment(deployment.name, (spec,))
        spec = deployment.models[0]
        scaler = replace(
            deployed_scaler(model_worker_manifests(deployment, RenderSettings()), buffer_nodes),
            metric_delay_seconds=metric_delay_seconds,
        )
        if max_replicas is not None:
            scaler = replace(scaler, max_replicas=max_replicas, min_replicas=min(scaler.min_replicas, max_replicas))
        found.append(
            ModelDeployment(
                model=spec.name,
                max_batch_size=spec.max_batch_size,
                timeout_seconds=spec.request_timeout_seconds,
                image_input=spec.task == "image-to-image",
                scaler=scaler,
                gpu_share=1 / DEFAULT_MAX_SHARED_CLIENTS_PER_GPU if spec.gpu_sharing else 1.0,
            )
        )
    pools = {catalog.get(d.model).hardware for d in found}
    if len(pools) > 1:
        raise ValueError(f"models on several GPU pools ({sorted(pools)}): simulate one pool at a time")
    missing = models - {d.model for d in found}
    if missing:
        raise ValueError(f"not in the catalog: {sorted(missing)}")
    return found


def with_batching_gain(spec: ModelSpec, gain: float) -> ModelSpec:
    """The catalog entry with another `batching_gain`, validated as the catalog validates it at load."""
    return ModelSpec.model_validate({**spec.model_dump(), "batching_gain": gain})


def with_backlog_target(deployments: list[ModelDeployment], target: float, name: str) -> list[ModelDeployment]:
    """The same deployments with another KEDA backlog target per replica."""
    return [replace(d, scaler=replace(d.scaler, name=name, backlog_per_replica=target)) for d in deployments]


def default_strengths(catalog: ModelCatalog | None = None) -> dict[str, float | None]:
    catalog = catalog or load_catalog()
    return {spec.name: spec.defaults.model_dump().get("strength") for spec in catalog.units()}


def lone_seconds(profile: CostProfile, cls: RequestClass, deployment: ModelDeployment, overhead: float) -> float:
    """A request alone on an idle worker: its pipeline call at its own batch (at a time-shared pod's speed), the
    reply, the way back."""
    image_input = deployment.image_input
    call = profile.pipeline_call(
        cls.images, profile.calls(cls.steps, cls.strength if image_input else None), image_input
    )
    return call / deployment.gpu_share + profile.reply_s * cls.images + overhead


def profile_gain(profile: CostProfile, mix: list[RequestClass], deployment: ModelDeployment) -> float:
    """The profile's `batching_gain` for a model: its most frequent request class at its `max_batch_size`."""
    first = max((c for c in mix if c.model == deployment.model), key=lambda c: c.share)
    calls = profile.calls(first.steps, first.strength if deployment.image_input else None)
    return profile.batching_gain(deployment.max_batch_size, calls, deployment.image_input)
