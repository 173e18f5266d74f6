"""Google Cloud clients, pointed at the emulators when their environment variables are set.

Create them after gunicorn forks: gRPC channels are not fork-safe.
"""

from __future__ import annotations

import os

import requests
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery, pubsub_v1, storage

from contract.settings import Settings

# The publisher batches for up to 10 ms by default; requests and replies are latency-bound.
LOW_LATENCY_BATCH = pubsub_v1.types.BatchSettings(max_messages=100, max_latency=0.001)


def publisher_client() -> pubsub_v1.PublisherClient:
    return pubsub_v1.PublisherClient(batch_settings=LOW_LATENCY_BATCH)


def subscriber_client() -> pubsub_v1.SubscriberClient:
    return pubsub_v1.SubscriberClient()


def storage_client(settings: Settings, connections: int = 10) -> storage.Client:
    """`connections`: the threads that use the client at once. Its HTTP session keeps that many connections per
    host (requests' default is 10: more threads than that each open and discard one, with a urllib3 "Connection pool
    is full" warning every time)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        client = storage.Client(project=settings.project_id, credentials=AnonymousCredentials())
    else:
        client = storage.Client(project=settings.project_id)
    adapter = requests.adapters.HTTPAdapter(pool_connections=connections, pool_maxsize=connections)
    for scheme in ("https://", "http://"):
        client._http.mount(scheme, adapter)  # the session the client makes for itself (credentials included)
    return client


def bigquery_client(settings: Settings) -> bigquery.Client:
    if settings.bigquery_endpoint:
        return bigquery.Client(
            project=settings.project_id,
            credentials=AnonymousCredentials(),
            client_options=ClientOptions(api_endpoint=settings.bigquery_endpoint),
        )
    return bigquery.Client(project=settings.project_id)
