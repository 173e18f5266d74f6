"""Open job event streams (`GET /v1/jobs/{id}/events`) on one API instance, and what they do to predict latency.

    MAAS_STACK_DIR=/tmp/stack-f .venv/bin/python -m bench.api_event_streams [--streams 1000] [--seconds 15]

Against a running stack, an API process of its own (one gunicorn worker with the production default of
threads, 32 unless `--threads`; MAAS_API_WORKER_CONNECTIONS above the streams). The streams are served
on the worker's event loop: a watcher holds no thread, so 1,000 of them fit beside 32 threads. The
`sd15-txt2img` worker is paused (SIGSTOP) so the watched jobs stay queued: the streams are open and idle, as
most watchers of a busy service are (the API's one hub thread still polls every watched job four times a
second). Predict on `noop` at concurrency 1, no seed (no
cache), is measured first alone, then with the streams open. Prints the p50/p99 of both, the streams still
open at the end, the API worker's threads, resident memory and CPU during each phase. The worker is resumed
(SIGCONT) and the jobs cancelled at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from pathlib import Path

from bench.api_common import ApiCall, BenchApiProcess, _closed_loop, cpu_seconds, load_client, rss_mib, running_stack
from emulators.processes import ProcessRegistry
from emulators.stack import worker_name
from maas_client import AsyncJob, MaasError

# The model whose worker is paused, so the watched jobs stay queued (its process is found by the stack's lookup).
PAUSED_MODEL = "sd15-txt2img"


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def open_stream(job: AsyncJob, opened: list, failures: dict, opening: asyncio.Semaphore) -> None:
    """Opens one stream (the SDK's `AsyncJob.events`), waits for its first event, then keeps reading (keep-alive
    comments) until cancelled. At most `opening` streams are being opened at once, as a crowd of browsers
    reconnecting would not all arrive in one millisecond either."""
    events = job.events()
    try:
        async with opening:
            first = await asyncio.wait_for(anext(events), 60)
        if first.status != "queued":
            raise RuntimeError(f"the watched job is {first.status}, not queued")
    except (TimeoutError, MaasError, RuntimeError, StopAsyncIteration) as exc:
        failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
        await events.aclose()
        return
    opened.append(job)
    try:
        async for _ in events:
            pass
    except (MaasError, asyncio.CancelledError):
        pass
    finally:
        opened.remove(job)
        await events.aclose()


def predict_request(n: int) -> ApiCall:
    return ApiCall("/v1/models/noop:predict", {"instances": [{"prompt": f"stream bench {n}"}]})


async def measure(port: int, seconds: float, counter) -> dict:
    result = await _closed_loop(port, lambda n: predict_request(next(counter)), 1, seconds, 1.0, None, 30.0)
    return result.summary()


async def run(api: BenchApiProcess, job_ids: list[str], streams: int, seconds: float) -> dict:
    worker_pid = api.pids()[1]
    counter = itertools.count(int(time.time() * 1000))
    report: dict = {}
    cpu0 = cpu_seconds([worker_pid])
    report["alone"] = await measure(api.port, seconds, counter)
    report["alone"]["api_cpu_s"] = round(cpu_seconds([worker_pid]) - cpu0, 2)
    report["alone"]["threads"], report["alone"]["rss_mib"] = threads_of(worker_pid), round(rss_mib(worker_pid))
    opened: list = []
    failures: dict = {}
    began = time.perf_counter()
    opening = asyncio.Semaphore(32)
    watchers = load_client(api.port, streams + 16, 60.0)
    tasks = [
        asyncio.create_task(open_stream(watchers.job(job_ids[i % len(job_ids)]), opened, failures, opening))
        for i in range(streams)
    ]
    while len(opened) + sum(failures.values()) < streams and time.perf_counter() - began < 120:
        await asyncio.sleep(0.2)
    report["streams_opened"], report["open_seconds"] = len(opened), round(time.perf_counter() - began, 1)
    report["stream_failures"] = failures
    cpu0 = cpu_seconds([worker_pid])
    report["with_streams"] = await measure(api.port, seconds, counter)
    report["with_streams"]["api_cpu_s"] = round(cpu_seconds([worker_pid]) - cpu0, 2)
    report["with_streams"]["threads"] = threads_of(worker_pid)
    report["with_streams"]["rss_mib"] = round(rss_mib(worker_pid))
    report["streams_open_at_end"] = len(opened)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await watchers.close()
    await asyncio.sleep(1.0)
    cpu0 = cpu_seconds([worker_pid])
    report["alone_again"] = await measure(api.port, seconds, counter)  # how much of a change is this machine's noise
    report["alone_again"]["api_cpu_s"] = round(cpu_seconds([worker_pid]) - cpu0, 2)
    report["alone_again"]["threads"], report["alone_again"]["rss_mib"] = (
        threads_of(worker_pid),
        round(rss_mib(worker_pid)),
    )
    return report


async def submit_watched(port: int, count: int) -> list[str]:
    async with load_client(port, 4, 30.0) as client:  # a client per event loop: its connections belong to it
        jobs = [await client.submit("sd15-txt2img", f"watched {time.time()} {n}", size="64x64") for n in range(count)]
    return [job.id for job in jobs]


async def cancel_watched(port: int, job_ids: list[str]) -> None:
    async with load_client(port, 4, 30.0) as client:
        for job_id in job_ids:
            with contextlib.suppress(MaasError):  # already finished: nothing to stop
                await client.job(job_id).cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=50, help="queued jobs the streams watch (streams / jobs each)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--threads", type=int, default=32, help="the API worker's threads (the production default)")
    parser.add_argument("--port", type=int, help="the benchmark API's port (default: the stack's API port + 110)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    config = running_stack()
    registry = ProcessRegistry(config.stack_dir)
    api = BenchApiProcess(config, args.port or config.api_port + 110, name="bench-api-streams")
    threads = args.threads
    api.start(
        MAAS_API_WORKERS="1", MAAS_API_THREADS=str(threads), MAAS_API_WORKER_TIMEOUT="300",
        MAAS_API_WORKER_CONNECTIONS=str(max(2000, args.streams + 256)),
    )  # fmt: skip
    paused_worker = worker_name(config, PAUSED_MODEL)
    paused = registry.pid(paused_worker)
    job_ids: list[str] = []
    try:
        if paused is None:
            raise SystemExit(f"{paused_worker} (serving {PAUSED_MODEL}) is not running in this stack")
        os.kill(paused, signal.SIGSTOP)
        job_ids = asyncio.run(submit_watched(api.port, args.jobs))
        report = asyncio.run(run(api, job_ids, args.streams, args.seconds))
    finally:
        if paused is not None:
            os.kill(paused, signal.SIGCONT)  # first: nothing below may leave the stack's worker stopped
        try:
            asyncio.run(cancel_watched(api.port, job_ids))
        finally:
            api.stop()
    report.update(streams=args.streams, threads=threads, load_avg=round(os.getloadavg()[0], 2))
    alone, loaded = report["alone"], report["with_streams"]
    print(f"{args.streams} streams asked, {report['streams_opened']} opened in {report['open_seconds']} s, "
          f"{report['streams_open_at_end']} still open at the end; failures {report['stream_failures']}")  # fmt: skip
    print(f"{'phase':>13} {'predicts':>9} {'p50 ms':>7} {'p99 ms':>7} {'API CPU s':>10} {'threads':>8} {'RSS MiB':>8}")
    for name, row in (("alone", alone), ("with streams", loaded), ("alone again", report["alone_again"])):
        print(f"{name:>13} {row['requests']:>9} {row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f} {row['api_cpu_s']:>10.2f} "
              f"{row['threads']:>8} {row['rss_mib']:>8}")  # fmt: skip
    change = (loaded["p50_ms"] / alone["p50_ms"] - 1) * 100 if alone["p50_ms"] else float("nan")
    print(
        f"predict p50 change with streams open: {change:+.1f}% (target within 10%); load average {report['load_avg']}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
