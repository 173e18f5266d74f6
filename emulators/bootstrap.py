"""Creates, idempotently, every resource the catalog implies in the emulators: what Terraform does in production."""

from __future__ import annotations

import logging
from pathlib import Path
from string import Template

from google.api_core import exceptions
from google.cloud import bigquery, pubsub_v1

from contract import clients, naming
from contract.catalog import ModelCatalog
from contract.log_schema import CLUSTERING_FIELDS, PARTITION_FIELD, bigquery_schema
from contract.settings import Settings

log = logging.getLogger(__name__)
ANALYTICS_SQL_DIR = Path(__file__).resolve().parent.parent / "infra" / "sql"


def bootstrap(settings: Settings, catalog: ModelCatalog) -> None:
    bootstrap_pubsub(settings, catalog)
    bootstrap_storage(settings)
    bootstrap_bigquery(settings)


def bootstrap_pubsub(settings: Settings, catalog: ModelCatalog) -> None:
    project = settings.project_id
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    with subscriber:
        ensure_topic(publisher, publisher.topic_path(project, naming.REPLIES_TOPIC))
        for spec in catalog.models.values():
            dead_letter = publisher.topic_path(project, naming.dead_letter_topic(spec.name))
            ensure_topic(publisher, dead_letter)
            ensure_subscription(
                subscriber,
                {
                    "name": subscriber.subscription_path(project, naming.dead_letter_subscription(spec.name)),
                    "topic": dead_letter,
                    "ack_deadline_seconds": 60,
                },
            )
            for priority in naming.PRIORITIES:
                topic = publisher.topic_path(project, naming.request_topic(spec.name, priority))
                ensure_topic(publisher, topic)
                ensure_subscription(
                    subscriber,
                    {
                        "name": subscriber.subscription_path(project, naming.worker_subscription(spec.name, priority)),
                        "topic": topic,
                        "ack_deadline_seconds": spec.ack_deadline_seconds,
                        "dead_letter_policy": {
                            "dead_letter_topic": dead_letter,
                            "max_delivery_attempts": spec.max_delivery_attempts,
                        },
                        "retry_policy": {"minimum_backoff": {"seconds": 1}, "maximum_backoff": {"seconds": 60}},
                    },
                )


def ensure_topic(publisher: pubsub_v1.PublisherClient, topic: str) -> None:
    try:
        publisher.create_topic(request={"name": topic})
        log.info("created topic %s", topic)
    except exceptions.AlreadyExists:
        pass


def ensure_subscription(subscriber: pubsub_v1.SubscriberClient, request: dict) -> None:
    try:
        subscriber.create_subscription(request=request)
        log.info("created subscription %s", request["name"])
    except exceptions.AlreadyExists:
        pass


def bootstrap_storage(settings: Settings) -> None:
    client = clients.storage_client(settings)
    for name in (settings.model_bucket, settings.payload_bucket):
        try:
            client.create_bucket(name)
            log.info("created bucket %s", name)
        except exceptions.Conflict:
            pass


def bootstrap_bigquery(settings: Settings) -> None:
    client = clients.bigquery_client(settings)
    dataset = bigquery.Dataset(f"{settings.project_id}.{settings.dataset}")
    client.create_dataset(dataset, exists_ok=True)
    table = bigquery.Table(f"{settings.project_id}.{settings.dataset}.{settings.log_table}", schema=bigquery_schema())
    table.time_partitioning = bigquery.TimePartitioning(field=PARTITION_FIELD)
    table.clustering_fields = CLUSTERING_FIELDS
    client.create_table(table, exists_ok=True)
    for path in sorted(ANALYTICS_SQL_DIR.glob("*.sql")):
        # The same files and template variables Terraform's templatefile() uses.
        query = Template(path.read_text()).substitute(project_id=settings.project_id, dataset=settings.dataset)
        view = bigquery.Table(f"{settings.project_id}.{settings.dataset}.{path.stem}")
        view.view_query = query
        client.create_table(view, exists_ok=True)
