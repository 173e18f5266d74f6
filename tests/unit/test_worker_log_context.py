"""The worker binds a request's id and its client's trace (the message's `traceparent`) to its log lines."""

from __future__ import annotations

import json
import logging

from contract.jsonlog import JsonFormatter
from contract.messages import Attr
from model_worker.held.log_context import request_log_context
from model_worker.held.pool import HeldMessage

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SUBSCRIPTION = "projects/maas-test/subscriptions/maas-requests-noop-workers"


def line_logged_for(attributes: dict[str, str]) -> dict:
    record = logging.LogRecord("model_worker", logging.INFO, __file__, 1, "hello", None, None)
    with request_log_context(HeldMessage(SUBSCRIPTION, "ack", attributes, b"", 1, 0.0)):
        return json.loads(JsonFormatter().format(record))


def test_a_traced_request_binds_its_trace_and_id():
    line = line_logged_for({Attr.REQUEST_ID: "r1", Attr.TRACEPARENT: f"00-{TRACE}-{SPAN}-01"})
    assert line["request_id"] == "r1"
    assert line["logging.googleapis.com/trace"] == f"projects/maas-test/traces/{TRACE}"
    assert line["logging.googleapis.com/spanId"] == SPAN and line["logging.googleapis.com/trace_sampled"] is True


def test_a_malformed_traceparent_is_dropped_whole():
    line = line_logged_for({Attr.REQUEST_ID: "r2", Attr.TRACEPARENT: f"00-{TRACE}-{SPAN}-01\r\nX-Evil: 1"})
    assert line["request_id"] == "r2" and "logging.googleapis.com/trace" not in line
    assert "X-Evil" not in json.dumps(line)


def test_nothing_stays_bound_after_the_request():
    line_logged_for({Attr.REQUEST_ID: "r3", Attr.TRACEPARENT: f"00-{TRACE}-{SPAN}-01"})
    record = logging.LogRecord("model_worker", logging.INFO, __file__, 1, "later", None, None)
    assert "request_id" not in json.loads(JsonFormatter().format(record))
