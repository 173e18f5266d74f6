"""Idle and slow connections against the API: a predict's latency alone and beside a thousand of them.

`SlowClients` holds `count` connections to the API open, half sending a request line and one header and
then nothing, half sending complete headers and a few bytes of a large body and then nothing; whenever the
API closes one (its header or body read timeout), another is opened, as a slowloris client does. The
scenario measures sequential predicts (noop model, so the API is what is timed) before, during and after,
and prints the latencies side by side; every predict must still be answered.
"""

from __future__ import annotations

import selectors
import socket
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx

from maas_client import Client

HEADER_ONLY = b"POST /v1/models/noop:predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _slow_body(authorization: str) -> bytes:
    return (
        b"POST /v1/models/noop:predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: {authorization}\r\n".encode()
        + b'Content-Length: 100000\r\n\r\n{"instances": ['
    )


@dataclass
class SlowClients:
    """`count` connections that never finish their request; reopened when the server closes them."""

    host: str
    port: int
    count: int
    authorization: str = "Bearer none"
    opened: int = 0
    closed_by_server: int = 0
    refused: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _sockets: dict = field(default_factory=dict)

    def _open(self, index: int, selector: selectors.BaseSelector) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=5)
            sock.sendall(HEADER_ONLY if index % 2 == 0 else _slow_body(self.authorization))
            sock.setblocking(False)
        except OSError:
            self.refused += 1
            return
        self._sockets[sock] = index
        selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _hold(self) -> None:
        selector = selectors.DefaultSelector()
        for index in range(self.count):
            self._open(index, selector)
        while not self._stop.is_set():
            for key, _ in selector.select(timeout=0.5):
                sock = key.fileobj
                index = self._sockets.pop(sock)
                selector.unregister(sock)
                sock.close()  # answered (408) or closed by the server: a slowloris client comes back
                self.closed_by_server += 1
                if not self._stop.is_set():
                    self._open(index, selector)
        for sock in list(self._sockets):
            sock.close()
        self._sockets.clear()
        selector.close()

    def __enter__(self) -> SlowClients:
        self._thread = threading.Thread(target=self._hold, name="slow-clients", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.opened + self.refused < self.count and time.monotonic() < deadline:
            time.sleep(0.1)
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def open_now(self) -> int:
        return len(self._sockets)


@dataclass
class Latencies:
    label: str
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        if not self.seconds:
            return f"{self.label}: no answer ({len(self.failures)} failures)"
        ms = sorted(s * 1000 for s in self.seconds)
        p95 = ms[min(len(ms) - 1, int(len(ms) * 0.95))]
        return (
            f"{self.label}: {len(ms)} predicts, p50 {statistics.median(ms):.1f} ms, p95 {p95:.1f} ms, "
            f"{len(self.failures)} failed"
        )

    @property
    def p50(self) -> float:
        return statistics.median(self.seconds) * 1000 if self.seconds else float("inf")


def sequential_predicts(api_url: str, headers: dict[str, str], seconds: float, label: str) -> Latencies:
    """Closed loop at concurrency 1, each predict a cache miss, each answer checked."""
    result = Latencies(label)
    key = headers["Authorization"].removeprefix("Bearer ").strip()
    deadline = time.monotonic() + seconds
    with Client(api_url, key, timeout=30.0, max_retries=0) as client:  # the SDK: one keep-alive connection
        while time.monotonic() < deadline:
            body = {"instances": [{"prompt": f"slow-clients {uuid.uuid4().hex}"}], "parameters": {"seed": 1}}
            started = time.perf_counter()
            try:
                response = client.raw(
                    "POST", "/v1/models/noop:predict", json=body, headers={"Cache-Control": "no-cache"}
                )
            except httpx.HTTPError as exc:
                result.failures.append(type(exc).__name__)
                continue
            if response.status_code == 200 and response.json()["predictions"]:
                result.seconds.append(time.perf_counter() - started)
            else:
                result.failures.append(str(response.status_code))
    return result
