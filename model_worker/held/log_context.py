"""Binds a request's id and its client's trace to every log line the worker writes while handling it.

The API puts the client's trace on the request message (`Attr.TRACEPARENT`, W3C format); it is parsed
here with the API's own strict parser (`contract.tracing`), so a request's worker lines land under the
same trace in Cloud Logging as its API lines. Bound per thread (contextvars), around each request's own
work: triage, answering, the publish callback; a batch's shared lines name their batch instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from contract.jsonlog import bind_context, unbind_context
from contract.messages import Attr
from contract.tracing import parse_traceparent
from model_worker.held.pool import HeldMessage


def log_fields(attributes: dict[str, str], subscription: str) -> dict:
    """`request_id` and Cloud Logging's trace fields; the project is the one the message came from."""
    fields: dict = {}
    if request_id := attributes.get(Attr.REQUEST_ID):
        fields["request_id"] = request_id
    trace = parse_traceparent(attributes.get(Attr.TRACEPARENT))
    if trace is not None:
        parts = subscription.split("/")
        project = parts[1] if len(parts) > 1 and parts[0] == "projects" else "-"
        fields.update(trace.log_fields(project))
    return fields


def message_log_fields(message: HeldMessage) -> dict:
    """The fields for one line about `message` (`extra={"fields": ...}`) where nothing is bound."""
    return log_fields(message.attributes, message.subscription)


@contextmanager
def request_log_context(message: HeldMessage) -> Iterator[None]:
    token = bind_context(message_log_fields(message))
    try:
        yield
    finally:
        unbind_context(token)
