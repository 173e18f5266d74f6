"""How many of one batch's lines the API's feeder keeps in flight per model: derived from the capacity the batch
can use, so adding Spot workers (a larger `replicas.max`) raises a batch's ceiling instead of a fixed number.

The batch Deployment (`model-batch-NAME`, infra/k8s/render.py) of a model's worker deployment runs at most its
deployment's `replicas.max` workers (the largest of its models', or the render's `--batch-max-replicas`, which the
API is told as `MAAS_BATCH_WORKER_MAX_REPLICAS`), each running full batches of `max_batch_size`. KEDA adds a Spot
worker for every `BATCH_BACKLOG_CALLS` full calls of unacked batch lines, so to bring up all of them the feeder must
keep that many calls per worker in flight: the bound is

    batch workers at most × max_batch_size × BATCH_BACKLOG_CALLS

which is also the headroom that keeps a worker busy while its answers travel back and the feeder refills (three
calls queued behind the running one). Without batch Deployments (`--batch-max-replicas 0`) the on-demand workers,
which take batch lines when idle, are the capacity. `MAAS_BATCH_MAX_IN_FLIGHT` set above 0 overrides the lot.

Shared by the renderer and the API (which never reads the manifests): both derive it from the one catalog.
"""

from __future__ import annotations

from contract.catalog import ModelCatalog
from contract.model_spec import ModelSpec

# A batch worker's KEDA target: unacked batch lines per worker, this many full calls of its models (render.py); the
# feeder's headroom factor over the batch's running capacity, for the same reason.
BATCH_BACKLOG_CALLS = 4


def deployment_max_replicas(catalog: ModelCatalog, spec: ModelSpec) -> int:
    """The most workers the deployment serving `spec` runs: the largest `replicas.max` of its models (its own when the
    catalog does not list it, as a version registered after the catalog was loaded)."""
    return max(unit.replicas.max for unit in catalog.deployments().get(spec.deployment, [spec]))


def batch_worker_max_replicas(catalog: ModelCatalog, spec: ModelSpec, override: int | None = None) -> int:
    """The most Spot batch workers serving `spec`: the override (the render's `--batch-max-replicas`) when given,
    else its deployment's `replicas.max`."""
    return deployment_max_replicas(catalog, spec) if override is None else override


def batch_in_flight_bound(
    catalog: ModelCatalog, spec: ModelSpec, worker_max_replicas: int | None = None, explicit: int = 0
) -> int:
    """Lines of one batch in flight for `spec` at most: `explicit` (MAAS_BATCH_MAX_IN_FLIGHT) when above 0, else the
    batch's capacity (module docstring) times `BATCH_BACKLOG_CALLS`."""
    if explicit > 0:
        return explicit
    workers = batch_worker_max_replicas(catalog, spec, worker_max_replicas)
    if workers <= 0:  # no batch Deployments: idle on-demand workers take the batch lines
        workers = deployment_max_replicas(catalog, spec)
    return workers * spec.max_batch_size * BATCH_BACKLOG_CALLS
