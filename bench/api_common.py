"""What the API benchmarks share: the running stack, an API process of their own, and an asyncio load generator.

The load generator is the SDK's asyncio client (`maas_client.AsyncClient.raw`: one HTTP call, its status and
headers as they came, no retry), with as many keep-alive connections as simulated clients, all on one event
loop: on a 2-core machine a `requests`-per-thread client would spend more CPU than the server it measures.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.loadgen import percentile
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, StackConfig
from maas_client import AsyncClient

KEY = "local-dev-key"


def running_stack() -> StackConfig:
    """The stack at MAAS_STACK_DIR (started with `python -m emulators.stack up`); exits if there is none."""
    stack_dir = Path(os.environ.get("MAAS_STACK_DIR", ROOT / ".stack"))
    config = StackConfig.load(stack_dir)
    if config is None:
        sys.exit(f"no stack at {stack_dir}: start one with `python -m emulators.stack up` (MAAS_STACK_DIR)")
    return config


class BenchApiProcess:
    """The real API under gunicorn (`api_server.process.asgi:app`), on its own port, with the settings asked for."""

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
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "--config",
            "api_server/process/gunicorn_conf.py",
            "api_server.process.asgi:app",
        ]
        self._registry.start(self.name, argv, full, cwd=ROOT)
        self._registry.wait_until(self.name, lambda: http_ok(f"{self.url}/readyz"), timeout=180)

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


@dataclass(frozen=True)
class ApiCall:
    """One request to the API: a POST with `body`, else a GET."""

    path: str
    body: dict | None = None
    headers: dict[str, str] | None = None

    @property
    def method(self) -> str:
        return "POST" if self.body is not None else "GET"


def load_client(port: int, connections: int, timeout: float) -> AsyncClient:
    """The SDK's asyncio client for the benchmark's API: every client a connection, no retry (each answer counts)."""
    return AsyncClient(f"http://127.0.0.1:{port}", KEY, timeout=timeout, max_retries=0, max_connections=connections)


async def _exchange(client: AsyncClient, call: ApiCall, watch_header: str | None) -> tuple[int, str | None]:
    response = await client.raw(call.method, call.path, json=call.body, headers=call.headers)
    return response.status_code, response.headers.get(watch_header) if watch_header else None


async def _closed_loop(
    port: int, request_for, concurrency: int, seconds: float, warmup: float, watch_header: str | None, timeout: float
) -> LoadResult:
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    stop = start + seconds
    result = LoadResult(seconds=seconds)
    counter = iter(range(10**9))

    async def one_client(client: AsyncClient) -> None:
        while (now := loop.time()) < stop:
            try:
                status, seen = await _exchange(client, request_for(next(counter)), watch_header)
            except httpx.HTTPError as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                continue
            ended = loop.time()
            if now >= start and ended <= stop:
                result.latencies_ms.append((ended - now) * 1000)
                result.statuses[status] = result.statuses.get(status, 0) + 1
                if seen is not None:
                    result.headers_seen[seen] = result.headers_seen.get(seen, 0) + 1

    async with load_client(port, concurrency, timeout) as client:
        await asyncio.gather(*(one_client(client) for _ in range(concurrency)))
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
    """`concurrency` keep-alive clients, each sending `request_for(n)` (an `ApiCall`) as soon as its last returns;
    only requests sent after the warm-up and completed before the end count."""
    return asyncio.run(_closed_loop(port, request_for, concurrency, seconds, warmup, watch_header, timeout))


def all_at_once(port: int, calls: list[ApiCall], timeout: float) -> tuple[LoadResult, float]:
    """Sends every request on its own connection at the same moment; waits for every answer."""

    async def run() -> tuple[LoadResult, float]:
        result = LoadResult(seconds=0.0)
        began = time.perf_counter()

        async def one(client: AsyncClient, call: ApiCall) -> None:
            sent = time.perf_counter()
            try:
                status, _ = await _exchange(client, call, None)
            except httpx.HTTPError as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                return
            result.latencies_ms.append((time.perf_counter() - sent) * 1000)
            result.statuses[status] = result.statuses.get(status, 0) + 1

        async with load_client(port, len(calls), timeout) as client:
            await asyncio.gather(*(one(client, call) for call in calls))
        result.seconds = time.perf_counter() - began
        return result, result.seconds

    return asyncio.run(run())
