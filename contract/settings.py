"""Settings for both services, read once from environment variables (all prefixed MAAS_)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from contract import naming
from contract.digits import ascii_digits

ReplyMode = Literal["per-request", "per-instance"]
LOCAL_DEFAULT_API_KEY = "local-dev-key"
# The local stack's admin key when MAAS_ADMIN_KEYS / MAAS_ADMIN_KEY_SHA256 are unset (never outside MAAS_ENV=local).
LOCAL_DEFAULT_ADMIN_KEY = "local-admin-key"
# Per-key limits in production when MAAS_RATE_LIMIT_PER_MINUTE / MAAS_CONCURRENCY_LIMIT are unset.
PRODUCTION_RATE_LIMIT = 600
PRODUCTION_CONCURRENCY_LIMIT = 32
# The worker's host-memory budget for LoRA adapters (MAAS_ADAPTER_HOST_CACHE_BYTES): four of SDXL's or FLUX's largest
# files (1 GiB), sixteen of SD 1.5's (256 MiB); with a load in flight it fits a time-shared L4 pod's 12 GiB beside
# the worker itself.
ADAPTER_HOST_CACHE_BYTES = 4 * 1024**3
# ... and for control models (MAAS_CONTROL_HOST_CACHE_BYTES): two SD 1.5 ControlNets in float32 (1.4 GB each) and an
# IP-Adapter with its image encoder, or five in float16.
CONTROL_HOST_CACHE_BYTES = 4 * 1024**3


def local_stack_environment(stack_dir: Path) -> dict[str, str]:
    """The variables that point the Google clients and the settings at a running local stack (what `make up`
    recorded in `{stack_dir}/stack.json`), for the operator commands run beside it (import, analytics)."""
    stack_file = stack_dir / "stack.json"
    if not stack_file.exists():
        raise FileNotFoundError(f"{stack_file} not found: is the local stack up (`make up`)?")
    return {key: value for key, value in json.loads(stack_file.read_text()).items() if key.isupper()}


def _csv(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def _flag(value: str | None) -> bool:
    if value is None or value.strip() == "":
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def _key_limits(value: str | None) -> dict[str, tuple[int, int]]:
    """`DIGEST=PER_MINUTE/CONCURRENT,...` (0: unlimited) into {digest: (per minute, concurrent)}."""
    limits = {}
    for entry in _csv(value):
        digest, _, pair = entry.partition("=")
        per_minute, _, concurrent = pair.partition("/")
        if len(digest.strip()) != 64 or not ascii_digits(per_minute.strip()) or not ascii_digits(concurrent.strip()):
            raise ValueError(f"MAAS_KEY_LIMITS: expected SHA256=PER_MINUTE/CONCURRENT, got {entry[:20]!r}...")
        limits[digest.strip().lower()] = (int(per_minute), int(concurrent))
    return limits


# Where a key may point a batch's input (MAAS_BATCH_INPUTS): `WHO=gs://bucket/prefix` (files) or
# `WHO=bq://project.dataset[.table_prefix]` (BigQuery tables) entries, WHO a key's SHA-256 digest or `*` (every key);
# `{key_id}` in a location is the key's id (its digest's first 12 characters).
BATCH_INPUT_KEY_ID = "{key_id}"
EVERY_KEY = "*"
BATCH_INPUT_SCHEMES = ("gs://", "bq://")


def _batch_inputs(
    value: str | None, default: str, service_buckets: set[str], service_datasets: set[str] = frozenset()
) -> dict[str, tuple[str, ...]]:
    """`WHO=gs://bucket[/prefix],WHO=bq://project.dataset[.prefix],...` into {digest or `*`: (locations)}; never one
    of the service's buckets nor its own datasets (`project.dataset`: the inference log's)."""
    inputs: dict[str, list[str]] = {}
    for entry in _csv(value if value is not None else default):
        who, _, location = entry.partition("=")
        who, location = who.strip().lower(), location.strip()
        scheme = location[:5]
        if scheme == "bq://":
            project, _, rest = location[5:].partition(".")
            dataset = rest.partition(".")[0]
            if (who != EVERY_KEY and len(who) != 64) or not project or not dataset:
                raise ValueError(
                    f"MAAS_BATCH_INPUTS: expected SHA256=bq://project.dataset[.prefix], got {entry[:40]!r}"
                )
            if f"{project}.{dataset}" in service_datasets:
                raise ValueError(
                    f"MAAS_BATCH_INPUTS: {project}.{dataset} is the service's own dataset; batch inputs never come "
                    "from it"
                )
            if "." not in rest:
                location += "."  # a whole dataset: `bq://p.logs` must not cover `bq://p.logs_other.t`
            inputs.setdefault(who, []).append(location)
            continue
        bucket = location.removeprefix("gs://").partition("/")[0]
        if (who != EVERY_KEY and len(who) != 64) or scheme != "gs://" or not bucket:
            raise ValueError(f"MAAS_BATCH_INPUTS: expected SHA256=gs://bucket/prefix or *=gs://..., got {entry[:40]!r}")
        if bucket in service_buckets:
            raise ValueError(
                f"MAAS_BATCH_INPUTS: {bucket} is the service's own bucket; batch inputs never come from it"
            )
        inputs.setdefault(who, []).append(location)
    return {who: tuple(locations) for who, locations in inputs.items()}


def api_key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _admin_digests(env, stage: str) -> frozenset[str]:
    digests = {*_csv(env.get("MAAS_ADMIN_KEY_SHA256")), *(api_key_digest(k) for k in _csv(env.get("MAAS_ADMIN_KEYS")))}
    if not digests and stage == "local":
        digests.add(api_key_digest(LOCAL_DEFAULT_ADMIN_KEY))
    return frozenset(d.lower() for d in digests)


@dataclass(frozen=True)
class Settings:
    """Everything configurable; the docs' configuration reference is generated from these fields and their comments."""

    # `local` or `production`; production refuses to start without API keys.
    env: Literal["local", "production"] = "local"
    # The Google Cloud project.
    project_id: str = "maas-local"
    # The model catalog (unset: contract/models.yaml).
    catalog_path: str | None = None
    # Overlay files over the catalog, comma-separated (the local stack's, contract/catalog.py); unset in production.
    catalog_overlay: str | None = None
    # Redis for stored results, progress, jobs, leases and limits.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # GCS buckets (unset: `{project}-maas-models` and `{project}-maas-payloads`).
    model_bucket: str = ""
    payload_bucket: str = ""
    # The BigQuery dataset of the inference log, the audit table and the views.
    dataset: str = naming.DATASET
    # Set locally to the BigQuery emulator's REST address; unset in production.
    bigquery_endpoint: str | None = None
    # The inference log table: one row per request.
    log_table: str = naming.LOG_TABLE
    # Who changed a model's traffic split, and every automatic rollback (contract/rollout_audit_schema.json).
    audit_table: str = naming.AUDIT_TABLE
    # How often each API process re-reads the runtime traffic splits from Redis (a PUT is in force within it).
    traffic_refresh_seconds: float = 0.5
    # How often the rollback guard (one API process at a time) compares each canary with its stable version.
    rollback_check_seconds: float = 2.0
    # Locally the BigQuery emulator's Storage Write API (gRPC host:port); unset in production.
    bigquery_write_endpoint: str | None = None
    # The inference log's write-ahead spool: rows wait here while BigQuery is unreachable.
    log_spool_dir: str = "/tmp/maas-log-spool"
    log_spool_max_bytes: int = 256 * 1024 * 1024
    # `per-request` (a reply subscription per request) or `per-instance` (one per API process).
    reply_mode: ReplyMode = "per-request"
    # Inputs and outputs above this many bytes travel through the payload bucket, not the message.
    inline_payload_limit: int = 256 * 1024
    # The largest request body the API accepts.
    max_request_bytes: int = 8 * 1024 * 1024
    # How long workers keep results, progress and job records by request id (a batch line's answer: until its
    # batch's end plus this, back to this once collected).
    result_ttl_seconds: int = 3600
    # API keys by SHA-256 digest (production, from Secret Manager); MAAS_API_KEYS (plain keys) is for local use,
    # unset locally means `local-dev-key`.
    api_key_sha256: frozenset[str] = field(default_factory=frozenset)
    # API keys (by SHA-256 digest) allowed to send `priority: high`; MAAS_HIGH_PRIORITY_KEYS for local use.
    high_priority_key_sha256: frozenset[str] = field(default_factory=frozenset)
    # Admin keys (by SHA-256 digest): the only ones allowed to change a model's traffic split or register
    # adapters. An admin key is also an API key. MAAS_ADMIN_KEYS (plain keys) is for local use.
    admin_key_sha256: frozenset[str] = field(default_factory=frozenset)
    # The API process's id (its reply subscription in `per-instance` mode); unset: host name and a random suffix.
    instance_id: str = ""
    # API: cache, idempotency, jobs
    # Cached predict responses live this long; entries larger than the cap are never cached.
    cache_ttl_seconds: int = 24 * 3600
    cache_max_entry_bytes: int = 4 * 1024 * 1024
    # A Redis of its own for the cache (maxmemory + allkeys-lru); unset: the shared MAAS_REDIS_URL.
    cache_redis_url: str | None = None
    # How long an `Idempotency-Key` answer is kept.
    idempotency_ttl_seconds: int = 24 * 3600
    # How long a queued job (or a sync request turned into one) may wait for a worker before it expires.
    job_deadline_seconds: int = 900
    # Admission by predicted wait: the window over which a model's answer rate is measured (api_server/predict/admission.py).
    admission_window_seconds: float = 60.0
    # After a Redis failure, the API stops trying Redis for this long, then tries again.
    redis_retry_seconds: float = 1.0
    # How long the API waits for Pub/Sub to accept a request before answering 503 (MAAS_PUBLISH_TIMEOUT_SECONDS,
    # 1 to 60): Pub/Sub's own acceptance takes milliseconds; the test suite's emulator, starved on a loaded machine,
    # can take longer than the default.
    publish_timeout_seconds: float = 10.0
    # The API's Redis pool per process: a request beyond it waits this long for a connection, then gets a 503.
    redis_max_connections: int = 100
    redis_pool_timeout_seconds: float = 2.0
    # Per-API-key limits (0: unlimited), and per-key overrides: SHA-256 digest -> (per minute, concurrent).
    rate_limit_per_minute: int = 0
    concurrency_limit: int = 0
    key_limits: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Job webhooks: signed with this secret (unset: webhooks refused), tried this many times.
    webhook_signing_secret: str = ""
    webhook_attempts: int = 5
    # Test-only: trust this CA for webhook receivers and allow loopback receivers (refused in production).
    webhook_ca_file: str | None = None
    webhook_allow_loopback: bool = False
    # Reply-subscription janitor in the API process (0: off), and the age past which a leaked one is deleted
    # (0: the longest catalog request timeout plus ten minutes).
    janitor_interval_seconds: int = 0
    janitor_older_than_seconds: int = 0
    # Batch jobs: at most this many of one batch's lines in flight per model (0: derived from the batch
    # workers' capacity, contract/batch_capacity.py: max replicas x max_batch_size x 4); the most Spot batch workers
    # per deployment, as the manifests were rendered with `--batch-max-replicas` (None: the catalog's replicas.max);
    # a batch whose first `batch_fail_fast_lines` lines are all invalid fails; an inline batch holds at most this
    # many lines; the feeder's Redis lease (another API process resumes a batch whose feeder stops renewing it);
    # whether this process feeds and collects batches at all (CPU always allocated: docs/guides/batch-jobs.md); how many
    # batches not yet ended one API key may have (a submit past it is a 429).
    batch_max_in_flight: int = 0
    batch_worker_max_replicas: int | None = None
    batch_fail_fast_lines: int = 100
    batch_inline_max_lines: int = 1000
    batch_lease_seconds: float = 10.0
    batch_runner: bool = True
    # Where each key may point a batch's `input_file` or `input_table`: {SHA-256 digest or `*`: gs:// prefixes and
    # bq://project.dataset.table prefixes} (MAAS_BATCH_INPUTS; `{key_id}` in a prefix is the caller's key id). Never
    # the model or payload bucket nor the service's dataset. Unset: none in production (inline `requests` only); locally
    # each key's own prefix of the batch-inputs bucket and its `{key_id}_` tables of the batch-inputs dataset.
    batch_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Batches not yet ended one API key may have; one more submit is a 429 naming this cap.
    batch_max_active_per_key: int = 10
    # Worker
    # The catalog models this worker process serves (one deployment, see the catalog's `worker_group`).
    models: tuple[str, ...] = ()
    # Where the worker downloads weights.
    weights_cache_dir: str = "/tmp/maas-weights"
    # Weights that fail their manifest check are downloaded and checked again after this many seconds.
    weights_retry_seconds: float = 30.0
    # The worker's probe and metrics server (/startupz, /readyz, /livez, /metrics); the local stack binds 127.0.0.1.
    worker_health_port: int = 8081
    worker_health_host: str = "0.0.0.0"  # noqa: S104 - kubelet probes reach the pod IP; the local stack binds loopback
    # The worker's CPU threads for torch (0: torch's default).
    torch_threads: int = 0
    # MAAS_TORCH_COMPILE over the catalog's `compile:` modes (CUDA only; artifacts cached in the model bucket): unset,
    # each model as its catalog entry says; `0` every model eager (a rollback without a catalog change); `1` every
    # diffusers model compiled, in its catalog mode or `default`.
    torch_compile: bool | None = None
    # Worker threads that encode, upload, store and publish finished requests off the device thread.
    finisher_threads: int = 4
    # How much lower the finisher threads' CPU priority is than the device thread's (Linux nice, 0 to 19; 0: equal).
    # Their PNG encode releases the GIL but takes cores; where cores are short the device thread gets them first.
    finisher_nice: int = 10
    # A worker's hold on a request lapses this long after its last heartbeat; the watchdog then re-dispatches it.
    holder_lease_seconds: float = 3.0
    # LoRA adapters a worker keeps in host memory, all its models together, in bytes of their files (each model's
    # catalog `host_cache` caps how many). A load briefly holds about twice its file beside them; the Kubernetes
    # renderer counts both in the pod's memory and sets this for each worker (infra/k8s/render.py).
    adapter_host_cache_bytes: int = ADAPTER_HOST_CACHE_BYTES
    # Control models (ControlNets, IP-Adapters) a worker keeps in host memory, all its models together, in bytes of
    # their files (model_worker/controls/loader.py).
    control_host_cache_bytes: int = CONTROL_HOST_CACHE_BYTES
    # Local-stack fault hook: adapter name -> seconds added to its first read from the bucket (a slow load, on
    # purpose; model_worker/serving/fault_hooks.py). MAAS_ADAPTER_LOAD_DELAY="name=seconds,..."; refused in production.
    adapter_load_delay: dict[str, float] = field(default_factory=dict)
    # Local-stack fault hook: a directory of gates (model_worker/serving/fault_hooks.py). A synthetic call of a prompt
    # `!hold <name>` waits after its first step until `<dir>/<name>` exists. MAAS_HOLD_DIR; refused in production.
    hold_dir: str = ""
    # `step` or `request` for every model this worker serves, over the catalog's `scheduling` (unset: the
    # catalog's): a rollback without a catalog change, and the benchmark's side-by-side runs.
    scheduling: str | None = None
    # The priorities this worker pulls (MAAS_WORKER_PRIORITIES, comma-separated; unset: all, `high,normal,batch`).
    # The Spot batch Deployment sets `batch` (infra/k8s/render.py): its workers never take interactive requests.
    worker_priorities: tuple[str, ...] = naming.PRIORITIES
    # Batch images a worker holds or runs at once (MAAS_BATCH_IMAGES; 0, the default: its models' max_batch_size).
    # An idle worker fills its device with batch lines; an interactive request that arrives takes the device at the
    # running set's next step (or the batch call's next step), after at most one batched step plus an encode or
    # decode already under way (docs/guides/batch-jobs.md). 1 caps that wait at one image's step, at batch 1's rate.
    batch_images: int = 0

    def catalog(self):
        from contract.catalog import load_catalog

        return load_catalog(self.catalog_path, self.catalog_overlay)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        project_id = env.get("MAAS_PROJECT_ID", "maas-local")
        digests = set(_csv(env.get("MAAS_API_KEY_SHA256")))
        digests.update(api_key_digest(key) for key in _csv(env.get("MAAS_API_KEYS")))
        stage = env.get("MAAS_ENV", "local")
        if stage not in ("local", "production"):
            raise ValueError(f"MAAS_ENV must be 'local' or 'production', not {stage!r}")
        reply_mode = env.get("MAAS_REPLY_MODE", "per-request")
        if reply_mode not in ("per-request", "per-instance"):
            raise ValueError(f"MAAS_REPLY_MODE must be 'per-request' or 'per-instance', not {reply_mode!r}")
        if stage == "production" and _flag(env.get("MAAS_WEBHOOK_ALLOW_LOOPBACK")):
            raise ValueError("MAAS_WEBHOOK_ALLOW_LOOPBACK is for tests; production never calls loopback webhooks")
        if stage == "production" and _csv(env.get("MAAS_ADAPTER_LOAD_DELAY")):
            raise ValueError("MAAS_ADAPTER_LOAD_DELAY is a local-stack fault hook; production never slows its loads")
        if stage == "production" and env.get("MAAS_HOLD_DIR"):
            raise ValueError("MAAS_HOLD_DIR is a local-stack fault hook; production never holds a call")
        host_cache_bytes = int(env.get("MAAS_ADAPTER_HOST_CACHE_BYTES") or ADAPTER_HOST_CACHE_BYTES)
        if host_cache_bytes < 1:
            raise ValueError(f"MAAS_ADAPTER_HOST_CACHE_BYTES must be positive, not {host_cache_bytes}")
        control_cache_bytes = int(env.get("MAAS_CONTROL_HOST_CACHE_BYTES") or CONTROL_HOST_CACHE_BYTES)
        if control_cache_bytes < 1:
            raise ValueError(f"MAAS_CONTROL_HOST_CACHE_BYTES must be positive, not {control_cache_bytes}")
        worker_priorities = tuple(_csv(env.get("MAAS_WORKER_PRIORITIES"))) or naming.PRIORITIES
        unknown = [p for p in worker_priorities if p not in naming.PRIORITIES]
        if unknown:
            raise ValueError(f"MAAS_WORKER_PRIORITIES: {unknown} not among {list(naming.PRIORITIES)}")
        model_bucket = env.get("MAAS_MODEL_BUCKET") or naming.model_bucket(project_id)
        payload_bucket = env.get("MAAS_PAYLOAD_BUCKET") or naming.payload_bucket(project_id)
        local_inputs = (
            f"*=gs://{naming.batch_input_bucket(project_id)}/{BATCH_INPUT_KEY_ID}/,"
            f"*=bq://{project_id}.{naming.BATCH_INPUT_DATASET}.{BATCH_INPUT_KEY_ID}_"
        )
        instance = env.get("MAAS_INSTANCE_ID") or f"{socket.gethostname()[:20]}-{uuid.uuid4().hex[:8]}"
        return cls(
            env=stage,  # type: ignore[arg-type]
            project_id=project_id,
            catalog_path=env.get("MAAS_CATALOG_PATH") or None,
            catalog_overlay=env.get("MAAS_CATALOG_OVERLAY") or None,
            redis_url=env.get("MAAS_REDIS_URL", cls.redis_url),
            model_bucket=model_bucket,
            payload_bucket=payload_bucket,
            dataset=env.get("MAAS_DATASET", naming.DATASET),
            bigquery_endpoint=env.get("MAAS_BIGQUERY_ENDPOINT") or None,
            log_table=env.get("MAAS_LOG_TABLE", naming.LOG_TABLE),
            audit_table=env.get("MAAS_AUDIT_TABLE", naming.AUDIT_TABLE),
            traffic_refresh_seconds=float(env.get("MAAS_TRAFFIC_REFRESH_SECONDS", cls.traffic_refresh_seconds)),
            rollback_check_seconds=float(env.get("MAAS_ROLLBACK_CHECK_SECONDS", cls.rollback_check_seconds)),
            bigquery_write_endpoint=env.get("MAAS_BIGQUERY_WRITE_ENDPOINT") or None,
            log_spool_dir=env.get("MAAS_LOG_SPOOL_DIR", cls.log_spool_dir),
            log_spool_max_bytes=int(env.get("MAAS_LOG_SPOOL_MAX_BYTES", cls.log_spool_max_bytes)),
            reply_mode=reply_mode,  # type: ignore[arg-type]
            inline_payload_limit=int(env.get("MAAS_INLINE_PAYLOAD_LIMIT", cls.inline_payload_limit)),
            max_request_bytes=int(env.get("MAAS_MAX_REQUEST_BYTES", cls.max_request_bytes)),
            result_ttl_seconds=int(env.get("MAAS_RESULT_TTL_SECONDS", cls.result_ttl_seconds)),
            api_key_sha256=frozenset(digests),
            high_priority_key_sha256=frozenset(
                {
                    *_csv(env.get("MAAS_HIGH_PRIORITY_KEY_SHA256")),
                    *(api_key_digest(key) for key in _csv(env.get("MAAS_HIGH_PRIORITY_KEYS"))),
                }
            ),
            admin_key_sha256=_admin_digests(env, stage),
            instance_id=instance.lower().replace("_", "-").replace(".", "-"),
            cache_ttl_seconds=int(env.get("MAAS_CACHE_TTL_SECONDS", cls.cache_ttl_seconds)),
            cache_max_entry_bytes=int(env.get("MAAS_CACHE_MAX_ENTRY_BYTES", cls.cache_max_entry_bytes)),
            cache_redis_url=env.get("MAAS_CACHE_REDIS_URL") or None,
            idempotency_ttl_seconds=int(env.get("MAAS_IDEMPOTENCY_TTL_SECONDS", cls.idempotency_ttl_seconds)),
            job_deadline_seconds=int(env.get("MAAS_JOB_DEADLINE_SECONDS", cls.job_deadline_seconds)),
            admission_window_seconds=float(env.get("MAAS_ADMISSION_WINDOW_SECONDS", cls.admission_window_seconds)),
            redis_retry_seconds=float(env.get("MAAS_REDIS_RETRY_SECONDS", cls.redis_retry_seconds)),
            publish_timeout_seconds=_publish_timeout(env.get("MAAS_PUBLISH_TIMEOUT_SECONDS")),
            redis_max_connections=int(env.get("MAAS_REDIS_MAX_CONNECTIONS", cls.redis_max_connections)),
            redis_pool_timeout_seconds=float(
                env.get("MAAS_REDIS_POOL_TIMEOUT_SECONDS", cls.redis_pool_timeout_seconds)
            ),
            # Unset: unlimited on the local stack (benchmarks, tests), a guard in production.
            rate_limit_per_minute=int(
                env.get("MAAS_RATE_LIMIT_PER_MINUTE") or (PRODUCTION_RATE_LIMIT if stage == "production" else 0)
            ),
            concurrency_limit=int(
                env.get("MAAS_CONCURRENCY_LIMIT") or (PRODUCTION_CONCURRENCY_LIMIT if stage == "production" else 0)
            ),
            key_limits=_key_limits(env.get("MAAS_KEY_LIMITS")),
            webhook_signing_secret=env.get("MAAS_WEBHOOK_SIGNING_SECRET", ""),
            webhook_attempts=int(env.get("MAAS_WEBHOOK_ATTEMPTS", cls.webhook_attempts)),
            webhook_ca_file=env.get("MAAS_WEBHOOK_CA_FILE") or None,
            webhook_allow_loopback=_flag(env.get("MAAS_WEBHOOK_ALLOW_LOOPBACK")),
            janitor_interval_seconds=int(env.get("MAAS_JANITOR_INTERVAL_SECONDS") or 0),
            janitor_older_than_seconds=int(env.get("MAAS_JANITOR_OLDER_THAN_SECONDS") or 0),
            batch_max_in_flight=int(env.get("MAAS_BATCH_MAX_IN_FLIGHT") or cls.batch_max_in_flight),
            batch_worker_max_replicas=(
                int(env["MAAS_BATCH_WORKER_MAX_REPLICAS"]) if env.get("MAAS_BATCH_WORKER_MAX_REPLICAS") else None
            ),
            batch_fail_fast_lines=int(env.get("MAAS_BATCH_FAIL_FAST_LINES") or cls.batch_fail_fast_lines),
            batch_inline_max_lines=int(env.get("MAAS_BATCH_INLINE_MAX_LINES") or cls.batch_inline_max_lines),
            batch_lease_seconds=float(env.get("MAAS_BATCH_LEASE_SECONDS") or cls.batch_lease_seconds),
            batch_max_active_per_key=int(env.get("MAAS_BATCH_MAX_ACTIVE_PER_KEY") or cls.batch_max_active_per_key),
            batch_runner=env.get("MAAS_BATCH_RUNNER", "1").strip() == "" or _flag(env.get("MAAS_BATCH_RUNNER", "1")),
            batch_inputs=_batch_inputs(
                env.get("MAAS_BATCH_INPUTS"),
                local_inputs if stage == "local" else "",
                {model_bucket, payload_bucket},
                {f"{project_id}.{env.get('MAAS_DATASET', naming.DATASET)}"},
            ),
            models=tuple(_csv(env.get("MAAS_MODELS"))),
            weights_cache_dir=env.get("MAAS_WEIGHTS_CACHE_DIR", cls.weights_cache_dir),
            weights_retry_seconds=float(env.get("MAAS_WEIGHTS_RETRY_SECONDS", cls.weights_retry_seconds)),
            worker_health_port=int(env.get("MAAS_WORKER_HEALTH_PORT", cls.worker_health_port)),
            worker_health_host=env.get("MAAS_WORKER_HEALTH_HOST", cls.worker_health_host),
            torch_threads=int(env.get("MAAS_TORCH_THREADS", "0")),
            torch_compile=_flag(env["MAAS_TORCH_COMPILE"]) if env.get("MAAS_TORCH_COMPILE") else None,
            finisher_threads=int(env.get("MAAS_FINISHER_THREADS", cls.finisher_threads)),
            finisher_nice=int(env.get("MAAS_FINISHER_NICE", cls.finisher_nice)),
            holder_lease_seconds=float(env.get("MAAS_HOLDER_LEASE_SECONDS", cls.holder_lease_seconds)),
            scheduling=env.get("MAAS_SCHEDULING") or None,
            worker_priorities=tuple(p for p in naming.PRIORITIES if p in worker_priorities),
            batch_images=int(env.get("MAAS_BATCH_IMAGES") or cls.batch_images),
            adapter_host_cache_bytes=host_cache_bytes,
            control_host_cache_bytes=control_cache_bytes,
            adapter_load_delay={
                name.strip(): float(seconds)
                for name, _, seconds in (item.partition("=") for item in _csv(env.get("MAAS_ADAPTER_LOAD_DELAY")))
            },
            hold_dir=env.get("MAAS_HOLD_DIR", ""),
        )


MAX_PUBLISH_TIMEOUT_SECONDS = 60.0


def _publish_timeout(value: str | None) -> float:
    seconds = float(value) if value else Settings.publish_timeout_seconds
    if not 1 <= seconds <= MAX_PUBLISH_TIMEOUT_SECONDS:
        raise ValueError(f"MAAS_PUBLISH_TIMEOUT_SECONDS must be 1 to {MAX_PUBLISH_TIMEOUT_SECONDS:.0f}, not {value}")
    return seconds
