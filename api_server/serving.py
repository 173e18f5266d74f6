"""What the predict and job routes build on, beside `Services`: the inference service, the shared flights
(cache, coalescing, idempotency) and the job store, each over Redis that may be down."""

from __future__ import annotations

from dataclasses import dataclass

from api_server.flights import SharedFlights
from api_server.inference import InferenceService
from api_server.janitor import JanitorTask, build_janitor_task
from api_server.job_log import JobLogFinisher
from api_server.jobs import JobStore
from api_server.limits import KeyLimits, RequestLimiter
from api_server.redis_state import RedisState
from api_server.services import api_redis_client
from api_server.webhooks import WebhookNotifier, WebhookTargetPolicy
from contract.results import ResultStore
from contract.settings import Settings


@dataclass
class Serving:
    settings: Settings
    inference: InferenceService
    redis: RedisState
    # The cache's flights run on MAAS_CACHE_REDIS_URL when set (an instance of its own with allkeys-lru).
    cache_flights: SharedFlights
    flights: SharedFlights
    jobs: JobStore
    results: ResultStore
    job_log: JobLogFinisher
    limiter: RequestLimiter
    webhooks: WebhookNotifier
    janitor: JanitorTask | None = None


def build_serving(settings: Settings, services) -> Serving:
    state = RedisState(services.redis, settings.redis_retry_seconds)
    cache_state = state
    if settings.cache_redis_url:
        cache_state = RedisState(api_redis_client(settings.cache_redis_url), settings.redis_retry_seconds)
    results = ResultStore(services.redis, settings.result_ttl_seconds)
    jobs = JobStore(services.redis, results, settings.result_ttl_seconds)
    job_log = JobLogFinisher(jobs, services.inference_log)
    job_log.start()
    targets = WebhookTargetPolicy(bool(settings.webhook_signing_secret), settings.webhook_allow_loopback)
    inference = InferenceService(
        services.dispatcher,
        services.payloads,
        settings.job_deadline_seconds,
        settings.high_priority_key_sha256,
        targets,
    )
    webhooks = WebhookNotifier(
        jobs,
        inference.predictions,
        targets,
        settings.webhook_signing_secret,
        attempts=settings.webhook_attempts,
        ca_file=settings.webhook_ca_file,
    )
    if settings.webhook_signing_secret:  # a process that cannot sign must not claim deliveries
        webhooks.start()
    janitor = build_janitor_task(settings, services.catalog, services.redis)
    if janitor is not None:
        janitor.start()
    return Serving(
        settings=settings,
        inference=inference,
        redis=state,
        cache_flights=SharedFlights(cache_state),
        flights=SharedFlights(state),
        jobs=jobs,
        results=results,
        job_log=job_log,
        webhooks=webhooks,
        janitor=janitor,
        limiter=RequestLimiter(
            state, KeyLimits(settings.rate_limit_per_minute, settings.concurrency_limit), settings.key_limits
        ),
    )
