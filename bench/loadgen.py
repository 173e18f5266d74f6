"""A closed-loop load generator: N threads, each sending its next request the moment its last one returns.

Concurrency is held exactly (each thread has one request in flight for the whole window, and its own
keep-alive session), latency is measured on the client, and only what happens inside the measurement
window counts: requests that complete during the warm-up are discarded.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it; `timings` is the server's `timings_ms`, when it sent one."""

    started: float
    ended: float
    ok: bool
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1000


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mean_in_flight(samples: list[Sample], window: tuple[float, float]) -> float:
    """Average number of requests in flight over the window (the time each request overlaps it, summed)."""
    start, end = window
    if end <= start:
        return 0.0
    busy = sum(max(0.0, min(s.ended, end) - max(s.started, start)) for s in samples)
    return busy / (end - start)


def summarize(samples: list[Sample], window: tuple[float, float], concurrency: int) -> dict:
    """Requests/s, latency percentiles and errors of the requests that completed inside the window."""
    start, end = window
    done = [s for s in samples if start <= s.ended <= end]
    ok = [s.latency_ms for s in done if s.ok]
    seconds = end - start
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "errors": sum(1 for s in done if not s.ok),
        "seconds": round(seconds, 2),
        "rps": len(ok) / seconds if seconds > 0 else 0.0,
        "p50_ms": percentile(ok, 0.50),
        "p95_ms": percentile(ok, 0.95),
        "p99_ms": percentile(ok, 0.99),
        "mean_in_flight": round(mean_in_flight(samples, window), 2),
        "error_examples": sorted({s.error for s in done if s.error})[:3],
    }


def run_closed_loop(
    make_caller: Callable[[], Callable[[int], Sample]],
    concurrency: int,
    seconds: float,
    warmup_seconds: float,
    max_requests: int | None = None,
) -> tuple[list[Sample], tuple[float, float]]:
    """Runs `concurrency` threads for warm-up plus `seconds`; returns every sample and the measurement window.

    `make_caller` is called once per thread (a session per thread: keep-alive); the caller gets a running
    request number and returns a Sample. `max_requests` stops early (bounded scenarios on slow models).
    """
    samples: list[Sample] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    began = time.perf_counter()
    window_start = began + warmup_seconds
    stop_at = window_start + seconds
    measured = {"count": 0, "stopped_at": None}
    stop = threading.Event()

    def loop() -> None:
        call = make_caller()
        while not stop.is_set() and time.perf_counter() < stop_at:
            with lock:
                number = next(counter)
            sample = call(number)
            with lock:
                samples.append(sample)
                if sample.ended >= window_start:
                    measured["count"] += 1
                    if max_requests is not None and measured["count"] >= max_requests and not stop.is_set():
                        measured["stopped_at"] = sample.ended
                        stop.set()

    threads = [threading.Thread(target=loop, name=f"load-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The window closes at the deadline, or when the request that reached `max_requests` completed.
    window_end = min(stop_at, measured["stopped_at"] or stop_at)
    return samples, (window_start, window_end)
