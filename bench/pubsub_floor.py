"""Pub/Sub round trips without the API, on the stack's own emulator: the floor, and the naive per-request pattern.

- floor: publish a request, the echo responder (`bench.reply_modes.EchoResponder`) pulls it and publishes a
  reply, a fixed subscription pulls the reply: publish -> pull -> publish -> pull, no routing.
- naive: what a per-request reply subscription costs when written plainly: create a subscription, publish,
  pull until this request's reply arrives, delete the subscription.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from google.api_core import exceptions

from bench.loadgen import Sample
from bench.reply_modes import BareEcho, EchoResponder, one_round_trip
from contract import google_clients, naming
from contract.messages import Attr


class PubSubRoundTrips:
    """The echo responder and the two client patterns, for one project on the emulator."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.responder = EchoResponder(project)
        self.bare: BareEcho | None = BareEcho(project)
        self.publisher = google_clients.publisher_client()
        self.subscriber = google_clients.subscriber_client()
        self.replies_topic = f"projects/{project}/topics/{naming.REPLIES_TOPIC}"

    def floor_caller(self) -> Callable[[int], Sample]:
        def call(_number: int) -> Sample:
            started = time.perf_counter()
            try:
                one_round_trip(self.publisher, self.responder.topic, None, self.bare)
            except Exception as exc:  # noqa: BLE001 - counted as an error, the run goes on
                return Sample(started, time.perf_counter(), False, error=type(exc).__name__)
            return Sample(started, time.perf_counter(), True)

        return call

    def naive_caller(self) -> Callable[[int], Sample]:
        def call(_number: int) -> Sample:
            request_id = uuid.uuid4().hex
            name = self.subscriber.subscription_path(self.project, f"bench-naive-{request_id}")
            started = time.perf_counter()
            try:
                self.subscriber.create_subscription(
                    request={
                        "name": name,
                        "topic": self.replies_topic,
                        "filter": f'attributes.{Attr.REQUEST_ID} = "{request_id}"',
                    }
                )
                try:
                    self.publisher.publish(self.responder.topic, b"{}", **{Attr.REQUEST_ID: request_id}).result(10)
                    ok = self._pull_until(name, request_id, deadline=time.monotonic() + 30)
                finally:
                    self.subscriber.delete_subscription(request={"subscription": name}, timeout=10)
            except exceptions.GoogleAPICallError as exc:
                return Sample(started, time.perf_counter(), False, error=type(exc).__name__)
            return Sample(started, time.perf_counter(), ok, error=None if ok else "no reply")

        return call

    def _pull_until(self, subscription: str, request_id: str, deadline: float) -> bool:
        while time.monotonic() < deadline:
            try:
                response = self.subscriber.pull(
                    request={"subscription": subscription, "max_messages": 10}, timeout=5, retry=None
                )
            except exceptions.DeadlineExceeded:
                continue
            received = list(response.received_messages)
            if received:
                self.subscriber.acknowledge(
                    request={"subscription": subscription, "ack_ids": [m.ack_id for m in received]}
                )
            # The emulator ignores the filter: every waiting subscription sees every reply.
            if any(m.message.attributes.get(Attr.REQUEST_ID) == request_id for m in received):
                return True
        return False

    def close_floor(self) -> None:
        """Deletes the floor's reply subscription, which would otherwise take every later reply too."""
        if self.bare is not None:
            self.bare.close()
            self.bare = None

    def close(self) -> None:
        self.close_floor()
        self.responder.close()
        self.subscriber.close()
        self.publisher.stop()
