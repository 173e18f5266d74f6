"""The batch feeder's own ceiling (issue 41): lines per second through the feeder and collector when every line is
answered the moment it is published, so nothing but the runner itself (validation, the Redis scripts, part files)
bounds it.

    .venv/bin/python -m bench.batch_feeder [--lines 5000] [--in-flight 64 1280] [--json out.json]

In process, against a redis-server of its own on a free port and the real runner and scripts; GCS is in memory (a
part upload costs nothing here: on the stack each costs a GCS round trip per second of flushing), and the "worker"
stores an `ok` answer at publish. Each `--in-flight` value (`MAAS_BATCH_MAX_IN_FLIGHT`) is run side by side in one
run, on one machine; the numbers are that machine's. The default pair is the old fixed bound (64) and the bound
derived for the production catalog's `sd15-txt2img` (contract/batch_capacity.py: 40 workers x 8 x 4 = 1,280).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from api_server.batches.lines import line_request_id
from contract.batch_capacity import batch_in_flight_bound
from contract.catalog import DEFAULT_CATALOG_PATH, load_catalog
from tests.unit.batch_harness import Harness, redis_server


def run(client, lines: int, in_flight: int) -> float:
    client.flushall()
    harness = Harness(client, batch_max_in_flight=in_flight)
    ids = [f"bench-{index}" for index in range(lines)]
    batch_id = harness.submit(ids)
    by_request = {line_request_id(batch_id, custom_id): custom_id for custom_id in ids}
    publish = harness.inference.publish

    def answered_at_once(message, *args, **kwargs) -> None:
        publish(message, *args, **kwargs)
        harness.answer(batch_id, by_request[message.request_id])

    harness.inference.publish = answered_at_once
    started = time.perf_counter()
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed", timeout=3600)
    seconds = time.perf_counter() - started
    assert harness.counts(batch_id)["succeeded"] == lines
    harness.runner.stop()
    return lines / seconds


OLD_BOUND = 64  # MAAS_BATCH_MAX_IN_FLIGHT's fixed default before the bound was derived


def derived_bound(model: str = "sd15-txt2img") -> int:
    catalog = load_catalog(str(DEFAULT_CATALOG_PATH))
    return batch_in_flight_bound(catalog, catalog.get(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[OLD_BOUND, derived_bound()])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    servers = redis_server.__wrapped__()  # the test fixture's generator: a redis-server of its own
    client = next(servers)
    report: dict = {"lines": args.lines, "load_avg_before": round(os.getloadavg()[0], 2), "runs": []}
    try:
        print(f"batch feeder ceiling, {args.lines} lines answered at publish (load {os.getloadavg()[0]:.1f}):")
        for in_flight in args.in_flight:
            rate = run(client, args.lines, in_flight)
            report["runs"].append({"in_flight": in_flight, "lines_per_s": round(rate, 1)})
            print(f"  in flight at most {in_flight:<5} {rate:8.0f} lines/s")
    finally:
        servers.close()
    report["load_avg_after"] = round(os.getloadavg()[0], 2)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
