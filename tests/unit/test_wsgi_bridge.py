"""The WSGI bridge (api_server/process/wsgi_bridge.py): the request is read whole before the app runs, within a deadline."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from flask import Flask, Response, request

from api_server.process.wsgi_bridge import ASYNC_BODY, RECEIVED_AT, WsgiBridge


def flask_app(max_bytes: int = 100) -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_bytes

    @app.post("/echo")
    def echo():
        return {
            "body": request.get_data(as_text=True),
            "length": request.content_length,
            "chunked": "HTTP_TRANSFER_ENCODING" in request.environ,
        }

    @app.get("/stream")
    def stream():
        return Response((f"part {i};" for i in range(3)), content_type="text/plain")

    return app


def call(bridge: WsgiBridge, method: str, path: str, messages: list[dict], headers=()) -> tuple[int, dict, bytes]:
    """One request through the bridge; `messages` are what the client sends, then it goes silent."""
    scope = {"type": "http", "method": method, "path": path, "headers": list(headers), "query_string": b""}
    sent: list[dict] = []

    async def run() -> None:
        pending = list(messages)

        async def receive() -> dict:
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)  # a slow client: nothing more arrives
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await bridge(scope, receive, send)

    asyncio.run(run())
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_a_body_sent_in_pieces_reaches_the_app_whole_with_its_length():
    bridge = WsgiBridge(flask_app(), threads=2, max_body_bytes=100, body_timeout=5)
    pieces = [{"type": "http.request", "body": part, "more_body": True} for part in (b"ab", b"cd")]
    status, _, body = call(
        bridge,
        "POST",
        "/echo",
        [*pieces, {"type": "http.request", "body": b"e", "more_body": False}],
        headers=[(b"transfer-encoding", b"chunked")],
    )
    assert status == 200
    assert json.loads(body) == {"body": "abcde", "length": 5, "chunked": False}


def test_a_body_over_the_limit_is_the_apps_413_without_being_read_whole():
    bridge = WsgiBridge(flask_app(max_bytes=10), threads=2, max_body_bytes=10, body_timeout=5)
    chunks = [{"type": "http.request", "body": b"x" * 8, "more_body": True} for _ in range(3)]
    status, _, _ = call(bridge, "POST", "/echo", chunks)  # never finishes: the limit, not the end, stops it
    assert status == 413
    declared = [(b"content-length", b"1000000")]
    assert call(bridge, "POST", "/echo", [], headers=declared)[0] == 413


def test_a_body_that_stops_arriving_is_a_json_408_not_to_be_sniffed():
    bridge = WsgiBridge(flask_app(), threads=2, max_body_bytes=100, body_timeout=0.2)
    status, headers, body = call(bridge, "POST", "/echo", [{"type": "http.request", "body": b"{", "more_body": True}])
    assert status == 408 and headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    assert json.loads(body)["error"]["code"] == 408


def test_a_streamed_answer_arrives_in_order():
    bridge = WsgiBridge(flask_app(), threads=2, max_body_bytes=100, body_timeout=5)
    status, headers, body = call(bridge, "GET", "/stream", [{"type": "http.request", "body": b"", "more_body": False}])
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert body == b"part 0;part 1;part 2;"


def test_an_async_body_is_served_from_the_loop_and_ends_when_the_client_leaves():
    app, closed = Flask(__name__), []

    @app.get("/events")
    def events():
        async def body():
            try:
                yield b"first;"
                await asyncio.sleep(3600)  # waits on the loop, holding no thread, until the client leaves
            finally:
                closed.append(True)

        request.environ[ASYNC_BODY] = body
        return Response(iter(["the WSGI body is never sent"]), content_type="text/event-stream")

    bridge = WsgiBridge(app, threads=1, max_body_bytes=100, body_timeout=5)
    sent: list[dict] = []

    async def run() -> None:
        messages = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            while not any(m.get("body") for m in sent):
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}  # the client leaves once it has the first chunk

        async def send(message: dict) -> None:
            sent.append(message)

        await bridge({"type": "http", "method": "GET", "path": "/events", "headers": [], "query_string": b""},
                     receive, send)  # fmt: skip

    asyncio.run(asyncio.wait_for(run(), 10))
    assert sent[0]["status"] == 200 and b"".join(m.get("body", b"") for m in sent[1:]) == b"first;"
    assert closed == [True]


def test_a_request_that_waits_for_a_thread_carries_when_it_arrived_not_when_a_thread_took_it():
    # One thread, held by a first request until a second has arrived: the second's arrival, as the app sees it, is
    # before the moment the first let the thread go (the app counts that wait in the request's deadline).
    app = Flask(__name__)
    holding, second_arrived = threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    @app.post("/hold")
    def hold():
        holding.set()
        assert second_arrived.wait(30)
        seen["released"] = time.perf_counter()
        return "held"

    @app.post("/next")
    def after():
        seen["received"] = request.environ[RECEIVED_AT]
        seen["ran"] = time.perf_counter()
        return "next"

    bridge = WsgiBridge(app, threads=1, max_body_bytes=100, body_timeout=5)
    whole = [{"type": "http.request", "body": b"", "more_body": False}]

    async def run() -> None:
        async def one(path: str) -> None:
            scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
            pending = list(whole)

            async def receive() -> dict:
                return pending.pop(0) if pending else {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                pass

            await bridge(scope, receive, send)

        first = asyncio.create_task(one("/hold"))
        assert await asyncio.to_thread(holding.wait, 30)  # the first holds the only thread
        second = asyncio.create_task(one("/next"))
        for _ in range(3000):  # until the second is whole and waits for the thread (30 s at most)
            if bridge._pool._work_queue.qsize():
                break
            await asyncio.sleep(0.01)
        second_arrived.set()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert seen["received"] < seen["released"] < seen["ran"]
