"""gunicorn settings, from the environment; Cloud Run sets PORT."""

import json
import os
import uuid

from gunicorn import util

# All interfaces in the container (Cloud Run routes to it); the local stack sets MAAS_API_HOST=127.0.0.1.
bind = f"{os.environ.get('MAAS_API_HOST', '0.0.0.0')}:{os.environ.get('PORT', '8080')}"  # noqa: S104
workers = int(os.environ.get("MAAS_API_WORKERS", "2"))
# Requests spend their time waiting for a reply, not computing: threads, not processes, carry them.
worker_class = "gthread"
threads = int(os.environ.get("MAAS_API_THREADS", "32"))
# Longer than the longest catalog request timeout, so gunicorn never kills a request that is waiting.
timeout = int(os.environ.get("MAAS_API_WORKER_TIMEOUT", "180"))
graceful_timeout = 30
preload_app = False  # gRPC clients are not fork-safe: each worker builds its own
accesslog = None
errorlog = "-"
loglevel = "warning"


def worker_exit(server, worker):
    """SIGTERM: flush the inference log rows still buffered in this worker."""
    app = getattr(worker, "wsgi", None)
    if app is not None and "maas" in getattr(app, "extensions", {}):
        from api_server.state import app_state

        app_state(app).close()


def _json_error(sock, status_int, reason, mesg):
    """gunicorn's own refusals (a malformed request line, headers too large) in the API's one error shape."""
    request_id = uuid.uuid4().hex
    body = json.dumps({"error": {"code": status_int, "message": mesg or reason, "request_id": request_id}}).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin1") + body)


# Replaces the HTML error page gunicorn's workers write (gunicorn.workers.base calls util.write_error).
util.write_error = _json_error
