"""Interactive latency beside a batch of the same model, on the local stack: sequential predicts alone, then the same
beside a running batch, side by side in one run; p50 and p95 and their ratios printed.

    MAAS_STACK_DIR=.stack-bench .venv/bin/python -m bench.batch_beside [--predicts 40] [--lines 400] [--rounds 3]

Against a running stack (the real API under gunicorn on a port of its own, Pub/Sub, Redis and the model's worker):
each round sends `--predicts` tiny `sd15-txt2img` predicts (64x64, 4 steps, fresh seeds: no cache hit), one after
another, alone; then submits a `--lines`-line batch of the same model and, once its first line is answered (the
worker is taking batch lines), sends the same number of predicts again; then waits for the batch to end. A
predict counts as beside the batch only if the batch had not ended when it was sent (a GET before each, untimed);
fewer than half of them beside it is a failed run (a larger `--lines` is needed on that machine), as is any predict
that is not a 200. The numbers are the machine's: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.api_common import KEY, BenchApiProcess, running_stack
from bench.loadgen import percentile
from bench.scenarios import bench_client, fresh_seed, predict_body
from maas_client import Client

MODEL = "sd15-txt2img"
INSTANCE = "bench-batch-beside"
WARM_UP = 3
FIRST_ANSWER_SECONDS = 300  # the batch's first line answered within this, or the run fails
BATCH_END_SECONDS = 900  # and all of it within this


class ScenarioError(Exception):
    """The scenario measured nothing trustworthy: what went wrong."""


def predict_ms(http: Client, model: str) -> float:
    """One predict, timed around the HTTP call; anything but a 200 fails the run."""
    started = time.perf_counter()
    response = http.raw("POST", f"/v1/models/{model}:predict", json=predict_body(model, fresh_seed()))
    elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise ScenarioError(f"a predict answered HTTP {response.status_code}: {response.text[:300]}")
    return elapsed


def stats(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50_ms": round(percentile(values, 0.5), 1),
        "p95_ms": round(percentile(values, 0.95), 1),
    }


def batch_lines(model: str, count: int) -> list[dict]:
    return [
        {"custom_id": f"beside-{index}", "model": model, **predict_body(model, fresh_seed())} for index in range(count)
    ]


def one_round(api_url: str, model: str, predicts: int, lines: int) -> dict:
    with bench_client(api_url, KEY) as http, Client(api_url, KEY, timeout=60) as client:
        alone = [predict_ms(http, model) for _ in range(predicts)]
        batch = client.batches.create(requests=batch_lines(model, lines))
        deadline = time.monotonic() + FIRST_ANSWER_SECONDS
        while (view := client.batches.get(batch.id)).request_counts.succeeded < 1 and not view.ended:
            if time.monotonic() > deadline:
                client.batches.cancel(batch.id)
                raise ScenarioError(f"no line of batch {batch.id} answered in {FIRST_ANSWER_SECONDS}s ({view.status})")
            time.sleep(0.1)
        answered_before = view.request_counts.succeeded
        beside, after_end = [], 0
        for _ in range(predicts):
            if client.batches.get(batch.id).ended:
                after_end += 1
                predict_ms(http, model)  # sent all the same, so both runs send as many; not counted
                continue
            beside.append(predict_ms(http, model))
        view = client.batches.get(batch.id)
        answered_during = view.request_counts.succeeded - answered_before
        # The batch runs to its end: a cancelled batch's published lines would still reach the worker (each
        # discarded there) during the next round's lone predicts, or the suite's next scenario.
        deadline = time.monotonic() + BATCH_END_SECONDS
        while not (view := client.batches.get(batch.id)).ended:
            if time.monotonic() > deadline:
                client.batches.cancel(batch.id)
                raise ScenarioError(f"batch {batch.id} still {view.status} after {BATCH_END_SECONDS}s")
            time.sleep(0.5)
    if len(beside) < predicts / 2:
        raise ScenarioError(
            f"the {lines}-line batch ended after {len(beside)} of {predicts} predicts beside it: raise --lines"
        )
    row = {"alone": stats(alone), "beside": stats(beside), "batch_lines_answered_during": answered_during}
    for name, fraction in (("p50_ratio", 0.5), ("p95_ratio", 0.95)):
        row[name] = round(percentile(beside, fraction) / percentile(alone, fraction), 2)
    row["predicts_after_batch_ended"] = after_end
    row["batch_status"] = view.status
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predicts", type=int, default=40)
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    config = running_stack()
    os.environ.update(config.client_env())
    api = BenchApiProcess(config, config.api_port + 130, name=INSTANCE)
    report: dict = {"model": MODEL, "predicts": args.predicts, "lines": args.lines, "rounds": []}
    report["load_avg_before"] = [round(x, 2) for x in os.getloadavg()]
    api.start(MAAS_API_WORKERS="1", MAAS_INSTANCE_ID=INSTANCE)
    try:
        with bench_client(api.url, KEY) as http:
            for _ in range(WARM_UP):  # the worker's first calls (and the API's first connections) are not counted
                predict_ms(http, MODEL)
        print(f"interactive {MODEL} latency, {args.predicts} sequential predicts, alone and beside a {args.lines}-line "
              f"batch of the same model (load {os.getloadavg()[0]:.1f}):", flush=True)  # fmt: skip
        for number in range(1, args.rounds + 1):
            row = one_round(api.url, MODEL, args.predicts, args.lines)
            row["load_avg"] = round(os.getloadavg()[0], 2)
            report["rounds"].append(row)
            alone, beside = row["alone"], row["beside"]
            print(f"  round {number}: alone p50 {alone['p50_ms']:.0f} / p95 {alone['p95_ms']:.0f} ms; beside the batch "
                  f"p50 {beside['p50_ms']:.0f} / p95 {beside['p95_ms']:.0f} ms ({beside['count']} predicts, "
                  f"{row['batch_lines_answered_during']} batch lines answered meanwhile): p50 {row['p50_ratio']:.2f}x, "
                  f"p95 {row['p95_ratio']:.2f}x (load {row['load_avg']:.1f})", flush=True)  # fmt: skip
    except ScenarioError as exc:
        print(f"  failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        api.stop()
        report["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
