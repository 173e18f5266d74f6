"""The HTTP side of the benchmark: request bodies, per-thread callers, the API process per reply mode, worker metrics."""

from __future__ import annotations

import itertools
import os
import random
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.loadgen import Sample
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, StackConfig
from maas_client import Client, MaasError

# The tiny diffusion model at the size and step count the issue names: small enough for 2 CPU cores.
TINY_PARAMETERS = {"num_inference_steps": 4, "width": 64, "height": 64}
# Seeds never repeat within a run (nor, almost surely, across runs on one Redis): with the API's result
# cache, a repeated seeded request would be a cache hit, not the path being measured.
_SEEDS = itertools.count(random.SystemRandom().randrange(2**20, 2**30))
# How long the benchmark API may take to answer /readyz after it starts.
API_READY_SECONDS = 180


def fresh_seed() -> int:
    return next(_SEEDS)


def predict_body(model: str, seed: int) -> dict:
    """A one-image request with the given seed (callers pass `fresh_seed()`: no cache hit, no coalescing)."""
    parameters = {"seed": seed, **(TINY_PARAMETERS if model.startswith("sd15") else {"num_inference_steps": 4})}
    return {"instances": [{"prompt": f"bench request {seed}"}], "parameters": parameters}


def bench_client(api_url: str, key: str, timeout: float = 120.0) -> Client:
    """The SDK's client as a load thread's: one keep-alive connection, no retry (every answer is counted)."""
    return Client(api_url, key, timeout=timeout, max_retries=0)


def predict_caller(api_url: str, key: str, model: str, body: Callable[[int], dict]) -> Callable[[], Callable]:
    """One keep-alive client per load thread; a Sample per request, latency measured around the HTTP call
    (`Client.raw`: the status, timings and X-Cache exactly as the API answered)."""

    def make() -> Callable[[int], Sample]:
        client = bench_client(api_url, key)
        path = f"/v1/models/{model}:predict"

        def call(number: int) -> Sample:
            payload = body(number)
            started = time.perf_counter()
            try:
                response = client.raw("POST", path, json=payload)
            except httpx.HTTPError as exc:
                return Sample(started, time.perf_counter(), False, error=type(exc).__name__)
            ended = time.perf_counter()
            if response.status_code != 200:
                return Sample(started, ended, False, error=f"HTTP {response.status_code}")
            timings = dict(response.json().get("timings_ms") or {})
            if "X-Cache" in response.headers:
                timings["cache_hit"] = 1.0 if response.headers["X-Cache"].lower() == "hit" else 0.0
            return Sample(started, ended, True, timings)

        return call

    return make


def job_caller(api_url: str, key: str, model: str, poll_seconds: float = 0.01) -> Callable[[], Callable]:
    """Async jobs through the SDK: submit, then poll the job's status until it ends; latency is submit to result."""

    def make() -> Callable[[int], Sample]:
        client = bench_client(api_url, key, timeout=30.0)
        seed = predict_body(model, 0)["parameters"]

        def call(number: int) -> Sample:
            started = time.perf_counter()
            options = {"seed": fresh_seed(), "steps": seed["num_inference_steps"]}
            if "width" in seed:
                options["size"] = (seed["width"], seed["height"])
            try:
                job = client.submit(model, f"bench request {options['seed']}", **options)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    status = job.status().status
                    if status == "succeeded":
                        return Sample(started, time.perf_counter(), True)
                    if status in ("failed", "cancelled", "expired"):
                        return Sample(started, time.perf_counter(), False, error=f"job {status}")
                    time.sleep(poll_seconds)
            except MaasError as exc:
                return Sample(started, time.perf_counter(), False, error=type(exc).__name__)
            return Sample(started, time.perf_counter(), False, error="job not done in 60s")

        return call

    return make


def cache_available(api_url: str, key: str) -> bool:
    """The result cache exists when a repeated seeded request says `X-Cache: hit`."""
    seed = fresh_seed()
    try:
        with bench_client(api_url, key, timeout=30.0) as client:
            results = [client.predict("noop", f"bench request {seed}", seed=seed, steps=4) for _ in range(2)]
    except MaasError:
        return False
    return (results[-1].cache or "").lower() == "hit"


def jobs_available(api_url: str, key: str) -> bool:
    """Async jobs exist when submitting one answers 202."""
    seed = fresh_seed()
    with bench_client(api_url, key, timeout=30.0) as client:
        response = client.raw("POST", "/v1/models/noop/jobs", json=predict_body("noop", seed))
    return response.status_code == 202


class BenchApi:
    """The API for one reply mode, run by the benchmark (`bench.counted_api`: admin operations counted)."""

    def __init__(self, config: StackConfig, registry: ProcessRegistry, port: int) -> None:
        self._config = config
        self._registry = registry
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.mode: str | None = None

    def start(self, mode: str) -> None:
        self.stop()
        env = {
            **self._config.service_env(),
            "MAAS_REPLY_MODE": mode,
            "PORT": str(self.port),
            "MAAS_API_WORKERS": str(self._config.api_workers),
        }
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "--config",
            "api_server/process/gunicorn_conf.py",
            "bench.counted_api:app",
        ]
        self._registry.start("bench-api", argv, env, cwd=ROOT)
        # A bound, not a pace: on a crowded machine (a test suite beside it) the app's import alone took over 60 s.
        self._registry.wait_until("bench-api", lambda: http_ok(f"{self.url}/readyz"), timeout=API_READY_SECONDS)
        with bench_client(self.url, "readyz-needs-no-key", timeout=5.0) as client:
            shown = client.raw("GET", "/readyz").json().get("reply_mode")
        if shown != mode:
            raise RuntimeError(f"the benchmark API runs in {shown!r} mode, not {mode!r}")
        self.mode = mode

    def stop(self) -> None:
        if self._registry.pid("bench-api") is not None:
            self._registry.stop("bench-api")
        self.mode = None


def worker_health_port(config: StackConfig, model: str) -> int:
    catalog = config.catalog()
    return config.worker_health_port(list(catalog.deployments()).index(catalog.get(model).deployment))


def worker_batches(config: StackConfig, model: str) -> tuple[float, float]:
    """(images run, pipeline calls) for `model`, from its worker's /metrics: the batch sizes it really ran."""
    url = f"http://127.0.0.1:{worker_health_port(config, model)}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback only
            text = response.read().decode()
    except OSError:
        return 0.0, 0.0

    def value(name: str) -> float:
        found = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return value("maas_worker_batch_images_sum"), value("maas_worker_batch_images_count")


def tiny_model_dir(config: StackConfig, model: str) -> Path:
    return config.tiny_model_dir / model


def bench_config() -> StackConfig:
    """The bench's own stack: its ports and directory, unless the environment names others; a stack running there
    as it was started (its keys and catalog: a test's stack for `--smoke`)."""
    env = dict(os.environ)
    env.setdefault("MAAS_STACK_PORT_OFFSET", "12000")  # below 32768, where ephemeral ports begin
    env.setdefault("MAAS_STACK_DIR", str(ROOT / ".stack-bench"))
    recorded = StackConfig.load(Path(env["MAAS_STACK_DIR"]))
    if recorded is not None and http_ok(f"{recorded.api_url}/readyz"):
        return recorded
    return StackConfig.from_env(env)
