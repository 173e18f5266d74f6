"""The SDK's retry policy and error mapping, over httpx's mock transport (no server), and `wait`'s timeout
over a fake event stream that stays silent."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from maas_client import (
    AsyncClient,
    Client,
    ConnectionFailed,
    RateLimited,
    ServiceUnavailable,
    Timeout,
    Unauthorized,
    ValidationError,
)
from maas_client._core import EventParser, ProgressGate, RetryPolicy
from maas_client.types import JobView

PREDICTION = {"image_b64": "iVBORw0KGgo=", "mime_type": "image/png", "seed": 1, "width": 8, "height": 8}
OK = {"predictions": [PREDICTION], "model": "noop", "model_version": "1", "request_id": "r1", "timings_ms": {}}


def client_over(handler) -> Client:
    client = Client("http://api.test", "key", transport=httpx.MockTransport(handler), max_retries=3)
    client.retry.base_seconds = client.retry.max_seconds = 0.0  # no waiting in unit tests
    return client


def test_errors_map_to_their_types_with_the_apis_message_and_field():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            422, json={"error": {"code": 422, "message": "at most 1024", "field": "parameters.width"}}
        )

    with client_over(handler) as client, pytest.raises(ValidationError) as caught:
        client.predict("noop", "a cat", size="2048x64")
    assert caught.value.field == "parameters.width" and caught.value.message == "at most 1024"
    assert caught.value.status == 422


def test_a_401_is_never_retried():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(401, json={"error": {"code": 401, "message": "invalid API key"}})

    with client_over(handler) as client, pytest.raises(Unauthorized, match="invalid API key"):
        client.models()
    assert len(calls) == 1


def test_429_and_503_are_retried_with_the_same_idempotency_key_until_success():
    keys = []
    answers = iter(
        [
            httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"code": 429, "message": "slow down"}}),
            httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"code": 503, "message": "later"}}),
            httpx.Response(200, json=OK),
        ]
    )

    def handler(request):
        keys.append(request.headers["Idempotency-Key"])
        return next(answers)

    with client_over(handler) as client:
        assert client.predict("noop", "a cat").request_id == "r1"
    assert len(keys) == 3 and len(set(keys)) == 1 and keys[0].startswith("maas-sdk-")


def test_each_call_gets_its_own_idempotency_key():
    keys = []

    def handler(request):
        keys.append(request.headers["Idempotency-Key"])
        return httpx.Response(200, json=OK)

    with client_over(handler) as client:
        client.predict("noop", "a cat")
        client.predict("noop", "a cat")
    assert len(set(keys)) == 2


def test_retries_stop_after_max_retries_with_the_last_error():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"code": 429, "message": "over"}})

    with client_over(handler) as client, pytest.raises(RateLimited) as caught:
        client.models()
    assert len(calls) == 4 and caught.value.retry_after == 0


def test_a_dropped_connection_is_retried_then_reported_in_one_line():
    calls = []

    def handler(request):
        calls.append(request)
        raise httpx.ConnectError("Connection refused")

    with client_over(handler) as client, pytest.raises(ConnectionFailed, match="cannot reach http://api.test"):
        client.models()
    assert len(calls) == 4


def test_a_409_without_retry_after_is_final_and_one_with_it_is_retried():
    policy = RetryPolicy(max_retries=3, base_seconds=0.0)
    finished = httpx.Response(409, json={"error": {"code": 409, "message": "already finished"}})
    running = httpx.Response(409, headers={"Retry-After": "1"}, json={})
    assert policy.delay(0, safe=True, response=finished) is None
    assert policy.delay(0, safe=True, response=running) == 1.0
    assert policy.delay(0, safe=False, response=running) is None  # never without an Idempotency-Key


def test_backoff_is_jittered_grows_and_is_capped_and_retry_after_wins():
    policy = RetryPolicy(max_retries=10, base_seconds=1.0, max_seconds=8.0, random=random.Random(7))
    delays = [policy.backoff(attempt) for attempt in range(8)]
    assert all(0 <= delay <= min(8.0, 2**attempt) for attempt, delay in enumerate(delays))
    assert len(set(delays)) == len(delays)
    slow = httpx.Response(503, headers={"Retry-After": "5"})
    assert 5.0 <= policy.delay(0, safe=True, response=slow) <= 8.0
    assert policy.delay(0, safe=True, response=httpx.Response(500)) is None


def test_server_error_codes_map_to_server_error_types():
    def handler(request):
        return httpx.Response(503, json={"error": {"code": 503, "message": "queue unreachable"}})

    client = Client("http://api.test", "key", transport=httpx.MockTransport(handler), max_retries=0)
    with client, pytest.raises(ServiceUnavailable, match="queue unreachable"):
        client.models()


def test_event_parser_and_progress_gate():
    parser = EventParser()
    lines = ["retry: 2000", "", ": keepalive", "", "id: 3", "event: running", 'data: {"a": 1}', ""]
    events = [event for line in lines if (event := parser.feed(line)) is not None]
    assert [(e.event, e.id, e.json()) for e in events] == [("running", "3", {"a": 1})] and parser.last_id == "3"
    seen = []
    gate = ProgressGate(lambda step, total: seen.append(step))
    base = {"id": "j", "model": "m", "model_version": "1", "created_at": "", "links": {"self": "/v1/jobs/j"}}
    for step in (1, 3, 3, 2, 5):
        gate.update(JobView.model_validate({**base, "status": "running", "progress": {"step": step, "total": 9}}))
    assert seen == [1, 3, 5]
    gate.update(JobView.model_validate({**base, "status": "succeeded"}))
    assert seen == [1, 3, 5, 9]  # a job that succeeds ends at its total


def test_only_an_https_url_loads_certificates():
    from maas_client import _core

    assert _core.verify_tls("https://maas.example.com") and not _core.verify_tls("http://127.0.0.1:8080")


def test_a_safe_call_retries_past_three_attempts_until_it_succeeds_within_its_deadline():
    """An API instance restarting refuses connections for seconds: the call rides it out, not 3 quick tries."""
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) <= 10:
            raise httpx.ConnectError("Connection refused")
        return httpx.Response(200, json=OK)

    client = Client("http://api.test", "key", transport=httpx.MockTransport(handler))
    client.retry.base_seconds = client.retry.max_seconds = 0.0
    with client:
        assert client.predict("noop", "a cat").request_id == "r1"
    assert len(calls) == 11 and len({request.headers["Idempotency-Key"] for request in calls}) == 1
    assert client.retry.deadline_seconds == 60.0 and client.retry.max_retries is None  # the documented default


def test_retries_stop_at_the_clients_deadline_or_the_calls_own(monkeypatch):
    """Counted on a clock that moves 1/8 s per attempt, not on the machine's: 0.75 s is six attempts, however busy
    the machine is; a stop by count (three retries: four attempts) or at the client's 60 s (480) differs."""
    from maas_client import _core

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(_core, "time", SimpleNamespace(monotonic=lambda: clock.now))
    calls = []

    def handler(request):
        calls.append(request)
        clock.now += 0.125  # exact in binary: no attempt more or less by rounding
        raise httpx.ConnectError("Connection refused")

    client = Client("http://api.test", "key", transport=httpx.MockTransport(handler), retry_deadline=0.75)
    client.retry.base_seconds = client.retry.max_seconds = 0.0
    with client:
        with pytest.raises(ConnectionFailed):
            client.models()
        assert len(calls) == 6 and clock.now == 0.75  # a deadline, not a count
        client.retry.deadline_seconds = 60.0
        calls.clear()
        with pytest.raises(ConnectionFailed):
            client.predict("noop", "a cat", retry_deadline=0.25)
        assert len(calls) == 2  # the call's own 0.25 s, not the client's 60


def test_a_retry_after_beyond_the_deadline_is_not_waited_for():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(503, headers={"Retry-After": "30"}, json={"error": {"code": 503, "message": "later"}})

    client = Client("http://api.test", "key", transport=httpx.MockTransport(handler), retry_deadline=2)
    with client, pytest.raises(ServiceUnavailable) as caught:
        client.models()
    assert len(calls) == 1 and caught.value.retry_after == 30


class EventStreamServer:
    """A fake API whose job event streams answer 200 and then never send an event: nothing at all, or only
    keep-alive comments."""

    def __init__(self, keepalive_seconds: float | None = None) -> None:
        self._keepalive = keepalive_seconds
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            while not self._stop.wait(self._keepalive or 3600):
                conn.sendall(b"d\r\n: keepalive\n\n\r\n")

    def close(self) -> None:
        self._stop.set()
        self._server.close()


@pytest.mark.parametrize("keepalive_seconds", [None, 0.2], ids=["silent", "only-keepalives"])
def test_wait_ends_at_its_timeout_when_the_event_stream_says_nothing(keepalive_seconds):
    server = EventStreamServer(keepalive_seconds)
    outcome: list[BaseException] = []

    def wait() -> None:
        with Client(server.url, "key") as client:
            try:
                client.job("j1").wait(timeout=1)
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                outcome.append(exc)

    began = time.monotonic()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    elapsed = time.monotonic() - began
    server.close()
    assert not waiter.is_alive(), "wait(timeout=1) still waiting after 30 s"  # the read timeout is 150 s
    assert len(outcome) == 1 and isinstance(outcome[0], Timeout), outcome
    assert elapsed >= 1  # not before its timeout; the join's 30 s tells its end from the read timeout's


def test_the_asyncio_wait_ends_at_its_timeout_on_a_silent_stream():
    server = EventStreamServer()

    async def wait() -> None:
        async with AsyncClient(server.url, "key") as client:
            await client.job("j1").wait(timeout=1)

    began = time.monotonic()
    with pytest.raises(Timeout):
        asyncio.run(asyncio.wait_for(wait(), timeout=30))
    server.close()
    assert time.monotonic() - began >= 1  # not before its timeout; `wait_for`'s 30 s ends a wait on the 150 s read


def test_the_retry_deadline_comes_from_maas_retry_deadline_unless_given(monkeypatch):
    monkeypatch.delenv("MAAS_RETRY_DEADLINE", raising=False)
    assert Client("http://api.test", "key").retry.deadline_seconds == 60.0
    monkeypatch.setenv("MAAS_RETRY_DEADLINE", "2.5")
    assert Client("http://api.test", "key").retry.deadline_seconds == 2.5
    assert AsyncClient("http://api.test", "key").retry.deadline_seconds == 2.5
    assert Client("http://api.test", "key", retry_deadline=9).retry.deadline_seconds == 9
    monkeypatch.setenv("MAAS_RETRY_DEADLINE", "soon")
    with pytest.raises(ValueError, match="MAAS_RETRY_DEADLINE"):
        Client("http://api.test", "key")
