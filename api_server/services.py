"""The API process's long-lived collaborators, built once per gunicorn worker (after fork)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis
from google.cloud import pubsub_v1
from redis.backoff import NoBackoff
from redis.retry import Retry

from api_server.auth import ApiKeyAuth
from api_server.bigquery_write import StorageWriteSink, write_client
from api_server.dispatch import InferenceDispatcher
from api_server.inference_log import InferenceLogWriter
from api_server.log_spool import LogSpool
from api_server.reply_waiter import PerInstanceReplyWaiter, PerRequestReplyWaiter, ReplyWaiter
from contract import clients
from contract.catalog import ModelCatalog
from contract.inflight import InflightStore, RequestKeeper
from contract.payloads import PayloadCodec
from contract.results import ResultStore
from contract.settings import Settings


@dataclass
class Services:
    settings: Settings
    catalog: ModelCatalog
    auth: ApiKeyAuth
    publisher: pubsub_v1.PublisherClient
    waiter: ReplyWaiter
    dispatcher: InferenceDispatcher
    payloads: PayloadCodec
    redis: redis.Redis
    inference_log: InferenceLogWriter

    def close(self) -> None:
        self.waiter.close()
        self.inference_log.close()
        self.publisher.stop()


def api_redis_client(url: str) -> redis.Redis:
    """One immediate retry (a connection gone stale across a Redis restart), no backoff: redis-py's default
    retries for ~3 s, which every request would pay while Redis is down."""
    return redis.Redis.from_url(
        url, socket_timeout=5, socket_connect_timeout=2, retry=Retry(NoBackoff(), 1), health_check_interval=30
    )


def build_services(settings: Settings) -> Services:
    redis_client = api_redis_client(settings.redis_url)
    results = ResultStore(redis_client, settings.result_ttl_seconds)
    subscriber = clients.subscriber_client()
    if settings.reply_mode == "per-instance":
        waiter: ReplyWaiter = PerInstanceReplyWaiter(subscriber, settings.project_id, settings.instance_id, results)
    else:
        waiter = PerRequestReplyWaiter(subscriber, settings.project_id, results)
    publisher = clients.publisher_client()
    # Every published request is kept in Redis until its deadline: the workers' watchdog re-dispatches it.
    keeper = RequestKeeper(InflightStore(redis_client), settings.redis_retry_seconds)
    return Services(
        settings=settings,
        catalog=settings.catalog(),
        auth=ApiKeyAuth.from_settings(settings),
        publisher=publisher,
        waiter=waiter,
        dispatcher=InferenceDispatcher(publisher, waiter, settings.project_id, keeper),
        payloads=PayloadCodec(clients.storage_client(settings), settings.payload_bucket, settings.inline_payload_limit),
        redis=redis_client,
        inference_log=build_inference_log(settings),
    )


def build_inference_log(settings: Settings) -> InferenceLogWriter:
    table = f"projects/{settings.project_id}/datasets/{settings.dataset}/tables/{settings.log_table}"
    sink = StorageWriteSink(write_client(settings), table, query_client=clients.bigquery_client(settings))
    return InferenceLogWriter(sink, LogSpool(Path(settings.log_spool_dir), settings.log_spool_max_bytes))
