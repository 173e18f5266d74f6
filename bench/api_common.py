"""What the API benchmarks share: the running stack, an API process of their own, and a cheap HTTP load generator.

The load generator is asyncio over raw keep-alive HTTP/1.1 connections, one per simulated client: on a
2-core machine a `requests`-per-thread client would spend more CPU than the server it measures.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.loadgen import percentile
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, StackConfig

KEY = "local-dev-key"


def running_stack() -> StackConfig:
    """The stack at MAAS_STACK_DIR (started with `python -m emulators.stack up`); exits if there is none."""
    stack_dir = Path(os.environ.get("MAAS_STACK_DIR", ROOT / ".stack"))
    config = StackConfig.load(stack_dir)
    if config is None:
        sys.exit(f"no stack at {stack_dir}: start one with `python -m emulators.stack up` (MAAS_STACK_DIR)")
    return config


class BenchApiProcess:
    """The real API under gunicorn (`api_server.asgi:app`), on its own port, with the settings asked for."""

    def __init__(self, config: StackConfig, port: int, name: str = "bench-api-feature") -> None:
        self._config = config
        self._registry = ProcessRegistry(config.stack_dir)
        self.port = port
        self.name = name
        self.url = f"http://127.0.0.1:{port}"

    def start(self, **env: str) -> None:
        self.stop()
        full = {
            **self._config.service_env(),
            "PORT": str(self.port),
            "MAAS_API_HOST": "127.0.0.1",
            "MAAS_API_KEYS": KEY,
            "MAAS_LOG_SPOOL_DIR": str(self._config.stack_dir / f"{self.name}-spool"),
            **env,
        }
        argv = [sys.executable, "-m", "gunicorn", "--config", "api_server/gunicorn_conf.py", "api_server.asgi:app"]
        self._registry.start(self.name, argv, full, cwd=ROOT)
        self._registry.wait_until(self.name, lambda: http_ok(f"{self.url}/readyz"), timeout=90)

    def pids(self) -> list[int]:
        """gunicorn's master and its workers."""
        master = self._registry.pid(self.name)
        if master is None:
            return []
        children = Path(f"/proc/{master}/task/{master}/children")
        workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
        return [master, *workers]

    def stop(self) -> None:
        if self._registry.pid(self.name) is not None:
            self._registry.stop(self.name, timeout=60)


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of these processes so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def rss_mib(pid: int, field_name: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class LoadResult:
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    headers_seen: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    def summary(self) -> dict:
        done = sum(self.statuses.values())
        return {
            "requests": done,
            "rps": round(done / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": round(percentile(self.latencies_ms, 0.5), 2),
            "p99_ms": round(percentile(self.latencies_ms, 0.99), 2),
            "statuses": dict(sorted(self.statuses.items())),
            "errors": self.errors,
        }


def http_request(path: str, port: int, body: dict | None, headers: dict[str, str] | None = None) -> bytes:
    payload = json.dumps(body).encode() if body is not None else b""
    lines = [
        f"{'POST' if body is not None else 'GET'} {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Authorization: Bearer {KEY}",
        f"Content-Length: {len(payload)}",
    ]
    if body is not None:
        lines.append("Content-Type: application/json")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def _exchange(reader, writer, raw: bytes, watch_header: str | None) -> tuple[int, str | None]:
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, seen = 0, None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lowered = name.strip().lower()
        if lowered == b"content-length":
            length = int(value)
        elif watch_header and lowered == watch_header.encode():
            seen = value.strip().decode()
    if length:
        await reader.readexactly(length)
    return status, seen


async def _closed_loop(
    port: int, request_for, concurrency: int, seconds: float, warmup: float, watch_header: str | None, timeout: float
) -> LoadResult:
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    stop = start + seconds
    result = LoadResult(seconds=seconds)
    counter = iter(range(10**9))

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while (now := loop.time()) < stop:
                raw = request_for(next(counter))
                try:
                    status, seen = await asyncio.wait_for(_exchange(reader, writer, raw, watch_header), timeout)
                except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                    result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                ended = loop.time()
                if now >= start and ended <= stop:
                    result.latencies_ms.append((ended - now) * 1000)
                    result.statuses[status] = result.statuses.get(status, 0) + 1
                    if seen is not None:
                        result.headers_seen[seen] = result.headers_seen.get(seen, 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return result


def closed_loop(
    port: int,
    request_for,
    concurrency: int,
    seconds: float,
    warmup: float = 2.0,
    watch_header: str | None = None,
    timeout: float = 30.0,
) -> LoadResult:
    """`concurrency` keep-alive clients, each sending `request_for(n)` (raw bytes) as soon as its last returns;
    only requests sent after the warm-up and completed before the end count."""
    return asyncio.run(_closed_loop(port, request_for, concurrency, seconds, warmup, watch_header, timeout))


def all_at_once(port: int, raw_requests: list[bytes], timeout: float) -> tuple[LoadResult, float]:
    """Sends every request on its own connection at the same moment; waits for every answer."""

    async def run() -> tuple[LoadResult, float]:
        result = LoadResult(seconds=0.0)
        began = time.perf_counter()

        async def one(raw: bytes) -> None:
            sent = time.perf_counter()
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
                try:
                    status, _ = await asyncio.wait_for(_exchange(reader, writer, raw, None), timeout)
                finally:
                    writer.close()
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                return
            result.latencies_ms.append((time.perf_counter() - sent) * 1000)
            result.statuses[status] = result.statuses.get(status, 0) + 1

        await asyncio.gather(*(one(raw) for raw in raw_requests))
        result.seconds = time.perf_counter() - began
        return result, result.seconds

    return asyncio.run(run())
