"""Each stand-in is the real emulator, reached through the official client libraries."""

from __future__ import annotations

import uuid

import pytest
import redis
from google.api_core import exceptions

from contract import google_clients, naming

pytestmark = pytest.mark.stack


def test_pubsub_publish_and_pull(stack, settings):
    publisher, subscriber = google_clients.publisher_client(), google_clients.subscriber_client()
    suffix = uuid.uuid4().hex[:8]
    topic = publisher.topic_path(settings.project_id, f"emulator-check-{suffix}")
    subscription = subscriber.subscription_path(settings.project_id, f"emulator-check-{suffix}")
    publisher.create_topic(request={"name": topic})
    subscriber.create_subscription(request={"name": subscription, "topic": topic})
    try:
        publisher.publish(topic, b"hello", kind="check").result(timeout=10)
        response = subscriber.pull(request={"subscription": subscription, "max_messages": 1}, timeout=10)
        [received] = response.received_messages
        assert received.message.data == b"hello"
        assert received.message.attributes["kind"] == "check"
        subscriber.acknowledge(request={"subscription": subscription, "ack_ids": [received.ack_id]})
    finally:
        subscriber.delete_subscription(request={"subscription": subscription})
        publisher.delete_topic(request={"topic": topic})


def test_gcs_upload_download_and_generation_preconditions(stack, settings):
    bucket = google_clients.storage_client(settings).bucket(settings.payload_bucket)
    blob = bucket.blob(f"emulator-check/{uuid.uuid4().hex}")
    blob.upload_from_string(b"payload bytes", if_generation_match=0)
    assert bucket.blob(blob.name).download_as_bytes() == b"payload bytes"
    # fake-gcs-server enforces preconditions like GCS: a second create-only write is refused.
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob(blob.name).upload_from_string(b"other", if_generation_match=0)


def test_bigquery_insert_and_query(stack, settings, bigquery):
    table = f"{settings.project_id}.{settings.dataset}.emulator_check_{uuid.uuid4().hex[:8]}"
    from google.cloud import bigquery as bq

    bigquery.create_table(bq.Table(table, schema=[bq.SchemaField("name", "STRING"), bq.SchemaField("n", "INTEGER")]))
    assert bigquery.insert_rows_json(table, [{"name": "a", "n": 2}, {"name": "b", "n": 5}]) == []
    [row] = list(bigquery.query(f"SELECT SUM(n) AS total, COUNT(*) AS count FROM `{table}`").result())
    assert (row["total"], row["count"]) == (7, 2)
    bigquery.delete_table(table)


def test_redis_set_and_get(stack, settings):
    client = redis.Redis.from_url(settings.redis_url)
    key = f"emulator-check:{uuid.uuid4().hex}"
    client.set(key, b"value", ex=30)
    assert client.get(key) == b"value"
    assert 0 < client.ttl(key) <= 30


def test_bootstrap_is_idempotent_and_follows_the_catalog(stack, settings):
    from contract.catalog import load_catalog
    from emulators.bootstrap import bootstrap

    catalog = load_catalog()
    bootstrap(settings, catalog)  # the stack already ran it once: a second run changes nothing and raises nothing
    subscriber = google_clients.subscriber_client()
    for spec in catalog.models.values():
        name = subscriber.subscription_path(settings.project_id, naming.worker_subscription(spec.name))
        subscription = subscriber.get_subscription(request={"subscription": name})
        assert subscription.topic.endswith(naming.request_topic(spec.name))
        assert subscription.ack_deadline_seconds == spec.ack_deadline_seconds
        assert subscription.dead_letter_policy.dead_letter_topic.endswith(naming.dead_letter_topic(spec.name))
        assert subscription.dead_letter_policy.max_delivery_attempts == spec.max_delivery_attempts
        dead_letters = subscriber.subscription_path(settings.project_id, naming.dead_letter_subscription(spec.name))
        assert subscriber.get_subscription(request={"subscription": dead_letters}).topic.endswith(
            naming.dead_letter_topic(spec.name)
        )
