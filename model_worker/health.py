"""The worker's probe endpoints (/startupz, /readyz, /livez) on a small HTTP server of their own."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WorkerHealth:
    """Probe state: started once the pipeline is warm, ready while pulling, live while the loop turns."""

    def __init__(self, stall_seconds: float) -> None:
        self.started = False
        self.draining = False
        self._stall_seconds = stall_seconds
        self._heartbeat = time.monotonic()

    def beat(self) -> None:
        self._heartbeat = time.monotonic()

    def status(self, path: str) -> tuple[int, str]:
        if path == "/startupz":
            return (200, "started") if self.started else (503, "loading")
        if path == "/readyz":
            if not self.started:
                return 503, "loading"
            return (503, "draining") if self.draining else (200, "ready")
        if path == "/livez":
            stalled = self.started and time.monotonic() - self._heartbeat > self._stall_seconds
            return (503, "stalled") if stalled else (200, "alive")
        return 404, "not found"


def serve_health(health: WorkerHealth, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            code, text = health.status(self.path)
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)  # noqa: S104 - kubelet probes reach the pod IP
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
