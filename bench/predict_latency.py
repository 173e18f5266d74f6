"""HTTP predict latency through the whole local stack, split into model time and serving overhead.

Starts its own stack (ports offset by 20,000) with the reply mode given, sends seeded 64x64 text-to-image
requests at each concurrency, and prints what the client saw beside what the worker spent in the model.

    .venv/bin/python -m bench.predict_latency --requests 40 --concurrency 1 4 --reply-mode per-request per-instance
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from emulators.stack import StackConfig, down, up
from maas_client import Client

KEY = "bench-key"


def send(api_url: str, seed: int) -> dict:
    body = {
        "instances": [{"prompt": "bench"}],
        "parameters": {"seed": seed, "num_inference_steps": 4, "width": 64, "height": 64},
    }
    started = time.perf_counter()
    with Client(api_url, KEY, timeout=120.0, max_retries=0) as client:
        response = client.raw("POST", "/v1/models/sd15-txt2img:predict", json=body)
    response.raise_for_status()
    timings = response.json()["timings_ms"]
    return {"client_ms": (time.perf_counter() - started) * 1000, **timings}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[int(fraction * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reply-mode", nargs="+", default=["per-request", "per-instance"])
    parser.add_argument("--port-offset", type=int, default=20000)
    args = parser.parse_args()
    print(
        f"{'reply mode':<14}{'conc':>5}{'client p50':>12}{'p95':>8}{'model p50':>11}{'overhead p50':>14}{'queue p50':>11}{'req/s':>8}"
    )
    for mode in args.reply_mode:
        config = StackConfig(
            stack_dir=Path(tempfile.mkdtemp(prefix="maas-bench-")),
            port_offset=args.port_offset,
            reply_mode=mode,
            api_keys=KEY,
            api_keys_from_env=True,
        )
        up(config)
        try:
            for concurrency in args.concurrency:
                for seed in range(3):
                    send(config.api_url, seed)  # warm up
                started = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    rows = list(pool.map(send, [config.api_url] * args.requests, range(args.requests)))
                elapsed = time.perf_counter() - started
                client = [r["client_ms"] for r in rows]
                model = [r["inference"] for r in rows]
                overhead = [r["client_ms"] - r["inference"] for r in rows]
                queue = [r["queue"] for r in rows]
                print(
                    f"{mode:<14}{concurrency:>5}{statistics.median(client):>12.1f}{percentile(client, 0.95):>8.1f}"
                    f"{statistics.median(model):>11.1f}{statistics.median(overhead):>14.1f}"
                    f"{statistics.median(queue):>11.1f}{args.requests / elapsed:>8.1f}",
                    flush=True,
                )
        finally:
            down(config)


if __name__ == "__main__":
    main()
