"""Creates, idempotently, every resource the catalog implies in the emulators: what Terraform does in production."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from string import Template

from google.api_core import exceptions
from google.cloud import bigquery, pubsub_v1

from contract import google_clients, naming
from contract.catalog import ModelCatalog
from contract.log_schema import CLUSTERING_FIELDS, PARTITION_FIELD, audit_bigquery_schema, bigquery_schema
from contract.settings import Settings

log = logging.getLogger(__name__)
ANALYTICS_SQL_DIR = Path(__file__).resolve().parent.parent / "infra" / "sql"


def bootstrap(settings: Settings, catalog: ModelCatalog) -> list[str]:
    """Creates whatever is missing; returns the names of what it created (empty when all was there)."""
    return [*bootstrap_pubsub(settings, catalog), *bootstrap_storage(settings), *bootstrap_bigquery(settings)]


def bootstrap_pubsub(settings: Settings, catalog: ModelCatalog) -> list[str]:
    project = settings.project_id
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    created: list[str] = []

    def topic(name: str) -> None:
        if ensure_topic(publisher, name):
            created.append(name)

    def subscription(request: dict) -> None:
        if ensure_subscription(subscriber, request):
            created.append(request["name"])

    with subscriber:
        topic(publisher.topic_path(project, naming.REPLIES_TOPIC))
        batch_replies = publisher.topic_path(project, naming.BATCH_REPLIES_TOPIC)
        topic(batch_replies)
        subscription(
            {
                "name": subscriber.subscription_path(project, naming.BATCH_REPLIES_SUBSCRIPTION),
                "topic": batch_replies,
                "ack_deadline_seconds": 30,
            }
        )
        for spec in catalog.units():
            dead_letter = publisher.topic_path(project, naming.dead_letter_topic(spec.queue))
            topic(dead_letter)
            subscription(
                {
                    "name": subscriber.subscription_path(project, naming.dead_letter_subscription(spec.queue)),
                    "topic": dead_letter,
                    "ack_deadline_seconds": 60,
                },
            )
            for priority in naming.PRIORITIES:
                request_topic = publisher.topic_path(project, naming.request_topic(spec.queue, priority))
                topic(request_topic)
                subscription(
                    {
                        "name": subscriber.subscription_path(project, naming.worker_subscription(spec.queue, priority)),
                        "topic": request_topic,
                        "ack_deadline_seconds": spec.ack_deadline_seconds,
                        "dead_letter_policy": {
                            "dead_letter_topic": dead_letter,
                            "max_delivery_attempts": spec.max_delivery_attempts,
                        },
                        "retry_policy": {"minimum_backoff": {"seconds": 1}, "maximum_backoff": {"seconds": 60}},
                    },
                )

    return created


def ensure_topic(publisher: pubsub_v1.PublisherClient, topic: str) -> bool:
    """Creates the topic unless it exists; True when it was created."""
    try:
        publisher.create_topic(request={"name": topic})
    except exceptions.AlreadyExists:
        return False
    log.info("created topic %s", topic)
    return True


def ensure_subscription(subscriber: pubsub_v1.SubscriberClient, request: dict) -> bool:
    """Creates the subscription unless it exists; True when it was created."""
    try:
        subscriber.create_subscription(request=request)
    except exceptions.AlreadyExists:
        return False
    log.info("created subscription %s", request["name"])
    return True


def bootstrap_storage(settings: Settings) -> list[str]:
    client = google_clients.storage_client(settings)
    created = []
    # The local stack's batch inputs bucket: each key uploads under its own prefix (MAAS_BATCH_INPUTS's default).
    for name in (settings.model_bucket, settings.payload_bucket, naming.batch_input_bucket(settings.project_id)):
        try:
            client.create_bucket(name)
        except exceptions.Conflict:
            continue
        log.info("created bucket %s", name)
        created.append(f"gs://{name}")
    return created


def bootstrap_bigquery(settings: Settings) -> list[str]:
    client = google_clients.bigquery_client(settings)
    created = []

    def ensure(table: bigquery.Table | bigquery.Dataset, create: Callable) -> None:
        name = f"{table.project}.{table.dataset_id}" + (f".{table.table_id}" if hasattr(table, "table_id") else "")
        try:
            create(table)
        except exceptions.Conflict:
            return
        log.info("created %s", name)
        created.append(name)

    ensure(bigquery.Dataset(f"{settings.project_id}.{settings.dataset}"), client.create_dataset)
    # The local stack's batch input tables: each key's named `{key_id}_...` (MAAS_BATCH_INPUTS's default).
    ensure(bigquery.Dataset(f"{settings.project_id}.{naming.BATCH_INPUT_DATASET}"), client.create_dataset)
    table = bigquery.Table(f"{settings.project_id}.{settings.dataset}.{settings.log_table}", schema=bigquery_schema())
    table.time_partitioning = bigquery.TimePartitioning(field=PARTITION_FIELD)
    table.clustering_fields = CLUSTERING_FIELDS
    ensure(table, client.create_table)
    _add_new_columns(client, table.reference)
    audit = bigquery.Table(
        f"{settings.project_id}.{settings.dataset}.{settings.audit_table}", schema=audit_bigquery_schema()
    )
    ensure(audit, client.create_table)
    # The base views (infra/sql/base) first: the analytics views read them.
    for path in [*sorted((ANALYTICS_SQL_DIR / "base").glob("*.sql")), *sorted(ANALYTICS_SQL_DIR.glob("*.sql"))]:
        # The same files and template variables Terraform's templatefile() uses.
        query = Template(path.read_text()).substitute(project_id=settings.project_id, dataset=settings.dataset)
        view = bigquery.Table(f"{settings.project_id}.{settings.dataset}.{path.stem}")
        view.view_query = query
        ensure(view, client.create_table)
        # A view kept from an earlier run (the emulator keeps its data) follows the file as it is now.
        existing = client.get_table(view.reference)
        if existing.view_query != query:
            existing.view_query = query
            client.update_table(existing, ["view_query"])
            log.info("updated view %s", path.stem)
    return created


def _add_new_columns(client: bigquery.Client, reference) -> None:
    """A table kept from an earlier run (the emulator keeps its data) gets the columns added since (NULLABLE)."""
    existing = client.get_table(reference)
    have = {field.name for field in existing.schema}
    added = [field for field in bigquery_schema() if field.name not in have]
    if added:
        existing.schema = [*existing.schema, *added]
        client.update_table(existing, ["schema"])
        log.info("added columns %s to %s", [field.name for field in added], reference.table_id)
