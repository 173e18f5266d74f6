"""1,000 requests waiting at once on one API instance (the `sleep` model): success rate, time and memory.

    MAAS_STACK_DIR=/tmp/stack-f .venv/bin/python -m bench.api_waiting [--requests 1000] [--modes per-instance per-request]

One gunicorn worker with as many threads as requests (`MAAS_API_WORKERS=1`, `MAAS_API_THREADS=N`) beside a
running stack, plus `--extra-workers` synthetic workers so the queue drains within the model's 30 s timeout
(each `sleep` worker runs 8 images per 200 ms). Every request opens its own connection and is sent at the same
moment, without a seed (no cache, no coalescing). Prints the answers by status (200: answered in time; 202:
the wait ran out and the request became a job), the time to the last answer, and the API worker's resident
memory before, at its peak (VmHWM) and after.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time

from bench.api_common import ApiCall, BenchApiProcess, all_at_once, rss_mib, running_stack
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, worker_env


def start_workers(config, count: int) -> list[str]:
    registry = ProcessRegistry(config.stack_dir)
    names = []
    for index in range(60, 60 + count):
        name = f"bench-worker-synthetic-{index}"
        if registry.pid(name) is None:
            registry.start(
                name, [sys.executable, "-m", "model_worker"], worker_env(config, "synthetic", index), cwd=ROOT
            )
        url = f"http://127.0.0.1:{config.worker_health_port(index)}/readyz"
        registry.wait_until(name, lambda url=url: http_ok(url), timeout=120)
        names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--modes", nargs="+", default=["per-instance", "per-request"])
    parser.add_argument("--extra-workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=int(os.environ.get("MAAS_BENCH_API_PORT", "30180")))
    args = parser.parse_args()
    config = running_stack()
    api = BenchApiProcess(config, args.port)
    workers = start_workers(config, args.extra_workers)
    seeds = itertools.count(int(time.time()))
    print(f"{args.requests} concurrent requests to sleep, one API worker with {args.requests} threads, "
          f"{1 + args.extra_workers} synthetic workers")  # fmt: skip
    print(f"{'mode':>13} {'200':>5} {'202':>5} {'other':>6} {'errors':>6} {'last answer s':>14} {'p50 s':>6} "
          f"{'RSS before MiB':>15} {'peak MiB':>9} {'after MiB':>10} {'load avg':>9}")  # fmt: skip
    try:
        for mode in args.modes:
            api.start(
                MAAS_REPLY_MODE=mode, MAAS_API_WORKERS="1", MAAS_API_THREADS=str(args.requests),
                MAAS_API_WORKER_TIMEOUT="300",
            )  # fmt: skip
            worker_pid = api.pids()[1]
            before = rss_mib(worker_pid)
            raws = [
                ApiCall("/v1/models/sleep:predict", {"instances": [{"prompt": f"waiting {next(seeds)}"}]})
                for _ in range(args.requests)
            ]
            peak_rss = [before]
            done = threading.Event()

            def sample(pid: int = worker_pid, done: threading.Event = done, seen: list = peak_rss) -> None:
                while not done.wait(0.5):
                    seen.append(rss_mib(pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            result, seconds = all_at_once(args.port, raws, timeout=120)
            done.set()
            sampler.join()
            peak = max(rss_mib(worker_pid, "VmHWM"), *peak_rss)
            statuses = result.statuses
            other = sum(count for status, count in statuses.items() if status not in (200, 202))
            print(
                f"{mode:>13} {statuses.get(200, 0):>5} {statuses.get(202, 0):>5} {other:>6} "
                f"{sum(result.errors.values()):>6} {seconds:>14.1f} {result.summary()['p50_ms'] / 1000:>6.1f} "
                f"{before:>15.0f} {peak:>9.0f} {rss_mib(worker_pid):>10.0f} {os.getloadavg()[0]:>9.2f}"
            )
            if other or result.errors:
                print(f"{'':>13} statuses {dict(statuses)} errors {result.errors}")
    finally:
        api.stop()
        registry = ProcessRegistry(config.stack_dir)
        for name in workers:
            registry.stop(name, timeout=30)


if __name__ == "__main__":
    main()
