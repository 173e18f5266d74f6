"""gunicorn's entry point: `gunicorn --config api_server/process/gunicorn_conf.py api_server.process.asgi:app`.

The API is a WSGI app (Flask); gunicorn's asyncio worker serves it through `WsgiBridge`. Connections,
request headers and bodies are read on the event loop, so an idle or slow client costs a few kilobytes
and a timer, never a thread; only a complete request is handed to a thread of a fixed pool, where the app
runs (and waits for its reply) as it did under gthread. With gthread, every connection whose first bytes
had arrived held a thread until its headers were complete: forty clients that sent one header line and
stopped held every thread, and every other request waited. A job's event stream (`GET /v1/jobs/{id}/events`)
holds a thread only while it opens (authentication, ownership, `Last-Event-ID`, in the Flask route): the
route hands its body to the bridge (`ASYNC_BODY`), which serves it on the event loop, woken by the process's
one job-watching hub (`api_server/jobs/events.py`); a thousand watchers cost a thousand sockets, not threads.

Imported in each gunicorn worker after it forks (no preload), so Google clients are created post-fork.
"""

from __future__ import annotations

from api_server.process.wsgi_bridge import WsgiBridge
from contract.settings import Settings


def build_app() -> WsgiBridge:
    from api_server.process.gunicorn_conf import BODY_READ_TIMEOUT_SECONDS, threads
    from api_server.process.wsgi import app as wsgi_app

    return WsgiBridge(wsgi_app, threads, Settings.from_env().max_request_bytes, BODY_READ_TIMEOUT_SECONDS)


app = build_app()
