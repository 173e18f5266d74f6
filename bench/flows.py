"""A flow against the same models called one after another by a client through the API, in the same run.

`sd15-hires` (txt2img, x2, img2img at strength 0.5) as one call to the flow, against a client that calls
`sd15-txt2img`, resizes its image x2 and calls `sd15-img2img` with it, each call with the parameters the
flow's stages run with (read from `GET /v1/models`). Closed loop at C=1 and C=8; latency p50/p95 and the
worker seconds each answer cost (the pipeline time the replies report: the flow's stages', the two calls').

    .venv/bin/python -m bench.flows [--seconds 10] [--json out.json]    # against the running stack's API
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.loadgen import Sample, run_closed_loop, summarize
from bench.scenarios import bench_client, fresh_seed

FLOW = "sd15-hires"
CONCURRENCIES = (1, 8)
# Each way's measured window at each concurrency (after the warm-up): several of the flow's C=8 latencies.
SECONDS, QUICK_SECONDS = 30.0, 10.0
# The flow's output size: a 64x64 first stage, 128x128 after the x2 (the tiny pipelines' sizes).
BASE_SIZE = 64


def flow_stages(api_url: str, key: str, flow: str) -> list[dict]:
    """The flow's stages as `GET /v1/models` lists them (model, fixes, resize)."""
    with bench_client(api_url, key, timeout=30.0) as client:
        listed = client.raw("GET", "/v1/models").json()["models"]
    found = next((entry for entry in listed if entry["name"] == flow), None)
    if found is None or not found.get("stages"):
        raise SystemExit(f"the API serves no flow {flow!r} (make up serves it with the local overlay)")
    return found["stages"]


def _params(stage: dict, seed: int, size: int) -> dict:
    return {"seed": seed, "width": size, "height": size, **(stage.get("fixes") or {})}


def flow_caller(api_url: str, key: str, flow: str) -> Callable[[], Callable[[int], Sample]]:
    """One call to the flow; `timings["worker_ms"]`: the pipeline time of every stage that ran."""

    def make() -> Callable[[int], Sample]:
        client = bench_client(api_url, key)

        def call(_number: int) -> Sample:
            seed = fresh_seed()
            body = {"instances": [{"prompt": f"bench flow {seed}"}],
                    "parameters": {"seed": seed, "width": BASE_SIZE, "height": BASE_SIZE}}  # fmt: skip
            started = time.perf_counter()
            try:
                response = client.raw("POST", f"/v1/models/{flow}:predict", json=body)
            except httpx.HTTPError as exc:
                return Sample(started, time.perf_counter(), False, error=type(exc).__name__)
            ended = time.perf_counter()
            if response.status_code != 200:
                return Sample(started, ended, False, error=f"HTTP {response.status_code}")
            answer = response.json()
            stages = answer.get("stages") or []
            worker_ms = sum(stage["inference_ms"] for stage in stages) or answer["timings_ms"]["inference"]
            per_stage = {f"stage{index}_ms": stage["inference_ms"] for index, stage in enumerate(stages)}
            return Sample(started, ended, True, {"worker_ms": worker_ms, **per_stage})

        return call

    return make


def two_calls_caller(api_url: str, key: str, stages: list[dict]) -> Callable[[], Callable[[int], Sample]]:
    """The same stages as a client would run them: call the first model, resize its PNG, call the second."""
    first, second = stages[0], stages[1]
    scale = float((first.get("resize") or {}).get("scale", 1))

    def make() -> Callable[[int], Sample]:
        client = bench_client(api_url, key)

        def call(_number: int) -> Sample:
            seed = fresh_seed()
            started = time.perf_counter()
            try:
                one = client.raw("POST", f"/v1/models/{first['model']}:predict", json={
                    "instances": [{"prompt": f"bench flow {seed}"}], "parameters": _params(first, seed, BASE_SIZE)})  # fmt: skip
                if one.status_code != 200:
                    return Sample(started, time.perf_counter(), False, error=f"HTTP {one.status_code} (first)")
                size = int(BASE_SIZE * scale)
                image = _resized(one.json()["predictions"][0]["image_b64"], size)
                two = client.raw("POST", f"/v1/models/{second['model']}:predict", json={
                    "instances": [{"prompt": f"bench flow {seed}", "image": image}],
                    "parameters": _params(second, seed, size)})  # fmt: skip
            except httpx.HTTPError as exc:
                return Sample(started, time.perf_counter(), False, error=type(exc).__name__)
            ended = time.perf_counter()
            if two.status_code != 200:
                return Sample(started, ended, False, error=f"HTTP {two.status_code} (second)")
            first_ms, second_ms = one.json()["timings_ms"]["inference"], two.json()["timings_ms"]["inference"]
            return Sample(started, ended, True, {"worker_ms": first_ms + second_ms, "stage0_ms": first_ms,
                                                 "stage1_ms": second_ms})  # fmt: skip

        return call

    return make


def _resized(image_b64: str, size: int) -> str:
    """The client's own upscale between the two calls (what the flow's pixel resize does on the worker)."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(image_b64))).convert("RGB").resize((size, size), Image.BICUBIC)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def measure(
    api_url: str, key: str, seconds: float, warmup: float, progress=print, concurrencies: tuple = CONCURRENCIES
) -> dict:
    """Both ways at each concurrency, alternating which goes first; the ratios the issue's targets read."""
    stages = flow_stages(api_url, key, FLOW)
    ways = {"flow": flow_caller(api_url, key, FLOW), "two calls": two_calls_caller(api_url, key, stages)}
    rows = []
    for index, concurrency in enumerate(concurrencies):
        order = list(ways) if index % 2 == 0 else list(reversed(ways))
        for way in order:
            samples, window = run_closed_loop(ways[way], concurrency, seconds, warmup)
            row = {"way": way, **summarize(samples, window, concurrency)}
            measured = [s for s in samples if s.ok and window[0] <= s.ended <= window[1]]
            worker = [s.timings["worker_ms"] for s in measured]
            row["worker_ms_mean"] = statistics.fmean(worker) if worker else None
            # Each stage's (each call's) pipeline milliseconds: where a way spends its worker time.
            row["stage_ms_mean"] = [
                statistics.fmean(s.timings[f"stage{index}_ms"] for s in measured if f"stage{index}_ms" in s.timings)
                for index in range(2)
                if any(f"stage{index}_ms" in s.timings for s in measured)
            ]
            rows.append(row)
            progress(f"  {FLOW} {way:<9} c={concurrency}: p50 {row['p50_ms']:.0f} / p95 {row['p95_ms']:.0f} ms, "
                     f"{row['rps']:.2f} req/s, worker {row['worker_ms_mean'] or 0:.0f} ms per answer "
                     f"({' + '.join(f'{ms:.0f}' for ms in row['stage_ms_mean'])} by stage), "
                     f"{row['errors']} errors")  # fmt: skip
    ratios = {}
    for concurrency in concurrencies:
        flow = next(r for r in rows if r["way"] == "flow" and r["concurrency"] == concurrency)
        calls = next(r for r in rows if r["way"] == "two calls" and r["concurrency"] == concurrency)
        if flow["p50_ms"] and calls["p50_ms"]:
            ratios[f"c{concurrency}_p50_speedup"] = calls["p50_ms"] / flow["p50_ms"]
            ratios[f"c{concurrency}_p95_speedup"] = calls["p95_ms"] / flow["p95_ms"]
    for concurrency in concurrencies:
        if (speedup := ratios.get(f"c{concurrency}_p50_speedup")) is not None:
            target = "target >= 1.3x" if concurrency == 1 else "target >= 1.0x (no slower)"
            progress(f"  {FLOW} c={concurrency}: the flow is {speedup:.2f}x the two calls' p50 "
                     f"({ratios[f'c{concurrency}_p95_speedup']:.2f}x p95); {target}")  # fmt: skip
    return {"flow": FLOW, "stages": stages, "rows": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-url", default=os.environ.get("MAAS_URL", "http://127.0.0.1:8080"))
    parser.add_argument("--key", default=(os.environ.get("MAAS_API_KEY") or "").split(",")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result = measure(args.api_url, args.key, args.seconds, args.warmup)
    result["meta"] = {"load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                      "cpus": os.cpu_count(), "seconds": args.seconds}  # fmt: skip
    print(f"  load average before {load_before}, after {result['meta']['load_after']} ({os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
