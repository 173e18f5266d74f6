"""Trace headers are parsed strictly: well-formed ids become Cloud Logging fields, anything else is dropped."""

from __future__ import annotations

import json
import logging

import pytest

from contract.jsonlog import JsonFormatter, bind_context, unbind_context
from contract.tracing import parse_cloud_trace_context, parse_traceparent, trace_from_headers

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_well_formed_traceparent_gives_trace_span_and_sampling():
    trace = parse_traceparent(f"00-{TRACE}-{SPAN}-01")
    assert (trace.trace_id, trace.span_id, trace.sampled) == (TRACE, SPAN, True)
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled is False
    assert trace.log_fields("proj") == {
        "logging.googleapis.com/trace": f"projects/proj/traces/{TRACE}",
        "logging.googleapis.com/spanId": SPAN,
        "logging.googleapis.com/trace_sampled": True,
    }


def test_well_formed_cloud_trace_context_gives_a_hex_span():
    trace = parse_cloud_trace_context(f"{TRACE.upper()}/12345;o=1")
    assert (trace.trace_id, trace.span_id, trace.sampled) == (TRACE, format(12345, "016x"), True)
    assert parse_cloud_trace_context(TRACE).span_id is None
    # A span id outside 64 bits is dropped; the trace id alone still groups the lines.
    assert parse_cloud_trace_context(f"{TRACE}/{2**64};o=0").span_id is None


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TRACE}-{SPAN}-01\r\nX-Injected: 1",
        f"00-{TRACE}-{SPAN}-01\n",
        f"00-{TRACE[:-1]}g-{SPAN}-01",
        f"00-{TRACE.upper()}-{SPAN}-01",  # the W3C grammar is lower-case
        f"01-{TRACE}-{SPAN}-01",
        f"ff-{TRACE}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE}{'a' * 200}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-01-extra",
        "",
        "<script>",
    ],
)
def test_malformed_traceparent_is_dropped(value):
    assert parse_traceparent(value) is None
    assert trace_from_headers({"traceparent": value}) is None


@pytest.mark.parametrize(
    "value",
    [
        f"{TRACE}/1;o=1\r\nX-Injected: 1",
        f"{TRACE}\n",
        f"{TRACE[:-1]}z/1;o=1",
        f"{TRACE}/abc;o=1",
        f"{TRACE}/1;o=2",
        f"{TRACE}/{'9' * 200}",
        f"{'0' * 32}/1",
        f"{TRACE}0/1",
        f"../../{TRACE}",
        "projects/evil/traces/x",
    ],
)
def test_malformed_cloud_trace_context_is_dropped(value):
    assert parse_cloud_trace_context(value) is None


def test_traceparent_wins_and_a_bad_one_falls_back_to_the_cloud_header():
    other = "a" * 32
    both = {"traceparent": f"00-{TRACE}-{SPAN}-01", "X-Cloud-Trace-Context": f"{other}/1;o=1"}
    assert trace_from_headers(both).trace_id == TRACE
    assert trace_from_headers({**both, "traceparent": "garbage"}).trace_id == other


def test_bound_fields_appear_on_every_line_until_unbound():
    formatter = JsonFormatter()

    def line(message: str, **fields) -> dict:
        record = logging.LogRecord("x", logging.INFO, __file__, 1, message, (), None)
        if fields:
            record.fields = fields
        return json.loads(formatter.format(record))

    token = bind_context({"request_id": "r1", "logging.googleapis.com/trace": "projects/p/traces/t"})
    try:
        entry = line("inside", extra_field=1)
        assert entry["request_id"] == "r1" and entry["logging.googleapis.com/trace"] == "projects/p/traces/t"
        assert entry["extra_field"] == 1 and entry["severity"] == "INFO"
    finally:
        unbind_context(token)
    assert "request_id" not in line("outside")
