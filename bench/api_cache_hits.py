"""Cache hits at concurrency 32: requests/s of one API instance answering a seeded request from Redis.

    MAAS_STACK_DIR=/tmp/stack-f .venv/bin/python -m bench.api_cache_hits [--seconds 10] [--configs 1x32 2x32 2x64]

Starts the API under gunicorn on its own port (`WORKERSxTHREADS` per configuration) beside a running stack,
stores one entry (one noop inference), then 32 keep-alive clients repeat that request. Prints requests/s,
latency, the CPU seconds the API and the load generator each used per request, and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.api_common import ApiCall, BenchApiProcess, closed_loop, cpu_seconds, running_stack

BODY = {"instances": [{"prompt": "bench cache hit"}], "parameters": {"seed": 4242, "num_inference_steps": 4}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--configs", nargs="+", default=["1x32", "2x32", "2x64"], help="WORKERSxTHREADS")
    parser.add_argument("--port", type=int, default=int(os.environ.get("MAAS_BENCH_API_PORT", "30180")))
    args = parser.parse_args()
    api = BenchApiProcess(running_stack(), args.port)
    path = "/v1/models/noop:predict"
    call = ApiCall(path, BODY)
    print(f"cache hits on {path}, concurrency {args.concurrency}, {args.seconds:.0f} s per configuration")
    print(f"{'workers x threads':>18} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'hits':>7} {'API cpu ms/req':>15} "
          f"{'client cpu ms/req':>18} {'load avg':>9}")  # fmt: skip
    try:
        for config in args.configs:
            workers, threads = config.split("x")
            api.start(MAAS_API_WORKERS=workers, MAAS_API_THREADS=threads)
            closed_loop(args.port, lambda _: call, 1, 1.0, warmup=0.5)  # stores the entry
            api_cpu, client_cpu = cpu_seconds(api.pids()), time.process_time()
            result = closed_loop(
                args.port, lambda _: call, args.concurrency, args.seconds, warmup=2.0, watch_header="x-cache"
            )
            api_cpu, client_cpu = cpu_seconds(api.pids()) - api_cpu, time.process_time() - client_cpu
            # CPU counted over warm-up and window alike; the requests of both are roughly (window+2)/window.
            served = max(1, sum(result.statuses.values())) * (args.seconds + 2.0) / args.seconds
            summary = result.summary()
            print(
                f"{config:>18} {summary['rps']:>8.0f} {summary['p50_ms']:>8.2f} {summary['p99_ms']:>8.2f} "
                f"{result.headers_seen.get('hit', 0) / max(1, summary['requests']):>7.1%} "
                f"{api_cpu / served * 1000:>15.2f} {client_cpu / served * 1000:>18.2f} "
                f"{os.getloadavg()[0]:>9.2f}"
            )
            if summary["errors"] or set(summary["statuses"]) != {200}:
                print(f"{'':>18} statuses {summary['statuses']} errors {summary['errors']}")
    finally:
        api.stop()


if __name__ == "__main__":
    main()
