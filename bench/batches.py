"""Batch jobs (issue 35): lines per second through a batch against the same lines sent as predicts at C=32, and the
API's memory while its feeder reads a 1,000,000-line file.

    MAAS_STACK_DIR=.stack-bench .venv/bin/python -m bench.batches [--quick] [--json out.json]

Against a running stack, with an API process of its own (one gunicorn worker, `MAAS_BATCH_FAIL_FAST_LINES=0`).
1. `noop`, 10,000 lines: one batch from a `gs://` JSONL file, timed from submit to `completed`; then the same
   10,000 bodies as predicts by 32 concurrent clients (fresh seeds everywhere: no cache hit, no coalescing).
2. `sd15-txt2img` (the tiny random-weight pipeline, 64x64, 4 steps), 500 lines, likewise.
3. A 1,000,000-line file whose lines all fail validation (a 422 each, as a predict would answer): the feeder reads
   and validates every line and writes every error line, but publishes none, so the whole file is read in minutes
   rather than a million inferences' time; the API worker's resident memory is sampled twice a second throughout.
The stack's own API, if running, also runs a batch runner: the feeding process is the one holding the batch's
lease, reported with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from bench.api_common import BenchApiProcess, load_client, rss_mib, running_stack
from bench.scenarios import TINY_PARAMETERS, fresh_seed
from contract import google_clients, naming
from contract.settings import LOCAL_DEFAULT_API_KEY, Settings, api_key_digest
from emulators.processes import ProcessRegistry
from maas_client import Client

INSTANCE = "bench-batches"
# The key the benchmark submits with, and its own prefix of the local stack's batch inputs bucket (the only place
# the local stack lets it name an input_file: MAAS_BATCH_INPUTS).
BENCH_KEY = LOCAL_DEFAULT_API_KEY
KEY_PREFIX = f"{api_key_digest(BENCH_KEY)[:12]}/"


def bodies(model: str, count: int) -> list[dict]:
    parameters = TINY_PARAMETERS if model.startswith("sd15") else {"num_inference_steps": 4}
    return [
        {"instances": [{"prompt": f"batch bench {model} {index}"}], "parameters": {**parameters, "seed": fresh_seed()}}
        for index in range(count)
    ]


def upload_lines(bucket, name: str, lines) -> str:
    """Writes JSON lines to a temporary file (never whole in memory), uploads it; its gs:// URI."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as handle:
        for line in lines:
            handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        path = handle.name
    try:
        bucket.blob(name).upload_from_filename(path, content_type="application/jsonl", timeout=600)
    finally:
        os.unlink(path)
    return f"gs://{bucket.name}/{name}"


def run_batch(client: Client, uri: str, timeout: float, on_view=None) -> tuple[float, dict]:
    began = time.perf_counter()
    batch = client.batches.create(input_file=uri)
    deadline = time.monotonic() + timeout
    while True:
        view = client.batches.get(batch.id)
        if on_view is not None:
            on_view(view)
        if view.ended or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not view.ended:
        client.batches.cancel(batch.id)
    return time.perf_counter() - began, view.model_dump()


async def predicts(port: int, model: str, sent: list[dict], concurrency: int) -> tuple[float, dict]:
    """Every body as a predict, `concurrency` clients at once; (seconds, statuses)."""
    pending, statuses = iter(sent), {}

    async def one_client(client) -> None:
        for body in pending:
            try:
                response = await client.raw("POST", f"/v1/models/{model}:predict", json=body)
            except httpx.HTTPError as exc:  # counted, as the other benchmarks count them
                statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                continue
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    began = time.perf_counter()
    async with load_client(port, concurrency, timeout=300) as client:
        await asyncio.gather(*(one_client(client) for _ in range(concurrency)))
    return time.perf_counter() - began, statuses


def compare(api: BenchApiProcess, bucket, model: str, count: int, timeout: float) -> dict:
    lines = [
        {"custom_id": f"{model}-{index}", "model": model, **body} for index, body in enumerate(bodies(model, count))
    ]
    uri = upload_lines(bucket, f"{KEY_PREFIX}bench-inputs/{model}-{count}-{fresh_seed()}.jsonl", lines)
    with Client(api.url, BENCH_KEY, timeout=60) as client:
        batch_seconds, view = run_batch(client, uri, timeout)
    print(f"  {model}: {count} lines as a batch in {batch_seconds:.1f} s ({view['status']}, "
          f"{view['request_counts']})", flush=True)  # fmt: skip
    predict_seconds, statuses = asyncio.run(predicts(api.port, model, bodies(model, count), 32))
    counts = view["request_counts"]
    row = {
        "model": model,
        "lines": count,
        "batch_status": view["status"],
        "batch_seconds": round(batch_seconds, 1),
        "batch_lines_per_s": round(counts["succeeded"] / batch_seconds, 1),
        "batch_counts": counts,
        "predict_c32_seconds": round(predict_seconds, 1),
        "predict_c32_per_s": round(statuses.get(200, 0) / predict_seconds, 1),
        "predict_statuses": statuses,
    }
    print(f"  {model}: {count} lines as a batch {row['batch_lines_per_s']} lines/s ({row['batch_seconds']} s, "
          f"{view['status']}); as predicts at C=32 {row['predict_c32_per_s']} req/s ({row['predict_c32_seconds']} s)",
          flush=True)  # fmt: skip
    return row


def million(api: BenchApiProcess, bucket, lines: int, timeout: float, redis_url: str) -> dict:
    invalid = ({"custom_id": f"m{index}", "model": "noop", "instances": [{"prompt": "x"}], "parameters": {"width": "64"}}
               for index in range(lines))  # fmt: skip
    began = time.perf_counter()
    uri = upload_lines(bucket, f"{KEY_PREFIX}bench-inputs/million-{lines}-{fresh_seed()}.jsonl", invalid)
    upload_seconds = time.perf_counter() - began
    # Both API processes that may feed it: the benchmark's, and the stack's own (if it runs one).
    workers = {INSTANCE: api.pids()[-1]}
    if (stack_api := stack_api_worker(api)) is not None:
        workers["stack-api"] = stack_api
    idle = {name: rss_mib(pid) for name, pid in workers.items()}
    samples: list[tuple[float, dict, int]] = []
    stop = threading.Event()
    progress = {"read": 0}

    def sample() -> None:
        started = time.monotonic()
        while not stop.wait(0.5):
            rss = {name: round(rss_mib(pid), 1) for name, pid in workers.items()}
            samples.append((round(time.monotonic() - started, 1), rss, progress["read"]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    holders: set[str] = set()
    client_redis = redis.Redis.from_url(redis_url)

    def seen(view) -> None:
        progress["read"] = view.request_counts.total
        holder = client_redis.get(f"maas:batch:{view.id}:lease")
        if holder:
            holders.add(INSTANCE if holder.decode().startswith(INSTANCE) else "stack-api")

    with Client(api.url, BENCH_KEY, timeout=60) as client:
        seconds, view = run_batch(client, uri, timeout, seen)
    stop.set()
    sampler.join()
    row = {
        "lines": lines,
        "upload_seconds": round(upload_seconds, 1),
        "status": view["status"],
        "lines_read": view["request_counts"]["total"],
        "seconds": round(seconds, 1),
        "lines_per_s": round(view["request_counts"]["total"] / seconds, 1),
        "rss_mib": {
            name: {
                "idle": round(idle[name], 1),
                "peak": max((rss[name] for _, rss, _ in samples), default=idle[name]),
                "last": samples[-1][1][name] if samples else idle[name],
            }
            for name in workers
        },
        "rss_samples": samples[:: max(1, len(samples) // 40)],
        "fed_by": sorted(holders),
    }
    memory = "; ".join(
        f"{name} idle {m['idle']} / peak {m['peak']} / last {m['last']}" for name, m in row["rss_mib"].items()
    )
    print(f"  {lines:,} lines: read {row['lines_read']:,} in {row['seconds']} s ({row['lines_per_s']} lines/s, "
          f"{view['status']}), fed by {', '.join(row['fed_by'])}; API worker RSS MiB: {memory}", flush=True)  # fmt: skip
    return row


def stack_api_worker(api: BenchApiProcess) -> int | None:
    """The stack's own API worker process (gunicorn's child), when the stack runs its API."""
    master = ProcessRegistry(api._config.stack_dir).pid("api")
    children = Path(f"/proc/{master}/task/{master}/children") if master else None
    if children is None or not children.exists():
        return None
    pids = children.read_text().split()
    return int(pids[0]) if pids else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 noop, 100 SD 1.5 and 100,000 lines")
    parser.add_argument("--smoke", action="store_true", help="4 noop, 2 SD 1.5 and 100 lines (bench.suite --smoke)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    config = running_stack()
    os.environ.update(config.client_env())
    settings = Settings.from_env({**os.environ, **config.client_env()})
    bucket = google_clients.storage_client(settings).bucket(naming.batch_input_bucket(settings.project_id))
    api = BenchApiProcess(config, config.api_port + 120, name="bench-api-batches")
    api.start(MAAS_API_WORKERS="1", MAAS_BATCH_FAIL_FAST_LINES="0", MAAS_INSTANCE_ID=INSTANCE)
    noop, sd, big = (4, 2, 100) if args.smoke else (2_000, 100, 100_000) if args.quick else (10_000, 500, 1_000_000)
    bound = settings.batch_max_in_flight or "derived: max replicas x max_batch_size x 4 (contract/batch_capacity.py)"
    report: dict = {"instance": INSTANCE, "max_in_flight": bound}
    try:
        report["noop"] = compare(api, bucket, "noop", noop, timeout=900)
        report["sd15"] = compare(api, bucket, "sd15-txt2img", sd, timeout=900)
        report["million"] = million(api, bucket, big, timeout=900, redis_url=settings.redis_url)
    finally:
        api.stop()
    report["load_avg"] = round(os.getloadavg()[0], 2)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
