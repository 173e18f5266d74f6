"""Serves a WSGI app (Flask) from an ASGI server: the request is read whole on the event loop (headers by the
server, the body here, within a deadline), then the app runs on a thread of a fixed pool and its answer is
streamed back through the loop. An idle or slow client therefore costs no thread.

A long-lived body (an event stream) need not hold a thread either: a view that puts a factory of an async
iterator of bytes in `environ[ASYNC_BODY]` and answers 200 has its WSGI body dropped unread; the bridge sends
the head and then that iterator's chunks from the event loop, until it ends or the client disconnects.

When every thread is busy, a whole request waits for one; `environ[RECEIVED_AT]` is when it became whole (its
`time.perf_counter()`), so that the app counts that wait in the request's deadline (admission, the sync wait).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from contract.digits import ascii_digits

log = logging.getLogger(__name__)
ASYNC_BODY = "maas.async_body"
RECEIVED_AT = "maas.received_at"
# Headers on every response the API sends, from the app, this bridge or gunicorn's own refusals: error bodies
# echo what the client sent, so no browser may sniff them into something it would render or run.
EVERY_RESPONSE_HEADERS = (("X-Content-Type-Options", "nosniff"),)
Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class WsgiBridge:
    """An ASGI app that runs a WSGI app on a thread pool once the whole request has been read."""

    def __init__(self, wsgi_app, threads: int, max_body_bytes: int, body_timeout: float) -> None:
        self.wsgi_app = wsgi_app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="wsgi")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets here: the connection is closed unanswered
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        loop = asyncio.get_running_loop()
        environ = self._environ(scope, body)
        environ[RECEIVED_AT] = time.perf_counter()  # before the wait for a thread
        async_body = await loop.run_in_executor(self._pool, self._run, environ, send, loop)
        if async_body is not None:
            await _serve_async_body(async_body, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._pool.shutdown(wait=False)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, read within `body_timeout`; None when the client left or was answered 408.

        A body declared larger than the limit is not read (the app answers 413 from its Content-Length); a
        chunked one is read up to the limit plus one byte, then handed on with that length (413 as well).
        """
        declared = _header(scope, b"content-length")
        if declared is not None and ascii_digits(declared) and int(declared) > self.max_body_bytes:
            return b""
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(remaining, 0.001))
            except TimeoutError:
                await _json_error(send, 408, f"the request body did not arrive within {self.body_timeout:g} s")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                return b"".join(chunks)[: self.max_body_bytes + 1]

    def _environ(self, scope: Scope, body: bytes) -> dict:
        server = scope.get("server") or ("localhost", 80)
        client = scope.get("client") or ("", 0)
        environ = {
            "REQUEST_METHOD": scope["method"],
            "SCRIPT_NAME": scope.get("root_path", "").encode().decode("latin-1"),
            "PATH_INFO": scope["path"].encode().decode("latin-1"),
            "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
            "SERVER_NAME": str(server[0]),
            "SERVER_PORT": str(server[1]),
            "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
            "REMOTE_ADDR": str(client[0]),
            "REMOTE_PORT": str(client[1]),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": scope.get("scheme", "http"),
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
            "wsgi.input_terminated": True,
        }
        for raw_name, raw_value in scope["headers"]:
            name, value = raw_name.decode("latin-1").upper().replace("-", "_"), raw_value.decode("latin-1")
            if name == "TRANSFER_ENCODING":
                continue  # the body has been read whole: it has a length now
            key = name if name in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{name}"
            environ[key] = f"{environ[key]},{value}" if key in environ and key.startswith("HTTP_") else value
        declared = environ.get("CONTENT_LENGTH", "")
        if not (ascii_digits(declared) and int(declared) > self.max_body_bytes):
            environ["CONTENT_LENGTH"] = str(len(body))
        return environ

    def _run(self, environ: dict, send: Send, loop: asyncio.AbstractEventLoop) -> Callable[[], AsyncIterator] | None:
        """Runs the app in a pool thread and streams what it returns back through the event loop; or, for a view
        that asked for it (`ASYNC_BODY`), sends the head only and returns the body's factory to the loop."""

        def deliver(message: dict) -> None:
            asyncio.run_coroutine_threadsafe(send(message), loop).result()

        head: dict = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info=None):
            if exc_info and head.get("sent"):
                raise exc_info[1].with_traceback(exc_info[2])
            head.update(
                status=int(status.split(" ", 1)[0]),
                headers=[(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers],
            )
            return lambda data: None  # the legacy write() callable; Flask does not use it

        def start() -> None:
            if not head.get("sent"):
                deliver({"type": "http.response.start", "status": head["status"], "headers": head["headers"]})
                head["sent"] = True

        result = self.wsgi_app(environ, start_response)
        async_body = environ.get(ASYNC_BODY)
        if async_body is not None and head.get("status") == 200:
            if hasattr(result, "close"):
                result.close()  # the WSGI body (a generator never started) is not sent
            start()
            return async_body
        try:
            for chunk in result:
                if chunk:
                    start()
                    deliver({"type": "http.response.body", "body": chunk, "more_body": True})
            start()
            deliver({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if hasattr(result, "close"):
                result.close()
        return None


async def _serve_async_body(factory: Callable[[], AsyncIterator[bytes]], receive: Receive, send: Send) -> None:
    """Sends the iterator's chunks until it ends; a client that leaves first ends it (its `finally` runs)."""

    async def pump() -> None:
        body = factory()
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await body.aclose()

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    sending, leaving = asyncio.ensure_future(pump()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({sending, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sending, leaving):
            task.cancel()
        for outcome in await asyncio.gather(sending, leaving, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("async response body failed", exc_info=outcome)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


async def _json_error(send: Send, status: int, message: str) -> None:
    request_id = uuid.uuid4().hex
    body = json.dumps({"error": {"code": status, "message": message, "request_id": request_id}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
        (b"connection", b"close"),
        *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in EVERY_RESPONSE_HEADERS),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
