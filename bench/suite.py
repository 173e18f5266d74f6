"""`make bench`: the whole benchmark suite in one bounded run, every number measured side by side.

    .venv/bin/python -m bench.suite            # full suite (README Performance says how long)
    .venv/bin/python -m bench.suite --quick    # a ~2-minute subset
    .venv/bin/python -m bench.suite --smoke    # every scenario at its smallest size: no figure, only that it runs
    .venv/bin/python -m bench.suite --part in-process   # only the worker's code in processes of its own (no stack)

The tests run the smoke in two parts: `--part service` against a test stack (tests/integration/
test_bench_scenarios.py) and `--part in-process` with no stack at all (tests/unit/test_bench_in_process.py).

Uses the stack at MAAS_STACK_PORT_OFFSET / MAAS_STACK_DIR (default 12000 / .stack-bench) if it is running,
else brings one up there and stops it at the end. Runs the benchmark's own API process (the real app,
with its Pub/Sub admin calls counted: `bench.counted_api`) in each reply mode in turn, beside the stack's
workers. Writes results.json, results.md and the plots under bench/results/ (bench/results/quick/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from bench import admin_ops, flows, open_loop, report
from bench.breakdown import median_stages
from bench.loadgen import run_closed_loop, summarize
from bench.pubsub_floor import PubSubRoundTrips
from bench.scenarios import (
    BenchApi,
    bench_config,
    cache_available,
    fresh_seed,
    job_caller,
    jobs_available,
    predict_body,
    predict_caller,
    tiny_model_dir,
    worker_batches,
)
from contract import google_clients, naming
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import ROOT, StackConfig, down, up

MODES = ("per-instance", "per-request")
PARTS = ("all", "service", "in-process")


def plan(quick: bool, smoke: bool = False) -> dict:
    """Which HTTP scenarios run in each reply mode: (model, concurrency) pairs."""
    if smoke:  # each model and mode once, at the smallest concurrency that still runs two callers
        return {"per-instance": [("noop", 2), ("sleep", 1), ("sd15-txt2img", 1)], "per-request": [("noop", 2)]}
    if quick:
        return {
            "per-instance": [("noop", 1), ("noop", 32), ("sleep", 1), ("sleep", 16), ("sd15-txt2img", 4)],
            "per-request": [("noop", 1), ("noop", 32), ("sleep", 16)],
        }
    full = [("noop", 1), ("noop", 8), ("noop", 32), ("sleep", 1), ("sleep", 16), ("sd15-txt2img", 4)]
    return {"per-instance": full, "per-request": full}


class Suite:
    def __init__(self, config: StackConfig, quick: bool, out_dir: Path, smoke: bool = False, part: str = "all") -> None:
        self.config = config
        # smoke: every scenario at its smallest size (a test that each runs; its numbers mean nothing)
        self.smoke = smoke
        self.quick = quick or smoke
        self.out_dir = out_dir
        self.warmup = 0.2 if smoke else 1.0 if quick else 2.0
        self.seconds = 0.5 if smoke else 5.0 if quick else 10.0
        self.rows: list[dict] = []
        self.unavailable: dict[str, str] = {}
        # Scenarios that could not run: the suite's exit status says so (a number not measured is not a pass).
        self.failed: list[str] = []
        self.available: dict[str, bool] = {}
        self.key = config.api_keys.split(",")[0]
        self.redis = redis.Redis.from_url(f"redis://127.0.0.1:{config.redis_port}/0")
        self.count = 0
        # floor, naive, http, cache/jobs, flows, adapters, streams, batch jobs, interactive beside a batch, the open
        # loop through the system; in process: direct, step caches, inpainting and editing, the open loop in process
        in_process, service = 4, 3 + sum(len(v) for v in plan(self.quick, smoke).values()) + 2 + 1 + 1 + 1 + 1 + 1 + 1
        self.total = {"all": in_process + service, "in-process": in_process, "service": service}[part]

    @property
    def size(self) -> str:
        """The open-loop sweeps' size (bench/open_loop.py's tables): full, quick or smoke."""
        return "smoke" if self.smoke else "quick" if self.quick else "full"

    def progress(self, row: dict, started: float) -> None:
        self.count += 1
        mode = f" [{row['mode']}]" if row.get("mode") else ""
        extra = f", mean batch {row['mean_batch']:.1f}" if row.get("mean_batch") else ""
        print(
            f"[{self.count:>2}/{self.total}] {row['scenario']}{mode} c={row['concurrency']}: {row['rps']:.1f} req/s, "
            f"p50 {row['p50_ms']:.1f} / p95 {row['p95_ms']:.1f} / p99 {row['p99_ms']:.1f} ms, "
            f"{row['errors']} errors{extra} ({time.monotonic() - started:.0f}s)",
            flush=True,
        )

    def measure(self, scenario: str, mode: str | None, concurrency: int, make_caller: Callable, **extra) -> dict:
        started = time.monotonic()
        samples, window = run_closed_loop(make_caller, concurrency, self.seconds, self.warmup)
        row = {"scenario": scenario, "mode": mode, **summarize(samples, window, concurrency), **extra}
        row["requests_sent"] = len(samples)
        in_window = [s for s in samples if window[0] <= s.ended <= window[1] and s.ok]
        if any(s.timings for s in in_window):
            row["stages"] = median_stages([(s.latency_ms, s.timings) for s in in_window])
        hits = [s.timings["cache_hit"] for s in in_window if "cache_hit" in s.timings]
        if hits:
            row["cache_hit_ratio"] = sum(hits) / len(hits)
        self.rows.append(row)
        self.progress(row, started)
        return row

    def pubsub(self) -> None:
        trips = PubSubRoundTrips(self.config.project_id)
        try:
            for concurrency in (1, 32):
                self.measure("pubsub floor", None, concurrency, trips.floor_caller)
            trips.close_floor()
            self.measure("naive per-request", None, 32, trips.naive_caller)
        finally:
            trips.close()

    def http(self, api: BenchApi) -> None:
        for mode in MODES:
            print(f"-- API in {mode} mode", flush=True)
            api.start(mode)
            for model, concurrency in plan(self.quick, self.smoke)[mode]:
                before_ops = admin_ops.read_counts(self.redis)
                before_batches = worker_batches(self.config, model)
                row = self.measure(
                    model, mode, concurrency,
                    predict_caller(api.url, self.key, model, lambda _n, model=model: predict_body(model, fresh_seed())),
                )  # fmt: skip
                row["admin_ops"] = admin_ops.difference(before_ops, admin_ops.read_counts(self.redis))
                images, calls = (a - b for a, b in zip(worker_batches(self.config, model), before_batches, strict=True))
                row["mean_batch"] = images / calls if calls else None
                row["pipeline_calls"] = calls
            if mode == "per-request":
                row["leaked_reply_subscriptions"] = self.reply_subscriptions_left()
            if mode == "per-instance":
                self.optional_features(api)
        api.stop()

    def optional_features(self, api: BenchApi) -> None:
        self.available["cache"] = cache_available(api.url, self.key)
        if self.available["cache"]:
            fixed = predict_body("noop", fresh_seed())
            self.measure("noop cache hits", api.mode, 32, predict_caller(api.url, self.key, "noop", lambda n: fixed))
        else:
            self.unavailable["noop cache hits c=32"] = "not available yet (no X-Cache header)"
            self.skip("noop cache hits c=32: not available yet (the API sends no X-Cache header)")
        self.available["jobs"] = jobs_available(api.url, self.key)
        if self.available["jobs"]:
            self.measure("noop async job submit-to-result", api.mode, 8, job_caller(api.url, self.key, "noop"))
        else:
            self.unavailable["noop async jobs c=8"] = "not available yet (no /jobs route)"
            self.skip("noop async jobs c=8: not available yet (POST /v1/models/noop/jobs is not a route)")

    def skip(self, what: str) -> None:
        self.count += 1
        print(f"[{self.count:>2}/{self.total}] {what}", flush=True)

    def reply_subscriptions_left(self) -> int:
        subscriber = google_clients.subscriber_client()
        try:
            prefix = naming.reply_subscription("")
            names = subscriber.list_subscriptions(request={"project": f"projects/{self.config.project_id}"})
            return sum(1 for s in names if s.name.rsplit("/", 1)[-1].startswith(prefix))
        finally:
            subscriber.close()

    def flows(self, api: BenchApi) -> dict | None:
        """A two-stage flow against its two models called one after another by a client (bench/flows.py)."""
        started = time.monotonic()
        self.count += 1
        print(f"[{self.count:>2}/{self.total}] flows: {flows.FLOW} vs its two models called by a client:", flush=True)
        api.start("per-instance")
        try:
            # A flow at C=8 takes seconds: a window of several of its latencies, not the suite's 10 s.
            seconds = self.seconds if self.smoke else flows.QUICK_SECONDS if self.quick else flows.SECONDS
            result = flows.measure(api.url, self.key, seconds, self.warmup, lambda line: print(line, flush=True),
                                   concurrencies=(1,) if self.smoke else flows.CONCURRENCIES)  # fmt: skip
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - one scenario's failure leaves the rest of the suite
            print(f"  failed: {exc}", flush=True)
            self.failed.append("flows")
            return None
        finally:
            api.stop()
        print(f"  ({time.monotonic() - started:.0f}s)", flush=True)
        return result

    def direct(self) -> dict | None:
        started = time.monotonic()
        out = self.out_dir / "tiny_direct.json"
        argv = [sys.executable, "-m", "bench.tiny_direct", "--model-dir", str(tiny_model_dir(self.config, "sd15-txt2img")),
                "--json", str(out), "--seconds", "0.2" if self.smoke else "2" if self.quick else "5"]  # fmt: skip
        if self.quick:
            argv += ["--batches", "1"] if self.smoke else ["--batches", "1", "4"]
        env = {**os.environ, "MAAS_TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        self.count += 1
        if done.returncode != 0:
            print(f"[{self.count:>2}/{self.total}] tiny pipeline direct: failed\n{done.stderr[-2000:]}", flush=True)
            self.failed.append("tiny pipeline direct")
            return None
        result = json.loads(out.read_text())
        summary = ", ".join(
            f"batch {r['batch']}: direct {r['direct']['images_per_s']:.1f} / worker path {r['worker']['images_per_s']:.1f} img/s"
            for r in result["rows"]
        )
        print(f"[{self.count:>2}/{self.total}] tiny pipeline in one process: {summary} ({time.monotonic() - started:.0f}s)",
              flush=True)  # fmt: skip
        return result

    def adapters(self) -> dict | None:
        """LoRA adapters on the runner: per-call cost against none, and the load time (bench/adapters.py)."""
        return self._module("LoRA adapters", "bench.adapters", "adapters.json", 300,
                            ["--model-root", str(tiny_model_dir(self.config, "sd15-txt2img").parent),
                             "--calls", "2" if self.smoke else "15" if self.quick else "40",
                             # smoke: one UNet family and one transformer family (the same code for the others)
                             *(["--batches", "1", "--families", "sd15", "flux"] if self.smoke else [])],
                            {"MAAS_TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip

    def step_caches(self) -> dict | None:
        """Step caches on the runner: per call and per image with all, half and no images skipping against no cache,
        and the decision's cost (bench/step_cache.py)."""
        return self._module("Step caches", "bench.step_cache", "step_cache.json", 300,
                            ["--model-root", str(tiny_model_dir(self.config, "sd15-txt2img").parent),
                             *(["--smoke"] if self.smoke else ["--repeats", "1"] if self.quick else [])],
                            {"HF_HUB_OFFLINE": "1"})  # fmt: skip

    def edit_scheduling(self) -> dict | None:
        """Inpainting and editing mixed with text-to-image, step-level against request-level on the stack's tiny
        models (bench/step_vs_request.py --mixed)."""
        size = ["--smoke"] if self.smoke else ["--images", "8", "--steps", "4"] if self.quick else ["--images", "16",
                                                                                                   "--steps", "8"]  # fmt: skip
        return self._module("Inpainting and editing, step against request level", "bench.step_vs_request",
                            "edit_scheduling.json", 300,
                            ["--mixed", str(tiny_model_dir(self.config, "sd15-txt2img").parent), *size],
                            {"HF_HUB_OFFLINE": "1"})  # fmt: skip

    def _module(
        self, title: str, module: str, json_name: str, timeout: float, args: list[str], env: dict
    ) -> dict | None:
        """Runs a benchmark module in a process of its own, prints what it printed; its --json result, or None."""
        started = time.monotonic()
        out = self.out_dir / json_name
        argv = [sys.executable, "-m", module, "--json", str(out), *args]
        try:
            done = subprocess.run(
                argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            self.count += 1
            print(f"[{self.count:>2}/{self.total}] {title}: gave up after {exc.timeout:.0f}s", flush=True)
            self.failed.append(title)
            return None
        self.count += 1
        if done.returncode != 0:
            print(f"[{self.count:>2}/{self.total}] {title}: failed\n{done.stderr[-2000:]}", flush=True)
            self.failed.append(title)
            return None
        print(f"[{self.count:>2}/{self.total}] {title} ({time.monotonic() - started:.0f}s):\n{done.stdout}", flush=True)
        return json.loads(out.read_text())

    def open_loop_in_process(self) -> dict | None:
        """The open-loop sweep against the worker's stages alone (a process of its own: one torch thread)."""
        started = time.monotonic()
        out = self.out_dir / "open_loop_in_process.json"
        argv = [sys.executable, "-m", "bench.open_loop", "--json", str(out),
                "--model-dir", str(tiny_model_dir(self.config, "sd15-txt2img"))] + (["--smoke"] if self.smoke else ["--quick"] if self.quick else [])  # fmt: skip
        env = {**os.environ, "MAAS_TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.count += 1
        print(f"[{self.count:>2}/{self.total}] open loop, in process:", flush=True)
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        except subprocess.TimeoutExpired as exc:
            print(f"  gave up after {exc.timeout:.0f}s (a crowded machine?)", flush=True)
            self.failed.append("open loop, in process")
            return None
        print("\n".join(line for line in done.stdout.splitlines() if line.startswith("  ")), flush=True)
        if done.returncode != 0:
            print(f"  failed\n{done.stderr[-2000:]}", flush=True)
            self.failed.append("open loop, in process")
            return None
        print(f"  ({time.monotonic() - started:.0f}s)", flush=True)
        return json.loads(out.read_text())

    def open_loop_system(self, api: BenchApi) -> dict | None:
        """The same sweep through the API, Pub/Sub and the model's worker, one scheduling's worker at a time."""
        from bench.open_loop_system import SystemBackend

        started = time.monotonic()
        self.count += 1
        print(f"[{self.count:>2}/{self.total}] open loop, through the whole system:", flush=True)
        api.start("per-instance")
        try:
            backend = SystemBackend(self.config, api.url, self.key)
            kind = self.size
            result = open_loop.sweep(backend, open_loop.SYSTEM_RATE_MULTIPLES[kind], open_loop.SYSTEM_REQUESTS_PER_RATE[kind],
                                     repeats=open_loop.LONE_REPEATS[kind], progress=lambda line: print(line, flush=True))  # fmt: skip
            result["worker_restarts"] = backend.restarts
        finally:
            api.stop()
        print(f"  ({time.monotonic() - started:.0f}s)", flush=True)
        return result

    def event_streams(self) -> dict | None:
        """1,000 open job event streams on one API instance (bench/api_event_streams.py, its own API process)."""
        return self._module("event streams", "bench.api_event_streams", "event_streams.json", 600,
                            ["--streams", "4", "--jobs", "2", "--seconds", "0.5"] if self.smoke else
                            ["--streams", "200" if self.quick else "1000", "--seconds", "5" if self.quick else "10"],
                            {"MAAS_STACK_DIR": str(self.config.stack_dir)})  # fmt: skip

    def batch_jobs(self) -> dict | None:
        """Batch jobs against predicts at C=32, and the API's memory reading a 1,000,000-line file (bench/batches.py)."""
        size = ["--smoke"] if self.smoke else ["--quick"] if self.quick else []
        return self._module("batch jobs", "bench.batches", "batches.json", 2400, size,
                            {"MAAS_STACK_DIR": str(self.config.stack_dir)})  # fmt: skip

    def batch_beside(self) -> dict | None:
        """Sequential tiny SD 1.5 predicts alone and beside a 400-line batch of the same model (bench/batch_beside.py)."""
        return self._module("interactive beside a batch", "bench.batch_beside", "batch_beside.json", 1200,
                            ["--rounds", "1", "--predicts", "2", "--lines", "32"] if self.smoke else
                            ["--rounds", "1" if self.quick else "3"],
                            {"MAAS_STACK_DIR": str(self.config.stack_dir)})  # fmt: skip


def build_tiny_models(config: StackConfig) -> None:
    """The stack's tiny models in `config.tiny_model_dir`, built where missing (what the stack's start does, less the
    upload); a build beside a stack's waits for it (one build at a time in the folder)."""
    subprocess.run([sys.executable, "-m", "emulators.tiny_pipeline", "--out", str(config.tiny_model_dir)], cwd=ROOT,
                   env={**os.environ, **config.service_env()}, check=True, capture_output=True, timeout=900)  # fmt: skip


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def exit_status(failed: list[str]) -> int:
    """Non-zero when any scenario could not run, after saying which."""
    if failed:
        print(f"\nFAILED (did not run): {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the ~2-minute subset")
    parser.add_argument("--smoke", action="store_true", help="every scenario at its smallest size (the tests' run)")
    parser.add_argument("--open-loop-only", action="store_true", help="only the open-loop scheduling sweeps")
    parser.add_argument("--flows-only", action="store_true", help="only the flows scenario (bench/flows.py)")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results, or bench/results/quick)")
    parser.add_argument("--part", choices=PARTS, default="all",
                        help="service: the scenarios through a stack's API and workers; in-process: the worker's code "
                        "in processes of its own (no stack; the tiny models built where missing); all: both")  # fmt: skip
    args = parser.parse_args()
    service, in_process = args.part in ("all", "service"), args.part in ("all", "in-process")
    out_dir = args.out or ROOT / "bench" / "results" / ("quick" if args.quick or args.smoke else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = bench_config()
    began = time.monotonic()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    owned = service and not http_ok(f"{config.api_url}/readyz")
    if not service:
        print(f"No stack: the tiny models in {config.tiny_model_dir}", flush=True)
        build_tiny_models(config)
    elif owned:
        print(f"Bringing up a stack at port offset {config.port_offset} in {config.stack_dir}...", flush=True)
        up(config)
        ProcessRegistry(config.stack_dir).stop("api")  # the benchmark runs its own API, one mode at a time
        print(f"stack ready in {time.monotonic() - began:.0f}s", flush=True)
    else:
        print(f"Using the running stack at {config.api_url}", flush=True)
    os.environ.update(config.client_env())
    suite = Suite(config, args.quick, out_dir, smoke=args.smoke, part=args.part)
    api = BenchApi(config, ProcessRegistry(config.stack_dir / "bench"), config.api_port + 1)
    direct = event_streams = adapters = flow_result = batch_jobs = batch_beside = step_caches = edit_scheduling = None
    sweeps: dict[str, dict] = {}
    try:
        if args.flows_only:
            flow_result = suite.flows(api)
            meta = {"when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
                    "cpus": os.cpu_count(), "load_before": load_before,
                    "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "seconds": flows.SECONDS}  # fmt: skip
            (out_dir / "flows.json").write_text(json.dumps({"meta": meta, "flows": flow_result}, indent=2))
            print(f"\nWrote {out_dir / 'flows.json'} (load average before {load_before}, after {meta['load_after']})")
            return exit_status(suite.failed)
        if not args.open_loop_only and service:
            suite.pubsub()
            suite.http(api)
            flow_result = suite.flows(api)
        if not args.open_loop_only and in_process:
            direct = suite.direct()
            step_caches = suite.step_caches()
            edit_scheduling = suite.edit_scheduling()
        if not args.open_loop_only and service:
            adapters = suite.adapters()  # its adapters uploaded to the stack's bucket
            event_streams = suite.event_streams()
            batch_jobs = suite.batch_jobs()
            batch_beside = suite.batch_beside()
        for title, run, runs in (("in process (worker stages, tiny pipeline)", suite.open_loop_in_process, in_process),
                                 ("whole system (API, Pub/Sub, worker)", lambda: suite.open_loop_system(api), service)):  # fmt: skip
            if runs and (result := run()) is not None:
                sweeps[title] = result
    finally:
        api.stop()
        if owned:
            print("Stopping the stack the benchmark started...", flush=True)
            down(config)
    result = {
        "meta": {
            "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(),
            "quick": args.quick,
            "smoke": args.smoke,
            "part": args.part,
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "warmup_seconds": suite.warmup,
            "seconds": suite.seconds,
            "stack": "none" if not service else "started by the benchmark" if owned else "already running",
            "wall_seconds": round(time.monotonic() - began, 1),
        },
        "rows": suite.rows,
        "unavailable": suite.unavailable,
        "direct": direct,
        "open_loop": sweeps,
        "event_streams": event_streams,
        "batches": batch_jobs,
        "batch_beside": batch_beside,
        "adapters": adapters,
        "step_caches": step_caches,
        "edit_scheduling": edit_scheduling,
        "flows": flow_result,
    }
    plot = None
    if sweeps:  # their own files too, so an --open-loop-only run leaves the suite's results alone
        (out_dir / "open_loop.json").write_text(json.dumps({"meta": result["meta"], "sweeps": sweeps}, indent=2))
        (out_dir / "open_loop.md").write_text(open_loop.markdown(sweeps))
        plot = open_loop.plot(sweeps, out_dir / "open_loop.png")
    if args.open_loop_only:
        print(f"\nWrote {out_dir / 'open_loop.json'}, {out_dir / 'open_loop.md'}, {plot}")
        for title, sweep in sweeps.items():
            print(f"  open loop, {title}:")
            open_loop.print_targets(sweep, lambda line: print("  " + line))
        return exit_status(suite.failed)
    result["admin"] = report.admin_rows(suite.rows)
    result["targets"] = report.evaluate_targets(suite.rows, direct, suite.available)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2, default=str))
    (out_dir / "results.md").write_text(report.markdown(result) + "\n" + open_loop.markdown(sweeps))
    written = report.plots(result, out_dir)
    if plot is not None:
        written.append(plot)
    print("\nTargets (measured in this run):")
    for t in result["targets"]:
        measured = "–" if t["measured"] is None else f"{t['measured']:.1f}"
        threshold = "–" if t["threshold"] is None else f"{t['threshold']:.1f}"
        print(f"  {t['result']:<18} {t['target']}: {measured} {t['unit']} (target {threshold})")
    for title, sweep in sweeps.items():
        print(f"  open loop, {title}:")
        open_loop.print_targets(sweep, lambda line: print("  " + line))
    for a in result["admin"]:
        allowed = (
            "not capped (admin ops only at process start)"
            if a["sustainable_rps"] is None
            else f"{a['sustainable_rps']:.0f} req/s"
        )
        print(f"  admin ops {a['mode']}: {a['ops_per_request']:.3f}/request -> {allowed} under 6,000/min")
    print(f"\nWrote {out_dir / 'results.json'}, {out_dir / 'results.md'}, {', '.join(p.name for p in written)} "
          f"in {time.monotonic() - began:.0f}s")  # fmt: skip
    return exit_status(suite.failed)


if __name__ == "__main__":
    sys.exit(main())
