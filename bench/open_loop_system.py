"""The open-loop sweep of `open_loop.py` through the whole system: HTTP API, Pub/Sub, the model's worker, replies.

One worker serves the model at a time, started with `MAAS_SCHEDULING=request` or `=step`; the stack's own
worker for that deployment is stopped meanwhile (its lock held, so the supervisor leaves it alone) and
started again at the end. Latency is the client's, from each request's scheduled arrival to its response.

    .venv/bin/python -m bench.open_loop_system --multiples 0.5 1.5 --requests 8 --json out.json   # a running stack
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx

from bench.open_loop import SCHEDULINGS, STEP_MIX, Arrival, median_ms
from bench.scenarios import fresh_seed
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, StackConfig, components, start_component, worker_env
from maas_client import Client

BENCH_WORKER = "bench-open-loop-worker"
# Enough threads that no arrival waits for a free one at the rates swept (each holds one request).
CLIENT_THREADS = 192


class SystemBackend:
    def __init__(self, config: StackConfig, api_url: str, key: str, model: str = "sd15-txt2img") -> None:
        self._config = config
        self._api_url, self._path = api_url, f"/v1/models/{model}:predict"
        self._key = key
        self._registry = ProcessRegistry(config.stack_dir)
        spec = config.catalog().get(model)
        index = list(config.catalog().deployments()).index(spec.deployment)
        self._stack_worker = f"worker-{spec.deployment}"
        # The benchmark's worker serves the measured model alone: its group's other models would only lengthen
        # each of the sweep's restarts.
        self._env = {**worker_env(config, spec.deployment, index), "MAAS_MODELS": spec.queue}
        self._ready = f"http://127.0.0.1:{config.worker_health_port(index)}/readyz"
        self._active: str | None = None
        self.mix = STEP_MIX
        self._local = threading.local()
        self._held = contextlib.ExitStack()
        self._held.enter_context(self._registry.lock(self._stack_worker))
        self._registry.stop(self._stack_worker, timeout=30)
        self.restarts = 0

    @property
    def active(self) -> str | None:
        """The scheduling its worker runs now (None: none started)."""
        return self._active

    def activate(self, scheduling: str) -> None:
        if self._active == scheduling:
            return
        self._stop_bench_worker()
        argv = [sys.executable, "-m", "model_worker"]
        self._registry.start(BENCH_WORKER, argv, {**self._env, "MAAS_SCHEDULING": scheduling}, cwd=ROOT)
        self._registry.wait_until(BENCH_WORKER, lambda: http_ok(self._ready), timeout=300)
        self._active = scheduling
        self.restarts += 1

    def _stop_bench_worker(self) -> None:
        # Killed, not drained: between runs it holds nothing (each run waits for its answers or gives them up), and
        # a drain waits out its pulls (seconds each switch of scheduling).
        if self._registry.pid(BENCH_WORKER) is not None:
            self._registry.stop(BENCH_WORKER, timeout=0)
        self._active = None

    def _client(self) -> Client:
        """One SDK client per sending thread (one keep-alive connection each), no retry: a refusal counts."""
        if not hasattr(self._local, "client"):
            self._local.client = Client(self._api_url, self._key, timeout=120.0, max_retries=0)
        return self._local.client

    def _call(self, steps: int, seed: int) -> bool:
        body = {"instances": [{"prompt": f"open loop {seed}"}],
                "parameters": {"seed": seed, "num_inference_steps": steps, "width": 64, "height": 64}}  # fmt: skip
        try:
            return self._client().raw("POST", self._path, json=body).status_code == 200
        except httpx.HTTPError:
            return False

    def lone(self, repeats: int, schedulings: tuple[str, ...] = SCHEDULINGS) -> dict[str, dict[str, float]]:
        """Lone latency per scheduling, one worker after the other (a restart between them costs seconds)."""
        seen: dict[str, dict[int, list[float]]] = {s: {n: [] for n in STEP_MIX} for s in schedulings}
        for scheduling in schedulings:
            self.activate(scheduling)
            self._call(STEP_MIX[0], fresh_seed())  # the first request through a fresh worker and API pays extra
            for _ in range(repeats):
                for steps in STEP_MIX:
                    began = time.perf_counter()
                    if self._call(steps, fresh_seed()):
                        seen[scheduling][steps].append(time.perf_counter() - began)
        return median_ms(seen)

    def run(self, scheduling: str, arrivals: list[Arrival], grace: float) -> tuple[dict[int, float], float]:
        self.activate(scheduling)
        answered: dict[int, float] = {}
        started = time.perf_counter()

        def call(index: int, arrival: Arrival) -> None:
            if self._call(arrival.steps, fresh_seed()):
                answered[index] = time.perf_counter()

        with ThreadPoolExecutor(CLIENT_THREADS, thread_name_prefix="open-loop") as pool:
            futures = []
            for index, arrival in enumerate(arrivals):
                delay = started + arrival.at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(call, index, arrival))
            wait(futures, timeout=grace)
        latencies = {i: at - (started + arrivals[i].at) for i, at in answered.items()}
        last = max(answered.values(), default=time.perf_counter())
        return latencies, max(last - started, arrivals[-1].at if arrivals else 0.0)

    def close(self) -> None:
        """Stops the benchmark's worker and starts the stack's own again."""
        try:
            self._stop_bench_worker()
            start_component(self._registry, components(self._config)[self._stack_worker])
        finally:
            self._held.close()


def main() -> None:
    from bench import open_loop
    from bench.scenarios import BenchApi, bench_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--multiples", type=float, nargs="+", default=list(open_loop.SYSTEM_RATE_MULTIPLES["quick"]))
    parser.add_argument("--requests", type=int, default=open_loop.SYSTEM_REQUESTS_PER_RATE["quick"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = bench_config()
    os.environ.update(config.client_env())
    api = BenchApi(config, ProcessRegistry(config.stack_dir / "bench"), config.api_port + 1)
    api.start("per-instance")
    try:
        backend = SystemBackend(config, api.url, config.api_keys.split(",")[0])
        result = open_loop.sweep(backend, tuple(args.multiples), args.requests, repeats=open_loop.LONE_REPEATS["quick"])
    finally:
        api.stop()
    open_loop.print_targets(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
