"""Reads a request's trace from `traceparent` or `X-Cloud-Trace-Context`, accepting only well-formed ids,
and carries it across the queue: the API puts it on the request message as a W3C `traceparent`
attribute (`Attr.TRACEPARENT`), the worker reads it back with the same parser and binds it to its lines.

Both headers come from the client as much as from Google's front end, so nothing of them is echoed: a
header is either parsed into hex ids (lower-cased, a 64-bit span id) or ignored whole. Overlong values,
CR/LF or any other character outside the grammar, and the all-zero ids the W3C spec declares invalid are
ignored. `traceparent` wins when both are well formed (it is the standard; Cloud Run sends both).

- `traceparent: 00-<32 hex trace>-<16 hex span>-<2 hex flags>` (version 00 only; bit 0 of flags: sampled)
- `X-Cloud-Trace-Context: <32 hex trace>[/<decimal span>][;o=0|1]` (span converted to 16 hex digits)
"""

from __future__ import annotations

import re
import secrets
from contextvars import ContextVar
from dataclasses import dataclass

MAX_HEADER_LENGTH = 128
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_CLOUD_TRACE = re.compile(r"([0-9a-fA-F]{32})(?:/([0-9]{1,20}))?(?:;o=([01]))?")


@dataclass(frozen=True)
class TraceContext:
    trace_id: str
    span_id: str | None
    sampled: bool | None

    def log_fields(self, project_id: str) -> dict:
        """Cloud Logging's special fields: lines with the same trace are grouped under one request."""
        fields: dict = {"logging.googleapis.com/trace": f"projects/{project_id}/traces/{self.trace_id}"}
        if self.span_id:
            fields["logging.googleapis.com/spanId"] = self.span_id
        if self.sampled is not None:
            fields["logging.googleapis.com/trace_sampled"] = self.sampled
        return fields

    def traceparent(self) -> str:
        """The W3C header for a message sent on this trace's behalf (a fresh parent span when none came)."""
        span_id = self.span_id or secrets.token_hex(8)
        return f"00-{self.trace_id}-{span_id}-{'01' if self.sampled else '00'}"


# The trace of the request this thread is handling (the API sets it per request; the dispatcher reads it).
_current: ContextVar[TraceContext | None] = ContextVar("maas_trace", default=None)


def set_current_trace(trace: TraceContext | None):
    """Makes `trace` the one outgoing messages carry in this context; returns the token to reset it with."""
    return _current.set(trace)


def reset_current_trace(token) -> None:
    _current.reset(token)


def current_trace() -> TraceContext | None:
    return _current.get()


def parse_traceparent(value: str | None) -> TraceContext | None:
    if not value or len(value) > MAX_HEADER_LENGTH:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    trace_id, span_id, flags = match.groups()
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceContext(trace_id, span_id, bool(int(flags, 16) & 1))


def parse_cloud_trace_context(value: str | None) -> TraceContext | None:
    if not value or len(value) > MAX_HEADER_LENGTH:
        return None
    match = _CLOUD_TRACE.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    trace_id, span, option = match.groups()
    if trace_id == "0" * 32:
        return None
    span_id = None
    if span is not None and 0 < int(span) < 2**64:
        span_id = format(int(span), "016x")
    return TraceContext(trace_id.lower(), span_id, None if option is None else option == "1")


def trace_from_headers(headers) -> TraceContext | None:
    """The request's trace, or None when neither header is well formed."""
    return parse_traceparent(headers.get("traceparent")) or parse_cloud_trace_context(
        headers.get("X-Cloud-Trace-Context")
    )
