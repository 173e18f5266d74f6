"""Waits for a worker's reply to one request; two interchangeable modes, chosen by MAAS_REPLY_MODE.

- per-request: an ephemeral subscription per request, filtered on its id, created before the request is
  published and deleted after. Simple, but each request costs two admin operations (capped at 6,000
  per minute per project, so ~50 requests/s).
- per-instance: one subscription per API process, filtered on the instance id; replies are routed to
  the waiting request in memory. No admin operation per request.

The emulator ignores subscription filters, so both check the request id themselves. Both also read the
worker's result store while waiting: the reply message is a notification, not the only copy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Protocol

import redis
from google.api_core import exceptions
from google.cloud import pubsub_v1
from pydantic import ValidationError

from contract import naming
from contract.messages import Attr, InferenceReply
from contract.stores.results import ResultStore

log = logging.getLogger(__name__)
# Real Pub/Sub's minimum expiration: an abandoned subscription (crashed API process) deletes itself a day later.
SUBSCRIPTION_TTL = timedelta(days=1)
# Epoch seconds at creation, as a label: Pub/Sub does not expose a subscription's creation time, and the
# janitor (api_server/jobs/janitor.py) needs its age to tell a leaked subscription from one still waited on.
CREATED_LABEL = "maas-created"
RESULT_POLL_SECONDS = 1.0
# After the per-instance reply stream ends (its subscription vanished), it is re-created this much later.
STREAM_RESTART_SECONDS = 1.0
# How long closing waits for the reply stream's callbacks in flight.
STREAM_SHUTDOWN_SECONDS = 10.0


class PendingReply(Protocol):
    def wait(self, timeout: float) -> InferenceReply | None: ...

    def close(self) -> None: ...


class ReplyWaiter(Protocol):
    mode: str

    def expect(self, request_id: str) -> PendingReply:
        """Prepares to receive the reply; call before publishing the request."""

    def request_attributes(self) -> dict[str, str]:
        """Extra attributes the request message must carry so the reply finds its way back."""

    def close(self) -> None: ...


def reply_subscription_request(name: str, topic: str, attribute: str, value: str, created: float | None = None) -> dict:
    """A filtered, labelled, expiring subscription on the replies topic: leaked ones are found and removed."""
    created = time.time() if created is None else created
    return {
        "name": name,
        "topic": topic,
        "filter": f'attributes.{attribute} = "{value}"',
        "ack_deadline_seconds": 10,
        "labels": {**naming.REPLY_SUBSCRIPTION_LABEL, CREATED_LABEL: str(int(created))},
        "expiration_policy": {"ttl": SUBSCRIPTION_TTL},
    }


def _stored(results: ResultStore, request_id: str) -> InferenceReply | None:
    """The worker's stored reply; None while Redis is unreachable (the reply message still arrives)."""
    try:
        return results.get(request_id)
    except redis.RedisError as exc:
        log.warning("result store unavailable while waiting for %s: %s", request_id, exc)
        return None


def _parse_reply(message: pubsub_v1.types.PubsubMessage) -> InferenceReply | None:
    try:
        return InferenceReply.model_validate_json(message.data)
    except ValidationError:
        log.error("unreadable reply for %s dropped", message.attributes.get(Attr.REQUEST_ID))
        return None


class PerRequestReplyWaiter:
    mode = "per-request"

    def __init__(self, subscriber: pubsub_v1.SubscriberClient, project_id: str, results: ResultStore) -> None:
        self._subscriber = subscriber
        self._project_id = project_id
        self._results = results
        self._topic = f"projects/{project_id}/topics/{naming.REPLIES_TOPIC}"

    def expect(self, request_id: str) -> _SubscriptionReply:
        name = self._subscriber.subscription_path(self._project_id, naming.reply_subscription(request_id))
        request = reply_subscription_request(name, self._topic, Attr.REQUEST_ID, request_id)
        request["message_retention_duration"] = timedelta(minutes=10)
        self._subscriber.create_subscription(request=request)
        return _SubscriptionReply(self._subscriber, name, request_id, self._results)

    def request_attributes(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass


class _SubscriptionReply:
    def __init__(
        self, subscriber: pubsub_v1.SubscriberClient, name: str, request_id: str, results: ResultStore
    ) -> None:
        self._subscriber = subscriber
        self.subscription = name
        self._request_id = request_id
        self._results = results

    def wait(self, timeout: float) -> InferenceReply | None:
        deadline = time.monotonic() + timeout
        next_store_check = time.monotonic() + RESULT_POLL_SECONDS
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                response = self._subscriber.pull(
                    request={"subscription": self.subscription, "max_messages": 10},
                    timeout=min(remaining, RESULT_POLL_SECONDS),
                    retry=None,
                )
                received = list(response.received_messages)
            except exceptions.DeadlineExceeded:
                received = []
            except exceptions.GoogleAPICallError as exc:
                # Pub/Sub restarting or this subscription gone with it: the worker's stored reply still answers.
                log.warning("reply pull on %s failed (%s); watching the result store", self.subscription, exc)
                received = []
                time.sleep(min(RESULT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            if received:
                with contextlib.suppress(exceptions.GoogleAPICallError):  # the subscription is deleted after anyway
                    self._subscriber.acknowledge(
                        request={"subscription": self.subscription, "ack_ids": [m.ack_id for m in received]}
                    )
            for item in received:
                # The emulator does not apply the filter: other requests' replies arrive here too.
                if item.message.attributes.get(Attr.REQUEST_ID) == self._request_id:
                    reply = _parse_reply(item.message)
                    if reply is not None:
                        return reply
            # Checked on a clock, not only on empty pulls: other requests' replies can keep the pull busy.
            if time.monotonic() >= next_store_check:
                if (stored := _stored(self._results, self._request_id)) is not None:
                    return stored
                next_store_check = time.monotonic() + RESULT_POLL_SECONDS
        return _stored(self._results, self._request_id)

    def close(self) -> None:
        try:
            self._subscriber.delete_subscription(request={"subscription": self.subscription}, timeout=10)
        except exceptions.NotFound:
            pass
        except exceptions.GoogleAPICallError:
            # Left for its expiration policy (and the reply-wait label) to clean up.
            log.warning("could not delete %s", self.subscription, exc_info=True)


class PerInstanceReplyWaiter:
    mode = "per-instance"

    def __init__(
        self, subscriber: pubsub_v1.SubscriberClient, project_id: str, instance_id: str, results: ResultStore
    ) -> None:
        self._subscriber = subscriber
        self._results = results
        self._instance_id = instance_id
        self._subscription = subscriber.subscription_path(project_id, naming.instance_reply_subscription(instance_id))
        self._topic = f"projects/{project_id}/topics/{naming.REPLIES_TOPIC}"
        self._lock = threading.Lock()
        self._waiting: dict[str, _RoutedReply] = {}
        self._streaming = None
        self._closing = False

    def _start(self) -> None:
        with self._lock:
            if self._streaming is not None or self._closing:
                return
            with contextlib.suppress(exceptions.AlreadyExists):
                self._subscriber.create_subscription(
                    request=reply_subscription_request(
                        self._subscription, self._topic, Attr.INSTANCE, self._instance_id
                    )
                )
            flow = pubsub_v1.types.FlowControl(max_messages=1000)
            self._streaming = streaming = self._subscriber.subscribe(self._subscription, self._route, flow_control=flow)
        # Outside the lock: a stream that has already ended calls back at once.
        streaming.add_done_callback(self._stream_ended)

    def _stream_ended(self, future) -> None:
        """The stream ends for good when its subscription is gone (a Pub/Sub restart): make it again. Waits
        meanwhile are answered from the result store."""
        with self._lock:
            if self._closing:
                return
            self._streaming = None
        log.warning("reply stream on %s ended (%s); re-creating it", self._subscription, future.exception())
        timer = threading.Timer(STREAM_RESTART_SECONDS, self._restart)
        timer.daemon = True
        timer.start()

    def _restart(self) -> None:
        try:
            self._start()
        except exceptions.GoogleAPICallError as exc:
            log.warning("could not re-create %s yet: %s", self._subscription, exc)
            with self._lock:
                self._streaming = None
            timer = threading.Timer(STREAM_RESTART_SECONDS, self._restart)
            timer.daemon = True
            timer.start()

    def _route(self, message) -> None:
        message.ack()
        if message.attributes.get(Attr.INSTANCE) != self._instance_id:
            return  # another instance's reply (the emulator does not filter)
        with self._lock:
            pending = self._waiting.get(message.attributes.get(Attr.REQUEST_ID, ""))
        if pending is not None and (reply := _parse_reply(message)) is not None:
            pending.deliver(reply)

    def expect(self, request_id: str) -> _RoutedReply:
        self._start()
        pending = _RoutedReply(request_id, self._results, lambda: self._forget(request_id))
        with self._lock:
            self._waiting[request_id] = pending
        return pending

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def request_attributes(self) -> dict[str, str]:
        return {Attr.INSTANCE: self._instance_id}

    def close(self) -> None:
        with self._lock:
            self._closing = True
            streaming = self._streaming
        if streaming is None:
            return
        streaming.cancel()
        try:  # wait for the callbacks in flight, as the client's samples do after cancel()
            streaming.result(timeout=STREAM_SHUTDOWN_SECONDS)
        except Exception as exc:  # noqa: BLE001 - a stream that ended with an error has nothing left to wait for
            log.debug("reply stream on %s ended: %s", self._subscription, exc)
        try:
            self._subscriber.delete_subscription(request={"subscription": self._subscription}, timeout=10)
        except exceptions.GoogleAPICallError:
            log.warning("could not delete %s", self._subscription, exc_info=True)


class _RoutedReply:
    def __init__(self, request_id: str, results: ResultStore, forget) -> None:
        self._request_id = request_id
        self._results = results
        self._forget = forget
        self._event = threading.Event()
        self._reply: InferenceReply | None = None

    def deliver(self, reply: InferenceReply) -> None:
        self._reply = reply
        self._event.set()

    def wait(self, timeout: float) -> InferenceReply | None:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if self._event.wait(min(remaining, RESULT_POLL_SECONDS)):
                return self._reply
            if (stored := _stored(self._results, self._request_id)) is not None:
                return stored
        return self._reply or _stored(self._results, self._request_id)

    def close(self) -> None:
        self._forget()
