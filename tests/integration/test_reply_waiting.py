"""Reply waiting against the real Pub/Sub emulator, in both modes: timeouts, foreign replies, missed notifications."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from google.api_core import exceptions

from api_server.predict.reply_waiter import CREATED_LABEL, PerInstanceReplyWaiter, PerRequestReplyWaiter
from contract import google_clients, naming
from contract.messages import Attr, InferenceReply
from contract.stores.results import ResultStore

pytestmark = pytest.mark.stack


@pytest.fixture
def results(settings) -> ResultStore:
    return ResultStore(redis.Redis.from_url(settings.redis_url), ttl_seconds=60)


@pytest.fixture(params=["per-request", "per-instance"])
def waiter(request, settings, results):
    subscriber = google_clients.subscriber_client()
    if request.param == "per-request":
        waiter = PerRequestReplyWaiter(subscriber, settings.project_id, results)
    else:
        waiter = PerInstanceReplyWaiter(subscriber, settings.project_id, f"test-{uuid.uuid4().hex[:8]}", results)
    yield waiter
    waiter.close()


def publish_reply(settings, request_id: str, extra_attributes: dict[str, str] | None = None) -> InferenceReply:
    reply = InferenceReply(
        request_id=request_id, model="sd15-txt2img", model_version="1", status="ok", worker_id="test"
    )
    publisher = google_clients.publisher_client()
    topic = publisher.topic_path(settings.project_id, naming.REPLIES_TOPIC)
    publisher.publish(
        topic, reply.model_dump_json().encode(), **{Attr.REQUEST_ID: request_id, **(extra_attributes or {})}
    ).result(timeout=60)
    return reply


def subscription_exists(settings, name: str) -> bool:
    try:
        google_clients.subscriber_client().get_subscription(request={"subscription": name})
        return True
    except exceptions.NotFound:
        return False


def test_reply_that_never_comes_times_out_and_the_subscription_is_deleted(waiter, settings):
    request_id = uuid.uuid4().hex
    pending = waiter.expect(request_id)
    started = time.monotonic()
    assert pending.wait(timeout=1.5) is None
    # Not before its timeout; the upper bound only ends a hang (a wait stuck on a pull), however busy the machine.
    assert 1.4 <= time.monotonic() - started < 60
    pending.close()
    if waiter.mode == "per-request":
        assert not subscription_exists(settings, pending.subscription)


def test_reply_for_another_request_is_ignored(waiter, settings):
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    pending = waiter.expect(mine)
    try:
        publish_reply(settings, other, waiter.request_attributes())
        assert pending.wait(timeout=1.5) is None
        publish_reply(settings, mine, waiter.request_attributes())
        reply = pending.wait(timeout=60)  # bounds a hang only
        assert reply is not None and reply.request_id == mine
    finally:
        pending.close()


def test_reply_missed_by_the_subscription_is_found_in_the_result_store(waiter, results):
    request_id = uuid.uuid4().hex
    pending = waiter.expect(request_id)
    try:
        stored = InferenceReply(
            request_id=request_id, model="sd15-txt2img", model_version="1", status="ok", worker_id="w"
        )
        results.put(stored)  # as the worker does before publishing; the notification itself never arrives
        assert pending.wait(timeout=60) == stored  # found by the waiter's poll of the store; bounds a hang only
    finally:
        pending.close()


def test_per_request_subscription_is_filtered_labelled_and_expires(settings, results):
    waiter = PerRequestReplyWaiter(google_clients.subscriber_client(), settings.project_id, results)
    request_id = uuid.uuid4().hex
    pending = waiter.expect(request_id)
    try:
        subscription = google_clients.subscriber_client().get_subscription(
            request={"subscription": pending.subscription}
        )
        assert subscription.filter == f'attributes.request_id = "{request_id}"'
        labels = dict(subscription.labels)
        assert labels.pop(CREATED_LABEL).isdigit() and labels == naming.REPLY_SUBSCRIPTION_LABEL
        assert subscription.expiration_policy.ttl.total_seconds() == 86400
    finally:
        pending.close()
    assert not subscription_exists(settings, pending.subscription)


def test_per_instance_reply_stream_comes_back_after_its_subscription_vanishes(settings, results):
    """What a Pub/Sub restart does to a running API: the instance's subscription is gone; it is made again."""
    subscriber = google_clients.subscriber_client()
    waiter = PerInstanceReplyWaiter(subscriber, settings.project_id, f"test-{uuid.uuid4().hex[:8]}", results)
    try:
        waiter.expect("warm-up").close()
        name = subscriber.subscription_path(
            settings.project_id, naming.instance_reply_subscription(waiter.request_attributes()[Attr.INSTANCE])
        )
        subscriber.delete_subscription(request={"subscription": name})
        deadline = time.monotonic() + 30
        while True:
            try:
                subscriber.get_subscription(request={"subscription": name})
                break
            except exceptions.NotFound:
                assert time.monotonic() < deadline, "the instance subscription was not re-created"
                time.sleep(0.2)
        request_id = uuid.uuid4().hex
        pending = waiter.expect(request_id)
        # Published once the re-created subscription exists (seen above), so it keeps the reply for the stream.
        publish_reply(settings, request_id, waiter.request_attributes())
        reply = pending.wait(60)
        pending.close()
        assert reply is not None and reply.request_id == request_id
    finally:
        waiter.close()
