"""Names of every Pub/Sub, GCS, Redis and BigQuery resource, derived in one place.

Terraform and the Kubernetes renderer follow the same convention; tests cross-check them against
these functions.
"""

from __future__ import annotations

import re
from typing import Literal

PREFIX = "maas"
REPLIES_TOPIC = f"{PREFIX}-replies"
# Batch lines' replies (issue 35): the batch collector drains this topic's one subscription; the worker's stored
# reply (`result_key`) is what it reads, the message only wakes it.
BATCH_REPLIES_TOPIC = f"{PREFIX}-batch-replies"
BATCH_REPLIES_SUBSCRIPTION = f"{PREFIX}-batch-replies-collector"
DATASET = "maas"
# The local stack's dataset of batch input tables, each key's tables named `{key_id}_...` (production: the callers'
# own datasets, named per key in MAAS_BATCH_INPUTS).
BATCH_INPUT_DATASET = "maas_batch_inputs"
LOG_TABLE = "inference_log"
REPLY_SUBSCRIPTION_LABEL = {"maas-purpose": "reply-wait"}

# A catalog version's name: it becomes part of topic and Kubernetes names (DNS-label characters).
VERSION_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?")
VERSION_SEPARATOR = "--"
# A model's name: part of topic, subscription and bucket names, and of its workers' Deployment
# (`model-worker-{name}`, a DNS label of at most 63 characters: infra/k8s/render.py).
MODEL_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
MODEL_NAME_LENGTH = 63 - len("model-worker-")


def model_name_problem(name: object) -> str | None:
    """What is wrong with a model's name for the catalog, or None (`fullmatch`: no trailing newline slips by)."""
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name) or len(name) > MODEL_NAME_LENGTH:
        return (f"model name {name!r} must be lowercase letters, digits and '-' (not first or last), at most "
                f"{MODEL_NAME_LENGTH} characters")  # fmt: skip
    return None


def version_name_problem(version: object) -> str | None:
    """What is wrong with a catalog version's name, or None."""
    if not isinstance(version, str) or not VERSION_NAME.fullmatch(version):
        return (f"version {version!r} must be lowercase letters, digits and '-' (not first or last), at most 16 "
                "characters")  # fmt: skip
    return None


Priority = Literal["high", "normal", "batch"]
# Workers take from these in this order; each has a topic of its own because subscription filters are not
# applied by the emulator, and a filter-based split would put the priorities in one backlog anyway. `batch`
# (issue 35) is below normal: a worker pulls it only when no interactive request waits, and a batch line is
# the first to leave a running set an interactive request wants to join.
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "batch")
# The priorities a caller waits on; `batch` is fed by the batch API, never sent to the predict route.
INTERACTIVE_PRIORITIES: tuple[Priority, ...] = ("high", "normal")
PRIORITY_SUFFIXES: dict[str, str] = {"high": "-high", "normal": "", "batch": "-batch"}


def _priority_suffix(priority: Priority) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, not {priority!r}")
    return PRIORITY_SUFFIXES[priority]


def version_queue(model: str, version: str) -> str:
    """What a version of a multi-version model names its queues and deployment after (`{model}--{version}`):
    each version has its own topics, subscriptions and workers."""
    return f"{model}{VERSION_SEPARATOR}{version}"


def request_topic(model: str, priority: Priority = "normal") -> str:
    return f"{PREFIX}-requests-{model}{_priority_suffix(priority)}"


def worker_subscription(model: str, priority: Priority = "normal") -> str:
    return f"{PREFIX}-requests-{model}{_priority_suffix(priority)}-workers"


def dead_letter_topic(model: str) -> str:
    """One per model: every priority's subscription dead-letters here."""
    return f"{PREFIX}-requests-{model}-dead-letter"


def dead_letter_subscription(model: str) -> str:
    return f"{PREFIX}-requests-{model}-dead-letter-sub"


def reply_subscription(request_id: str) -> str:
    """Ephemeral per-request subscription on the replies topic."""
    return f"{PREFIX}-reply-{request_id}"


def instance_reply_subscription(instance_id: str) -> str:
    """Long-lived per-API-instance subscription on the replies topic."""
    return f"{PREFIX}-replies-instance-{instance_id}"


def model_bucket(project_id: str) -> str:
    return f"{project_id}-{PREFIX}-models"


def payload_bucket(project_id: str) -> str:
    return f"{project_id}-{PREFIX}-payloads"


def batch_input_bucket(project_id: str) -> str:
    """The local stack's bucket of batch input files, each key under its own prefix (production: the callers'
    own buckets, named per key in MAAS_BATCH_INPUTS)."""
    return f"{project_id}-{PREFIX}-batch-inputs"


def result_object(request_id: str, index: int) -> str:
    """Payload-bucket object for output image `index` of a request (above the inline limit)."""
    return f"results/{request_id}/{index}.png"


def flow_stage_object(request_id: str, index: int) -> str:
    """Payload-bucket object holding a flow's stage `index` output (kept until the flow ends, to resume from)."""
    return f"{flow_stage_prefix(request_id)}stage-{index}"


def flow_stage_prefix(request_id: str) -> str:
    return f"flows/{request_id}/"


def input_object(request_id: str, index: int) -> str:
    """Payload-bucket object for input image `index` of a request (above the inline limit)."""
    return f"inputs/{request_id}/{index}"


def batch_prefix(batch_id: str) -> str:
    """Payload-bucket prefix of one batch (issue 35): its record, inline input, results and errors parts, images."""
    return f"{BATCHES_PREFIX}{batch_id}/"


# A batch's longest `completion_window`, and how long its files stay readable after it ends (its Redis record lives
# as long: it is listed for that time). The payload bucket keeps `batches/` objects for both together at least
# (terraform/storage.tf's `batch_retention_days`, checked by tests/infra/test_terraform.py).
BATCH_MAX_WINDOW_SECONDS = 7 * 24 * 3600
BATCH_DOWNLOAD_SECONDS = 7 * 24 * 3600

# Payload-bucket prefixes of one request's objects (inputs, results, a flow's stage outputs): deleted after
# `payload_retention_days`. `batches/` has a longer rule of its own and `batches-active/` none.
REQUEST_PAYLOAD_PREFIXES = ("inputs/", "results/", "flows/")
BATCHES_PREFIX = "batches/"

# Payload-bucket prefix of an empty marker object per running batch: what a process finds batches by after Redis
# lost them (a Redis restart without persistence), to restore them from their GCS copies.
BATCHES_ACTIVE_PREFIX = "batches-active/"


def compile_cache_object(weights_path: str, key: str) -> str:
    """Model-bucket object holding saved torch.compile artifacts, next to the weights they were built for."""
    return f"{weights_path.rstrip('/')}/compile-cache/{key}.bin"


# An adapter version's files: diffusers' `save_lora_weights` name, safetensors only.
ADAPTER_FILE = "pytorch_lora_weights.safetensors"


def model_adapters_prefix(model: str) -> str:
    """Model-bucket prefix of every adapter of a model (the API's write access ends at `adapters/`)."""
    return f"adapters/{model}/"


def adapter_prefix(model: str, name: str, version: str | None = None) -> str:
    """Model-bucket prefix of an adapter (`adapters/{model}/{name}/`), or of one of its versions."""
    base = f"{model_adapters_prefix(model)}{name}/"
    return base if version is None else f"{base}{version}/"


def adapter_record(model: str, name: str) -> str:
    """Model-bucket object recording an adapter's registration (its current version, digest, rank)."""
    return f"{adapter_prefix(model, name)}registration.json"


# Control models (ControlNets, IP-Adapters) live beside the adapters, under the one prefix the API may write
# (`adapters/`), in a folder no model name takes: `adapters/_controls/{model}/{name}/{version}/`.
CONTROLS_FOLDER = "_controls"


def model_controls_prefix(model: str) -> str:
    """Model-bucket prefix of every control model registered for a model."""
    return f"adapters/{CONTROLS_FOLDER}/{model}/"


def control_prefix(model: str, name: str, version: str | None = None) -> str:
    """Model-bucket prefix of a control model (`.../{name}/`), or of one of its versions (its files under it)."""
    base = f"{model_controls_prefix(model)}{name}/"
    return base if version is None else f"{base}{version}/"


def control_record(model: str, name: str) -> str:
    """Model-bucket object recording a control model's registration (its kind, current version, digest)."""
    return f"{control_prefix(model, name)}registration.json"


def result_key(request_id: str) -> str:
    """Redis key under which the worker keeps a reply, so it outlives a missed notification."""
    return f"{PREFIX}:result:{request_id}"


def flow_stages_key(request_id: str) -> str:
    """Redis hash of a flow's finished stages (index -> StageReport JSON), until its deadline."""
    return f"{PREFIX}:flow:{request_id}:stages"


def progress_key(request_id: str) -> str:
    """Redis key with a request's denoising progress (step i of n), written by the worker while it runs."""
    return f"{PREFIX}:progress:{request_id}"


def failure_key(request_id: str) -> str:
    """Redis hash of a request's failed runs that were handed back for a retry (`count`) and the last one's cause
    (`cause`): what a dead-lettered answer says, and what bounds a batch line's runs."""
    return f"{PREFIX}:failure:{request_id}"


def cancel_key(request_id: str) -> str:
    """Redis key whose presence tells workers a request was cancelled: it is skipped or stopped."""
    return f"{PREFIX}:cancel:{request_id}"


def inflight_key(request_id: str) -> str:
    """Redis hash keeping a request's message from publish to deadline, so a watchdog can publish it again."""
    return f"{PREFIX}:inflight:{request_id}"


def holder_key(request_id: str) -> str:
    """Redis key naming the worker that holds a request; it lapses a few seconds after that worker's last heartbeat."""
    return f"{PREFIX}:holder:{request_id}"


def inflight_row_key(request_id: str) -> str:
    """Redis key keeping a published sync request's partial log row until its API process writes it, or, if that
    process died, until another one adopts and writes it."""
    return f"{PREFIX}:inflight-row:{request_id}"


def api_liveness_key(instance_id: str) -> str:
    """Redis key that exists while the API process `instance_id` is alive (it lapses seconds after its death)."""
    return f"{PREFIX}:api:live:{instance_id}"


# Redis sorted sets the watchdog scans: requests in flight by deadline (epoch ms), held ones by lease expiry.
INFLIGHT_DEADLINES_KEY = f"{PREFIX}:inflight:deadlines"
INFLIGHT_HELD_KEY = f"{PREFIX}:inflight:held"
# Redis sorted set of the published requests no worker has taken since their last publish, scored by when the
# watchdog publishes them again if still untaken (epoch ms): a copy lost with a dead worker's pull comes back.
INFLIGHT_UNCLAIMED_KEY = f"{PREFIX}:inflight:unclaimed"
# Redis sorted set of the published sync requests whose log row is not written yet, by deadline (epoch ms).
INFLIGHT_UNLOGGED_KEY = f"{PREFIX}:inflight:unlogged"


# Redis sorted sets per request topic (its short name): the workers pulling it by last beat, and by when their
# latest empty pull began (epoch ms): how the watchdog tells a request queued behind busy workers from a lost one.
def pullers_key(topic: str) -> str:
    return f"{PREFIX}:pullers:{topic}"


def empty_pulls_key(topic: str) -> str:
    return f"{PREFIX}:pullers:{topic}:empty"


# Redis sorted sets for admission by predicted wait (api_server/predict/admission.py): a model's published
# requests by priority, by deadline (epoch ms), kept with each request (`keep`); its answered ones by when the
# API saw them answered (the completion rate); its recent call time per request (ms, smoothed), that time's spread
# and the answer's trip back; and the most workers seen holding its requests at once lately (its capacity).
def backlog_key(queue: str, priority: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:{priority}"


def reservations_key(queue: str, priority: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:{priority}:reserved"


def answered_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:answered"


def run_time_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:run_ms"


def run_spread_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:run_spread_ms"


def answer_trip_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:trip_ms"


# Redis: the workers ready to serve a model's queue, by when their word lapses (epoch ms on Redis's clock), and the
# requests each runs at once (contract/stores/ready_workers.py; admission's capacity).
def ready_workers_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:ready"


def ready_batches_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:ready_batches"


def peak_workers_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:peak_workers"


def last_workers_key(queue: str) -> str:
    return f"{PREFIX}:backlog:{{{queue}}}:last_workers"


# Redis lease naming the one worker whose watchdog runs at a time.
WATCHDOG_LEADER_KEY = f"{PREFIX}:watchdog:leader"


# Redis: a model's split set at run time (JSON), and the channel announcing a change to every API process.
def traffic_key(model: str) -> str:
    return f"{PREFIX}:traffic:{model}"


TRAFFIC_KEYS_PATTERN = f"{PREFIX}:traffic:*"
# Redis lease naming the one API process whose rollback guard runs at a time.
ROLLBACK_LEADER_KEY = f"{PREFIX}:rollback:leader"
AUDIT_TABLE = "rollout_audit"
