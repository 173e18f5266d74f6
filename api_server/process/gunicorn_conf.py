"""gunicorn settings, from the environment; Cloud Run sets PORT."""

import json
import os
import uuid

from gunicorn import util
from gunicorn.asgi import protocol as asgi_protocol
from gunicorn.workers import gasgi

from api_server.process.wsgi_bridge import EVERY_RESPONSE_HEADERS

ALWAYS = "".join(f"{name}: {value}\r\n" for name, value in EVERY_RESPONSE_HEADERS)

# All interfaces in the container (Cloud Run routes to it); the local stack sets MAAS_API_HOST=127.0.0.1.
bind = f"{os.environ.get('MAAS_API_HOST', '0.0.0.0')}:{os.environ.get('PORT', '8080')}"  # noqa: S104
workers = int(os.environ.get("MAAS_API_WORKERS", "2"))
# gunicorn's asyncio worker reads connections, headers and bodies on its event loop (an idle or slow client
# costs no thread); the Flask app runs on `threads` threads once a request is whole (`api_server/process/asgi.py`).
# Requests spend their time waiting for a reply, not computing: threads, not processes, carry them.
worker_class = "asgi"
threads = int(os.environ.get("MAAS_API_THREADS", "32"))
# Open connections per worker, event streams included (they hold a connection, not a thread): gunicorn's
# default of 1,000 would be full with Cloud Run's 1,000 concurrent requests per instance all watching jobs.
worker_connections = int(os.environ.get("MAAS_API_WORKER_CONNECTIONS", "2000"))
# A connection whose request headers are not complete this long after it opened is closed (slow clients).
HEADER_READ_TIMEOUT_SECONDS = float(os.environ.get("MAAS_API_HEADER_TIMEOUT", "10"))
# A request whose body has not fully arrived this long after its headers is answered 408.
BODY_READ_TIMEOUT_SECONDS = float(os.environ.get("MAAS_API_BODY_TIMEOUT", "30"))
# Kept-alive connections idle this long are closed.
keepalive = 5
# Longer than the longest catalog request timeout, so gunicorn never kills a request that is waiting.
timeout = int(os.environ.get("MAAS_API_WORKER_TIMEOUT", "180"))
graceful_timeout = 30
asgi_loop = "asyncio"
asgi_lifespan = "on"
preload_app = False  # gRPC clients are not fork-safe: each worker builds its own
accesslog = None
errorlog = "-"
loglevel = "warning"


def worker_exit(server, worker):
    """SIGTERM: flush the inference log rows still buffered in this worker."""
    app = getattr(getattr(worker, "asgi", None), "wsgi_app", None) or getattr(worker, "wsgi", None)
    if app is not None and "maas" in getattr(app, "extensions", {}):
        from api_server.process.state import app_state

        app_state(app).close()


def _json_error(sock, status_int, reason, mesg):
    """gunicorn's own refusals (a malformed request line, headers too large) in the API's one error shape."""
    request_id = uuid.uuid4().hex
    body = json.dumps({"error": {"code": status_int, "message": mesg or reason, "request_id": request_id}}).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n{ALWAYS}\r\n"
    )
    util.write_nonblock(sock, head.encode("latin1") + body)


# Replaces the HTML error page gunicorn's workers write (gunicorn.workers.base calls util.write_error).
util.write_error = _json_error


class _HeaderTimeoutProtocol(asgi_protocol.ASGIProtocol):
    """gunicorn's ASGI connection, closed when its first request's headers are not complete in time.

    gunicorn times out idle kept-alive connections, but not a new one that sends part of a request and stops:
    such a socket costs no thread here, yet a thousand of them would hold their file descriptors forever.
    """

    def connection_made(self, transport):
        super().connection_made(transport)
        self._header_timer = self.worker.loop.call_later(HEADER_READ_TIMEOUT_SECONDS, self._headers_overdue)

    def _headers_overdue(self):
        if self.req_count <= 1 and self._current_request is None and not self._closed:
            self._keepalive_timeout()  # closes the transport and wakes the connection's task

    def connection_lost(self, exc):
        self._header_timer.cancel()
        super().connection_lost(exc)


def _json_error_response(self, status, message, extra_headers=()):
    """The ASGI worker's own refusals (a malformed request line, headers too large) in the API's error shape."""
    request_id = uuid.uuid4().hex
    body = json.dumps({"error": {"code": status, "message": message, "request_id": request_id}}).encode()
    reason = asgi_protocol._REASON_PHRASES.get(status, "Error")  # noqa: SLF001 - gunicorn's own table
    extra = "".join(f"{name}: {value}\r\n" for name, value in extra_headers)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nX-Request-Id: {request_id}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}{ALWAYS}Connection: close\r\n\r\n"
    )
    self._safe_write(head.encode("latin-1") + body)  # noqa: SLF001


asgi_protocol.ASGIProtocol._send_error_response = _json_error_response  # noqa: SLF001
gasgi.ASGIProtocol = _HeaderTimeoutProtocol
