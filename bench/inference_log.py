"""The inference log's cost on the request path, and its spool's throughput while BigQuery is down.

    .venv/bin/python -m bench.inference_log [--rows 20000] [--stack .stack-bench]

1. request path: `InferenceLogWriter.write` (validate + queue put) called by 32 threads at once, against the
   same threads doing the same work with logging off (building the row only), side by side in one run;
2. spool: rows/s written to the on-disk spool (fsynced segments) while every send fails;
3. drain: with a local stack given (`--stack`), rows/s delivered from that spool into the BigQuery emulator
   through the Storage Write API once it is reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from api_server.inference_log.spool import LogSpool
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter

THREADS = 32


class DownSink:
    """BigQuery unreachable: every send fails at once."""

    stream = None
    next_offset = 0

    def open_stream(self) -> str:
        raise ConnectionError("bigquery down")


def row(index: int) -> InferenceLogRow:
    return InferenceLogRow(
        request_id=uuid.uuid4().hex, created_at=datetime.now(UTC), model="noop", status="ok", http_status=200,
        api_key_id="0123456789ab", num_images=1, width=64, height=64, num_inference_steps=10, seed=index,
        total_ms=61.2, queue_ms=20.1, inference_ms=0.2, batch_id="b", batch_size=1, worker_id="w", attempt=1,
    )  # fmt: skip


def per_call_us(writer: InferenceLogWriter | None, rows_per_thread: int) -> list[float]:
    timings: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(THREADS)

    def work() -> None:
        local = []
        barrier.wait()
        for index in range(rows_per_thread):
            started = time.perf_counter()
            item = row(index)
            if writer is not None:
                writer.write(item)
            local.append((time.perf_counter() - started) * 1e6)
        with lock:
            timings.extend(local)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return timings


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"p{q}": round(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 2) for q in (50, 95, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--stack", type=Path, help="a running local stack's directory, for the drain measurement")
    args = parser.parse_args()
    per_thread = max(1, args.rows // THREADS)
    results: dict = {"threads": THREADS, "rows": per_thread * THREADS}
    with tempfile.TemporaryDirectory() as spool_dir:
        writer = InferenceLogWriter(DownSink(), LogSpool(Path(spool_dir), 1 << 30), spool_interval=0.2)
        off = per_call_us(None, per_thread)
        on = per_call_us(writer, per_thread)
        results["request_path_us"] = {"logging_off": quantiles(off), "logging_on": quantiles(on)}
        writer._stopped.set()  # noqa: SLF001 - stop the threads; the spool is measured on its own below
        writer.spool_queued()
        # Spool throughput on its own: a full queue moved to disk in fsynced segments of 500 rows.
        for index in range(per_thread * THREADS):
            writer.write(row(index))
        before = writer.stats["spooled"]
        started = time.perf_counter()
        writer.spool_queued()
        spool_seconds = time.perf_counter() - started
        spooled = writer.stats["spooled"]
        results["spool"] = {
            "rows": spooled - before,
            "seconds": round(spool_seconds, 3),
            "rows_per_second": round((spooled - before) / max(spool_seconds, 1e-6)),
            "bytes_per_row": round(sum(p.stat().st_size for p in Path(spool_dir).glob("*.jsonl")) / spooled),
        }
        if args.stack:
            results["drain"] = drain(args.stack, Path(spool_dir), spooled)
    extra = statistics.median(on) - statistics.median(off)
    results["request_path_us"]["p50_added_by_logging_us"] = round(extra, 2)
    print(json.dumps(results, indent=2))


def drain(stack_dir: Path, spool_dir: Path, rows: int) -> dict:
    from api_server.process.state import build_inference_log
    from contract.settings import Settings

    record = json.loads((stack_dir / "stack.json").read_text())
    os.environ.update({k: v for k, v in record.items() if k.isupper()})
    settings = Settings.from_env({**os.environ, "MAAS_LOG_SPOOL_DIR": str(spool_dir)})
    writer = build_inference_log(settings)
    started = time.perf_counter()
    while writer.stats["written"] < rows and time.perf_counter() - started < 300:
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    writer.close(send_seconds=1)
    return {"rows": writer.stats["written"], "seconds": round(seconds, 2), "rows_per_second": round(rows / seconds)}


if __name__ == "__main__":
    main()
