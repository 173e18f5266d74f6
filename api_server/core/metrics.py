"""Prometheus metrics of the API process.

Per process by default (the local stack runs one gunicorn worker). With several gunicorn workers, set
PROMETHEUS_MULTIPROC_DIR to an empty directory before gunicorn starts: prometheus-client then keeps the
values in shared files and `/metrics` aggregates every worker's (multiprocess mode).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

REQUESTS = Counter(
    "maas_api_requests_total", "HTTP requests by route, method and status", ["route", "method", "status"]
)
LATENCY = Histogram(
    "maas_api_request_seconds",
    "HTTP request latency by route",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
CACHE = Counter("maas_api_cache_total", "Result cache lookups by result", ["result"])
COALESCED = Counter("maas_api_coalesced_total", "Requests answered by another identical request's inference")
IDEMPOTENT_REPLAYS = Counter("maas_api_idempotent_replays_total", "Requests answered from an Idempotency-Key record")
JOBS = Counter(
    "maas_api_jobs_total",
    "Job events: submitted, converted (sync request turned job), cached (answered from the cache), cancelled",
    ["event"],
)
PUBLISHES = Counter(
    "maas_api_publishes_total",
    "Request messages the API published, by the unit whose topic took them (a flow's: its first stage's, once)",
    ["queue"],
)
FALLBACKS = Counter(
    "maas_api_fallbacks_total",
    "Requests a canary version failed with a model error that were sent on to the stable version",
    ["model", "version"],
)
SHADOW_COPIES = Counter(
    "maas_api_shadow_copies_total",
    "Copies of callers' requests for a shadow version: sent, or dropped (too many in flight)",
    ["model", "result"],
)
JOB_STATES = Counter("maas_api_job_reads_total", "Job reads by the state they reported", ["state"])
INFLIGHT_WAITS = Gauge(
    "maas_api_inflight_waits", "Requests waiting for a worker's reply or another request", multiprocess_mode="livesum"
)
LIMIT_DECISIONS = Counter(
    "maas_api_limit_decisions_total",
    "Rate and concurrency limit decisions: admitted, rate_limited, concurrency_limited, unenforced (Redis down)",
    ["decision"],
)
ADMISSION = Counter(
    "maas_api_admission_decisions_total",
    "Admission by predicted wait, per model: admitted, refused (503 at once), fallback (answered by the model's "
    "fallback), unknown (no estimate yet: admitted)",
    ["model", "decision"],
)
PREDICTED_START = Gauge(
    "maas_api_predicted_start_seconds",
    "The last predicted wait before a request of this model and priority would start (admission's estimate)",
    ["model", "priority"],
    multiprocess_mode="livemax",
)
REDIS_UP = Gauge("maas_api_redis_up", "1 while Redis answers, 0 after a failure", multiprocess_mode="livemin")
REDIS_UP.set(1)


def exposition() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
