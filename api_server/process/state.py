"""The API process's one app-state object: every long-lived collaborator, built once per gunicorn worker (after
fork), reached through `app_state()`, and stopped, every thread it started included, by `close()`."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis
from flask import Flask, current_app
from google.cloud import pubsub_v1

from api_server.batches.inputs import BatchInputPolicy
from api_server.batches.runner import IO_THREADS as BATCH_IO_THREADS
from api_server.batches.runner import BatchRunner
from api_server.batches.service import BatchService
from api_server.batches.store import BatchStore
from api_server.core.auth import ApiKeyAuth
from api_server.core.redis_state import RedisState, api_redis_client
from api_server.flows.serving import FlowService
from api_server.inference_log.bigquery_write import StorageWriteSink, write_client
from api_server.inference_log.job_rows import JobLogFinisher
from api_server.inference_log.records import RequestRecords
from api_server.inference_log.spool import LogSpool
from api_server.inference_log.writer import InferenceLogWriter
from api_server.jobs.janitor import JanitorTask, build_janitor_task, delete_orphaned_subscription
from api_server.jobs.service import JobStore
from api_server.jobs.webhooks import WebhookNotifier, WebhookTargetPolicy
from api_server.predict.adapters import AdapterService
from api_server.predict.admission import AdmissionControl, AdmissionLedger
from api_server.predict.controls import ControlService
from api_server.predict.dispatch import InferenceDispatcher
from api_server.predict.flights import SharedFlights
from api_server.predict.inference import InferenceService
from api_server.predict.limits import KeyLimits, RequestLimiter
from api_server.predict.reply_waiter import PerInstanceReplyWaiter, PerRequestReplyWaiter, ReplyWaiter
from api_server.predict.result_links import ResultLinks
from api_server.predict.serving import ServingStage
from api_server.versions.rollouts import AuditLog, RollbackGuard, RolloutObservations, Rollouts
from api_server.versions.shadow import ShadowTraffic
from api_server.versions.traffic import TrafficSplits
from contract import google_clients
from contract.catalog import ModelCatalog
from contract.memory_plan import control_budget
from contract.payloads import PayloadCodec
from contract.settings import Settings
from contract.stores.adapter_registry import AdapterRegistry
from contract.stores.control_registry import ControlRegistry
from contract.stores.inflight import InflightStore, ProcessLiveness, RequestKeeper
from contract.stores.results import ResultStore

log = logging.getLogger(__name__)
EXTENSION = "maas"
# How long a signed URL of an answered image stays valid (OpenAI's image URLs: an hour).
RESULT_LINK_SECONDS = 3600


@dataclass
class AppState:
    settings: Settings
    catalog: ModelCatalog
    auth: ApiKeyAuth
    redis: redis.Redis
    redis_state: RedisState
    publisher: pubsub_v1.PublisherClient
    subscriber: pubsub_v1.SubscriberClient
    waiter: ReplyWaiter
    results: ResultStore
    jobs: JobStore
    inference: InferenceService
    inference_log: InferenceLogWriter
    # The cache's flights run on MAAS_CACHE_REDIS_URL when set (an instance of its own with allkeys-lru).
    cache_flights: SharedFlights
    flights: SharedFlights
    limiter: RequestLimiter
    serving: ServingStage
    records: RequestRecords
    job_log: JobLogFinisher
    webhooks: WebhookNotifier | None
    janitor: JanitorTask | None
    rollouts: Rollouts
    rollback_guard: RollbackGuard
    shadow: ShadowTraffic
    liveness: ProcessLiveness
    batches: BatchService
    batch_runner: BatchRunner | None = None
    cache_redis: redis.Redis | None = None
    adapters: AdapterService | None = None
    controls: ControlService | None = None
    # The catalog's flows, called like models (api_server/flows/serving.py); built with `serving`, which picks each
    # stage's unit. None only for a state built by hand without it (tests): no flow is served then.
    flows: FlowService | None = None
    # Admission by predicted wait (api_server/predict/admission.py): also what GET /v1/status reads.
    admission: AdmissionControl | None = None
    # Signed URLs of answered images (the OpenAI Images API's `response_format: url`).
    result_links: ResultLinks | None = None
    # Built on first use by the routes that need them (readiness probe, OpenAPI document).
    lazy: dict = field(default_factory=dict)

    def start(self) -> None:
        """The background threads: liveness, job and orphan log rows, webhooks, the reply-subscription janitor."""
        self.liveness.start()
        self.job_log.start()
        if self.webhooks is not None:
            self.webhooks.start()
        if self.janitor is not None:
            self.janitor.start()
        self.rollouts.splits.start()
        self.rollback_guard.start()
        if self.batch_runner is not None:
            self.batch_runner.start()

    def close(self) -> None:
        """SIGTERM (gunicorn's worker_exit) and tests: stop every thread, flush the log rows, close the clients."""
        if self.batch_runner is not None:
            self.batch_runner.stop()  # first: its last parts' rows go to the log before it closes
        self.job_log.stop()
        if self.webhooks is not None:
            self.webhooks.stop()
        if self.janitor is not None:
            self.janitor.stop()
        self.rollback_guard.stop()
        self.rollouts.splits.stop()
        self.shadow.close()
        self.waiter.close()
        self.inference_log.close()
        self.liveness.stop()  # after the last row: nothing of this process is left for another to adopt
        self.publisher.stop()
        self.subscriber.close()
        for client in (self.redis, self.cache_redis):
            if client is not None:
                with contextlib.suppress(redis.RedisError):
                    client.close()


def app_state(app: Flask | None = None) -> AppState:
    """The app's state: the current app's inside a request, or that of `app`."""
    return (app or current_app).extensions[EXTENSION]


def install(app: Flask, state: AppState) -> None:
    app.extensions[EXTENSION] = state


def build_app_state(settings: Settings) -> AppState:
    pool = (settings.redis_max_connections, settings.redis_pool_timeout_seconds)
    redis_client = api_redis_client(settings.redis_url, *pool)
    redis_state = RedisState(redis_client, settings.redis_retry_seconds)
    cache_redis, cache_state = None, redis_state
    if settings.cache_redis_url:
        cache_redis = api_redis_client(settings.cache_redis_url, *pool)
        cache_state = RedisState(cache_redis, settings.redis_retry_seconds)
    results = ResultStore(redis_client, settings.result_ttl_seconds)
    subscriber = google_clients.subscriber_client()
    if settings.reply_mode == "per-instance":
        waiter: ReplyWaiter = PerInstanceReplyWaiter(subscriber, settings.project_id, settings.instance_id, results)
    else:
        waiter = PerRequestReplyWaiter(subscriber, settings.project_id, results)
    publisher = google_clients.publisher_client()
    catalog = settings.catalog()
    # Request threads (gunicorn's `threads`, MAAS_API_THREADS: api_server/process/gunicorn_conf.py) and the batch
    # runner's I/O pool and thread share it: a connection each.
    api_threads = int(os.environ.get("MAAS_API_THREADS", "32"))
    storage = google_clients.storage_client(settings, connections=api_threads + BATCH_IO_THREADS + 1)
    payloads = PayloadCodec(storage, settings.payload_bucket, settings.inline_payload_limit)
    adapters = AdapterService(AdapterRegistry(storage.bucket(settings.model_bucket)))
    plans = catalog.deployment_plans()
    controls = ControlService(ControlRegistry(storage.bucket(settings.model_bucket)),
                              lambda spec: control_budget(plans[spec.deployment], spec))  # fmt: skip
    targets = WebhookTargetPolicy(bool(settings.webhook_signing_secret), settings.webhook_allow_loopback)
    inflight = InflightStore(redis_client)
    inference = InferenceService(
        # Every published request is kept in Redis until its deadline: the workers' watchdog re-dispatches it.
        InferenceDispatcher(
            publisher,
            waiter,
            settings.project_id,
            RequestKeeper(inflight, settings.redis_retry_seconds),
            settings.publish_timeout_seconds,
        ),
        payloads,
        settings.job_deadline_seconds,
        settings.high_priority_key_sha256,
        targets,
        adapters,
        controls,
    )
    jobs = JobStore(redis_client, results, settings.result_ttl_seconds)
    inference_log = build_inference_log(settings)
    # Leases name this process, so a waiter can take over a dead one's; liveness keys live in the main Redis only.
    flights = SharedFlights(redis_state, settings.instance_id)
    cache_flights = SharedFlights(cache_state, "" if settings.cache_redis_url else settings.instance_id)
    limiter = RequestLimiter(
        redis_state, KeyLimits(settings.rate_limit_per_minute, settings.concurrency_limit), settings.key_limits
    )
    webhooks = None
    if settings.webhook_signing_secret:  # a process that cannot sign must not claim deliveries
        webhooks = WebhookNotifier(
            jobs,
            inference.predictions,
            targets,
            settings.webhook_signing_secret,
            attempts=settings.webhook_attempts,
            ca_file=settings.webhook_ca_file,
        )
    bigquery = google_clients.bigquery_client(settings)
    rollouts = Rollouts(
        catalog,
        TrafficSplits(catalog, redis_client, settings.traffic_refresh_seconds),
        RolloutObservations(catalog, redis_client),
        AuditLog(bigquery, f"{settings.project_id}.{settings.dataset}.{settings.audit_table}", settings.instance_id),
    )
    shadow = ShadowTraffic(inference, inference_log, settings.instance_id, waiter.mode)
    admission = AdmissionControl(AdmissionLedger(redis_client, settings.admission_window_seconds), redis_state)
    serving = ServingStage(
        settings, catalog, inference, jobs, results, redis_state, flights, cache_flights, limiter, rollouts, shadow,
        inflight, admission,
    )  # fmt: skip
    flows = FlowService(catalog, serving.model)
    batch_store = BatchStore(redis_client, storage.bucket(settings.payload_bucket))
    inputs = BatchInputPolicy(
        storage, settings.batch_inputs, {settings.model_bucket, settings.payload_bucket}, bigquery,
        {f"{settings.project_id}.{settings.dataset}"},
    )  # fmt: skip
    batch_runner = None
    if settings.batch_runner:
        batch_runner = BatchRunner(
            settings, batch_store, serving, inference, payloads, results, redis_client, inference_log, catalog,
            storage, webhooks, subscriber, flows, bigquery, inputs,
        )  # fmt: skip
    batches = BatchService(
        batch_store, redis_state, inputs, targets, settings.batch_inline_max_lines, batch_runner,
        max_active_per_key=settings.batch_max_active_per_key,
    )  # fmt: skip
    return AppState(
        settings=settings,
        catalog=catalog,
        auth=ApiKeyAuth.from_settings(settings),
        redis=redis_client,
        redis_state=redis_state,
        publisher=publisher,
        subscriber=subscriber,
        waiter=waiter,
        results=results,
        jobs=jobs,
        inference=inference,
        inference_log=inference_log,
        cache_flights=cache_flights,
        flights=flights,
        limiter=limiter,
        serving=serving,
        admission=admission,
        flows=flows,
        batches=batches,
        batch_runner=batch_runner,
        records=RequestRecords(
            inference_log,
            jobs,
            redis_state,
            settings.instance_id,
            waiter.mode,
            rollouts.observations,
            inflight,
            catalog,
        ),
        job_log=JobLogFinisher(
            jobs,
            inference_log,
            observations=rollouts.observations,
            catalog=catalog,
            inference=inference,
            inflight=inflight,
            results=results,
            forget_reply_subscription=partial(delete_orphaned_subscription, subscriber, settings.project_id),
        ),
        liveness=ProcessLiveness(inflight, settings.instance_id),
        webhooks=webhooks,
        janitor=build_janitor_task(settings, catalog, redis_client),
        rollouts=rollouts,
        shadow=shadow,
        rollback_guard=RollbackGuard(rollouts, redis_client, settings.rollback_check_seconds, settings.instance_id),
        cache_redis=cache_redis,
        adapters=adapters,
        controls=controls,
        result_links=ResultLinks(storage, settings.payload_bucket, RESULT_LINK_SECONDS),
    )


def build_inference_log(settings: Settings) -> InferenceLogWriter:
    table = f"projects/{settings.project_id}/datasets/{settings.dataset}/tables/{settings.log_table}"
    sink = StorageWriteSink(write_client(settings), table, query_client=google_clients.bigquery_client(settings))
    return InferenceLogWriter(sink, LogSpool(Path(settings.log_spool_dir), settings.log_spool_max_bytes))
