"""Open job event streams (`GET /v1/jobs/{id}/events`) on one API instance, and what they do to predict latency.

    MAAS_STACK_DIR=/tmp/stack-f .venv/bin/python -m bench.api_event_streams [--streams 1000] [--seconds 15]

Against a running stack, an API process of its own (one gunicorn worker with the production default of
threads, 32 unless `--threads`; `--worker-connections` for gunicorn above the streams). The streams are served
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
import itertools
import json
import os
import signal
import time
from pathlib import Path

from bench.api_common import BenchApiProcess, _closed_loop, cpu_seconds, http_request, rss_mib, running_stack
from emulators.processes import ProcessRegistry

PAUSED_WORKER = "worker-sd15-txt2img"


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def open_stream(port: int, job_id: str, opened: list, failures: dict, opening: asyncio.Semaphore) -> None:
    """Opens one stream, waits for its first event, then keeps reading (keep-alive comments) until cancelled.

    At most `opening` streams are being opened at once: each opening reads its job from Redis, and the API's
    Redis pool (redis-py's default, 100 connections) refuses rather than waits past that."""
    try:
        async with opening:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
            writer.write(http_request(f"/v1/jobs/{job_id}/events", port, None))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            if head[9:12] != b"200":
                failures[head[9:12].decode()] = failures.get(head[9:12].decode(), 0) + 1
                writer.close()
                return
            await asyncio.wait_for(reader.readuntil(b"event: queued"), 60)
    except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
        return
    opened.append(writer)
    try:
        while await reader.read(4096):
            pass
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        opened.remove(writer)
        writer.close()


def predict_request(n: int, port: int) -> bytes:
    return http_request("/v1/models/noop:predict", port, {"instances": [{"prompt": f"stream bench {n}"}]})


async def measure(port: int, seconds: float, counter) -> dict:
    result = await _closed_loop(port, lambda n: predict_request(next(counter), port), 1, seconds, 1.0, None, 30.0)
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
    tasks = [
        asyncio.create_task(open_stream(api.port, job_ids[i % len(job_ids)], opened, failures, opening))
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
    await asyncio.sleep(1.0)
    cpu0 = cpu_seconds([worker_pid])
    report["alone_again"] = await measure(api.port, seconds, counter)  # how much of a change is this machine's noise
    report["alone_again"]["api_cpu_s"] = round(cpu_seconds([worker_pid]) - cpu0, 2)
    report["alone_again"]["threads"], report["alone_again"]["rss_mib"] = (
        threads_of(worker_pid),
        round(rss_mib(worker_pid)),
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=50, help="queued jobs the streams watch (streams / jobs each)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--threads", type=int, default=32, help="the API worker's threads (the production default)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("MAAS_BENCH_API_PORT", "30190")))
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    config = running_stack()
    registry = ProcessRegistry(config.stack_dir)
    api = BenchApiProcess(config, args.port, name="bench-api-streams")
    threads = args.threads
    api.start(
        MAAS_API_WORKERS="1", MAAS_API_THREADS=str(threads), MAAS_API_WORKER_TIMEOUT="300",
        GUNICORN_CMD_ARGS=f"--worker-connections {args.streams + 256}",
    )  # fmt: skip
    paused = registry.pid(PAUSED_WORKER)
    job_ids: list[str] = []
    import requests

    session = requests.Session()
    session.headers["Authorization"] = "Bearer local-dev-key"
    try:
        if paused is None:
            raise SystemExit(f"{PAUSED_WORKER} is not running in this stack")
        os.kill(paused, signal.SIGSTOP)
        for index in range(args.jobs):
            body = {
                "instances": [{"prompt": f"watched {time.time()} {index}"}],
                "parameters": {"width": 64, "height": 64},
            }
            response = session.post(f"{api.url}/v1/models/sd15-txt2img/jobs", json=body, timeout=30)
            job_ids.append(response.json()["id"])
        report = asyncio.run(run(api, job_ids, args.streams, args.seconds))
    finally:
        for job_id in job_ids:
            session.delete(f"{api.url}/v1/jobs/{job_id}", timeout=30)
        if paused is not None:
            os.kill(paused, signal.SIGCONT)
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
