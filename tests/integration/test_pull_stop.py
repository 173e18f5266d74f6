"""A worker's waiting pull against the real Pub/Sub emulator: a dead-letter pull (long, rare) is cancelled when the
worker stops instead of waited out, and the cancel loses nothing: a message published after it still reaches the
next pull (at once, or after its ack deadline if the broker handed it to the cancelled pull in that instant)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from contract import google_clients
from model_worker.serving.health import WorkerHealth
from model_worker.serving.intake import SubscriptionLoop

pytestmark = pytest.mark.stack
ACK_DEADLINE_SECONDS = 10


class RecordingLoop(SubscriptionLoop):
    """Pulls as the dead-letter responder does (a wait no test outlasts, cancelled by `stop`)."""

    wait_seconds = 600.0
    cancel_on_stop = True

    def __init__(self, subscriber, subscription: str) -> None:
        super().__init__(subscriber, subscription, WorkerHealth(60), "test-pull")
        self.received: list[bytes] = []
        self.pulling = threading.Event()

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.pulling.set()
            self.received.extend(received.message.data for received in self._pull(1) or [])


@pytest.fixture
def topic_and_subscription(stack):
    publisher, subscriber = google_clients.publisher_client(), google_clients.subscriber_client()
    name = f"pull-stop-{uuid.uuid4().hex[:8]}"
    topic = f"projects/{stack.project_id}/topics/{name}"
    subscription = f"projects/{stack.project_id}/subscriptions/{name}"
    publisher.create_topic(name=topic)
    subscriber.create_subscription(name=subscription, topic=topic, ack_deadline_seconds=ACK_DEADLINE_SECONDS)
    yield publisher, subscriber, topic, subscription
    subscriber.delete_subscription(subscription=subscription)
    publisher.delete_topic(topic=topic)
    subscriber.close()


def test_stopping_cancels_a_waiting_dead_letter_pull_and_loses_nothing(topic_and_subscription):
    publisher, subscriber, topic, subscription = topic_and_subscription
    loop = RecordingLoop(subscriber, subscription)
    loop.start()
    assert loop.pulling.wait(30)
    loop.stop()
    loop.join(60)  # bounds a hang only: the pull waits 600 s unless cancelled
    assert not loop._thread.is_alive(), "the waiting pull was waited out, not cancelled"  # noqa: SLF001
    assert loop.received == []
    publisher.publish(topic, b"after the stop").result(timeout=60)
    received = []
    ends = time.monotonic() + 6 * ACK_DEADLINE_SECONDS  # bounds a hang only
    while not received and time.monotonic() < ends:
        response = subscriber.pull(request={"subscription": subscription, "max_messages": 1}, timeout=30)
        received = [message.message.data for message in response.received_messages]
    assert received == [b"after the stop"]
