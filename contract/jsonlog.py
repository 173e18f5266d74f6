"""One JSON object per log line, with `severity` and `message`, as Cloud Logging parses it.

Fields bound with `bind_context` (the API binds the request id and trace while it handles a request) are
added to every line written in that context, whichever logger writes it.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar, Token
from datetime import UTC, datetime

_context: ContextVar[dict | None] = ContextVar("maas_log_context", default=None)


def bind_context(fields: dict) -> Token:
    """Adds `fields` to every line logged in this context (thread) until `unbind_context(token)`."""
    return _context.set({**(_context.get() or {}), **fields})


def unbind_context(token: Token) -> None:
    _context.reset(token)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "severity": record.levelname,
            "message": record.getMessage(),
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "logger": record.name,
        }
        entry.update(_context.get() or {})
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("urllib3", "google.auth", "google.api_core", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
