"""The worker's probe endpoints (/startupz, /readyz, /livez) and /metrics on a small HTTP server of their own."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)
# A condition that persists is logged when it starts and then at this interval, not on every pull.
PROBLEM_LOG_INTERVAL_SECONDS = 60.0


class WorkerHealth:
    """Probe state: started once the pipelines are warm, ready while pulling works, live while the loops turn.

    A problem found while loading (weights that fail their manifest or do not load) also ends start-up: the
    process is up and `/readyz` says why, so a Deployment shows a running pod that is not ready, with its
    reason, rather than a pod the startup probe's deadline restarts again and again. The problem stays in
    `/readyz` (503) until it clears; `/livez` checks the loops' heartbeat only once the pipelines serve.
    """

    def __init__(self, stall_seconds: float) -> None:
        self.started = False
        self.draining = False
        self._settled = False  # start-up ended on a problem: the process is up, not serving
        self._stall_seconds = stall_seconds
        self._heartbeat = time.monotonic()
        self._problems: dict[str, str] = {}
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def beat(self) -> None:
        self._heartbeat = time.monotonic()

    def report_problem(self, source: str, reason: str) -> None:
        """Not ready while `source` has a problem; logged once, then every PROBLEM_LOG_INTERVAL_SECONDS."""
        with self._lock:
            self._problems[source] = reason
            self._settled = self._settled or not self.started
            last = self._logged.get(source)
            due = last is None or time.monotonic() - last >= PROBLEM_LOG_INTERVAL_SECONDS
            if due:
                self._logged[source] = time.monotonic()
        if due:
            log.error("not ready: %s: %s", source, reason)

    def clear_problem(self, source: str) -> None:
        with self._lock:
            had = self._problems.pop(source, None)
            self._logged.pop(source, None)
        if had is not None:
            log.info("recovered: %s", source)

    def status(self, path: str) -> tuple[int, str]:
        if path == "/startupz":
            if self.started:
                return 200, "started"
            return (200, "started, not serving: see /readyz") if self._settled else (503, "loading")
        if path == "/readyz":
            with self._lock:
                problems = "; ".join(f"{source}: {reason}" for source, reason in sorted(self._problems.items()))
            if self.draining:
                return 503, "draining"
            if problems:
                return 503, f"not ready: {problems}"
            return (200, "ready") if self.started else (503, "loading")
        if path == "/livez":
            stalled = self.started and time.monotonic() - self._heartbeat > self._stall_seconds
            return (503, "stalled") if stalled else (200, "alive")
        return 404, "not found"


class ProbeServer(ThreadingHTTPServer):
    """A probe that gave up before its answer (its timeout passed while a model loads and holds the interpreter)
    is not an error of the worker: one debug line, not the traceback `socketserver` prints for any exception."""

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            log.debug("a probe from %s left before its answer", client_address[0])
            return
        super().handle_error(request, client_address)


def serve_health(
    health: WorkerHealth, port: int, host: str = "0.0.0.0", metrics: Callable[[], bytes] | None = None
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/metrics" and metrics is not None:
                code, body, content_type = 200, metrics(), "text/plain; version=0.0.4; charset=utf-8"
            else:
                code, text = health.status(self.path)
                body, content_type = text.encode(), "text/plain; charset=utf-8"  # reasons carry "—", file names
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ProbeServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
