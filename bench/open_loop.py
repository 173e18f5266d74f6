"""Open-loop load (Poisson arrivals), request-level against step-level scheduling, side by side in one run.

Closed-loop clients cannot show queueing: with fewer clients than a batch holds, no scheduler can fill a
batch. Here requests arrive at random (exponential gaps) at a fixed offered rate whatever happens to the
ones before, half asking for 4 denoising steps and half for 12 (sizes equal), and each scheduler gets the
very same arrivals. Per offered rate: throughput, p50/p95/p99 latency, and SLO attainment, the share of
requests answered within 2x the unloaded latency of a request like it (its step count), measured in the
same run. This module is the in-process sweep (the worker's pool, device loop, running set and finisher
around the tiny pipeline, Pub/Sub, Redis and the bucket in memory); `open_loop_system.py` runs the same
sweep through the whole system.

    .venv/bin/python -m bench.open_loop --model-dir .stack/tiny-model/sd15-txt2img --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.report import target_row

SCHEDULINGS = ("request", "step")
# Half short, half long requests: what one long request holding a batch slot does to the short ones.
STEP_MIX = (4, 12)
SLO_FACTOR = 2.0
# Offered rates as multiples of the unloaded service rate (1 / mean lone latency of the mix). The full sweep
# starts at a quarter so that request-level reaches 90% somewhere (at half it sat at 88-92%), or the first
# target has no rate to be judged at.
RATE_MULTIPLES = {"full": (0.25, 0.5, 1.0, 1.5, 2.0, 3.0), "quick": (0.5, 1.5), "smoke": (1.0,)}
# Arrivals per offered rate and scheduling: a count, not a duration, so a slow (shared) machine still gets
# as many samples at each rate.
REQUESTS_PER_RATE = {"full": 24, "quick": 12, "smoke": 2}
# Lone latencies are medians over this many requests per step count and scheduling, the two interleaved: with
# 3, one preempted request on a shared machine moved a median by 20-50% (equal minimums, 1.06-1.24x medians).
LONE_REPEATS = {"full": 11, "quick": 5, "smoke": 1}
# Through the whole system each change of scheduling restarts the worker: fewer rates in the quick run.
SYSTEM_RATE_MULTIPLES = {"full": (0.5, 1.5, 3.0), "quick": (1.5,), "smoke": (1.0,)}
SYSTEM_REQUESTS_PER_RATE = {"full": 16, "quick": 8, "smoke": 2}
ATTAINMENT_LEVEL = 0.9


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start of the run
    steps: int
    seed: int


def poisson_arrivals(rate: float, count: int, seed: int, mix: tuple[int, ...] = STEP_MIX) -> list[Arrival]:
    """`count` arrivals with exponential gaps at `rate` per second; step counts drawn evenly from `mix`."""
    draw = random.Random(seed)
    arrivals, at = [], 0.0
    for _ in range(count):
        at += draw.expovariate(rate)
        arrivals.append(Arrival(at, draw.choice(mix), draw.randrange(2**31)))
    return arrivals


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile; unanswered requests count as infinitely late."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def summarize(arrivals: list[Arrival], latencies: dict[int, float], span: float, slo: dict[int, float]) -> dict:
    """`latencies` by arrival index (seconds; missing = unanswered); `slo` by step count (seconds)."""
    values = [latencies.get(i, math.inf) for i in range(len(arrivals))]
    met = sum(1 for i, a in enumerate(arrivals) if values[i] <= slo[a.steps])
    answered = [v for v in values if v != math.inf]
    return {
        "requests": len(arrivals),
        "answered": len(answered),
        "throughput_rps": len(answered) / span if span > 0 else math.nan,
        "p50_ms": percentile(values, 0.50) * 1000,
        "p95_ms": percentile(values, 0.95) * 1000,
        "p99_ms": percentile(values, 0.99) * 1000,
        "slo_attainment": met / len(arrivals) if arrivals else math.nan,
    }


def highest_rate_keeping(points: list[dict], level: float = ATTAINMENT_LEVEL) -> float | None:
    """The highest offered rate with attainment >= level, interpolated to where it crosses the level."""
    points = sorted(points, key=lambda p: p["offered_rps"])
    best = None
    for before, after in zip([None, *points], points, strict=False):
        if after["slo_attainment"] >= level:
            best = after["offered_rps"]
            continue
        if before is not None and before["slo_attainment"] >= level:
            share = (before["slo_attainment"] - level) / (before["slo_attainment"] - after["slo_attainment"])
            best = before["offered_rps"] + share * (after["offered_rps"] - before["offered_rps"])
        break
    return best


def targets(sweep: dict) -> list[dict]:
    """The issue's three targets for one sweep (PASS/MISS; measured, never asserted)."""
    by = {s: sorted(sweep["points"][s], key=lambda p: p["offered_rps"]) for s in SCHEDULINGS}
    rows = []
    request_ok = [p for p in by["request"] if p["slo_attainment"] >= ATTAINMENT_LEVEL]
    if request_ok:
        rate = request_ok[-1]["offered_rps"]
        step_there = next(p for p in by["step"] if p["offered_rps"] == rate)["slo_attainment"]
        rows.append(_target(f"step-level attainment at {rate:.1f} req/s (request-level's highest >= 90%)",
                            step_there * 100, 98.0, True, "%"))  # fmt: skip
    else:
        rows.append(_target("step-level attainment where request-level reaches 90%", None, 98.0, True, "%"))
    request_rate, step_rate = highest_rate_keeping(by["request"]), highest_rate_keeping(by["step"])
    ratio = step_rate / request_rate if request_rate and step_rate else None
    bound = (
        " (a lower bound: step-level kept 90% at the highest rate swept)"
        if (by["step"] and by["step"][-1]["slo_attainment"] >= ATTAINMENT_LEVEL)
        else ""
    )
    rows.append(_target(f"highest rate keeping 90%: step-level / request-level{bound}", ratio, 1.4, True, "x"))
    for steps in sweep["step_mix"]:
        lone = sweep["lone_ms"]
        ratio = lone["step"][str(steps)] / lone["request"][str(steps)]
        rows.append(_target(f"lone {steps}-step request: step-level / request-level latency", ratio, 1.05, False, "x"))
    return rows


def _target(name: str, measured: float | None, threshold: float, higher_is_better: bool, unit: str) -> dict:
    return target_row(name, measured, threshold, higher_is_better, unit, missing="NOT REACHED")


class InProcessWorker:
    """The worker's pool, device loop, running set and finisher around one runner; Pub/Sub stands in as a backlog
    the feeder moves into the pool whenever it has room, as the worker's pullers do."""

    def __init__(self, runner, spec, size: int = 64) -> None:
        from bench.worker_harness import MemoryRedis, MemoryStorage, NoLeases
        from contract.payloads import PayloadCodec
        from contract.stores.results import ResultStore
        from model_worker.held.pool import RequestPool
        from model_worker.serving.device import DeviceLoop, ProgressReporter
        from model_worker.serving.finisher import ReplyFinisher
        from model_worker.serving.health import WorkerHealth
        from model_worker.serving.intake import ReplyFactory
        from model_worker.serving.metrics import WorkerMetrics

        self.spec, self.size = spec, size
        self.answered: dict[str, float] = {}
        self._changed = threading.Condition()
        self.pool = RequestPool(capacity=spec.max_batch_size)
        self.leases = NoLeases()
        results = ResultStore(MemoryRedis(), 3600)
        finisher = ReplyFinisher(self, "bench/replies", results, PayloadCodec(MemoryStorage(), "b", 1 << 20),
                                 self.leases, WorkerMetrics(), threads=2)  # fmt: skip
        self._finisher = finisher
        self.progress = ProgressReporter(results, finisher)
        self.device = DeviceLoop({spec.name: runner}, self.pool, finisher, self.leases, ReplyFactory("bench", {}),
                                 self.progress, WorkerMetrics(), WorkerHealth(3600))  # fmt: skip
        self._backlog: deque = deque()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.device.run, daemon=True),
                         threading.Thread(target=self._feed, daemon=True)]  # fmt: skip

    def publish(self, topic: str, data: bytes, **attributes):
        """The finisher's reply publish: records when each request was answered."""
        from concurrent.futures import Future

        with self._changed:
            self.answered[attributes["request_id"]] = time.perf_counter()
            self._changed.notify_all()
        future: Future = Future()
        future.set_result("id")
        return future

    def start(self) -> InProcessWorker:
        self.progress.start()
        for thread in self._threads:
            thread.start()
        return self

    def submit(self, pending) -> None:
        with self._changed:
            self._backlog.append(pending)
            self._changed.notify_all()

    def _feed(self) -> None:
        while not self._stop.is_set():
            with self._changed:
                self._changed.wait_for(lambda: self._backlog or self._stop.is_set(), 0.5)
            while self._backlog and not self._stop.is_set():
                if self.pool.wait_for_room("normal", timeout=0.5) >= 1:
                    self.pool.add(self._backlog.popleft())

    def wait(self, request_ids: list[str], timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: all(r in self.answered for r in request_ids), timeout)

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self.device.stopping.set()
        self.pool.close()
        for thread in self._threads:
            thread.join(timeout=120)
        self._finisher.close()
        self.progress.stop()


def pending_request(spec, steps: int, seed: int, size: int = 64):
    from contract.messages import GenerationParameters, InferenceRequest, RequestInstance
    from model_worker.held.pool import HeldMessage, PendingRequest
    from model_worker.model.runners import GenerationItem

    request_id = uuid.uuid4().hex
    params = GenerationParameters(seed=seed, num_inference_steps=steps, guidance_scale=spec.defaults.guidance_scale,
                                  width=size, height=size)  # fmt: skip
    request = InferenceRequest(request_id=request_id, model=spec.name, model_version=spec.version,
                               instances=[RequestInstance(prompt=f"open loop {seed}")], parameters=params)  # fmt: skip
    message = HeldMessage(f"bench/{spec.name}", f"ack-{request_id}", {}, b"", 1, time.time())
    return PendingRequest(
        message, spec, request, [GenerationItem(prompt=f"open loop {seed}", seed=seed)], "normal", None
    )


def run_arrivals(worker: InProcessWorker, arrivals: list[Arrival], grace: float) -> tuple[dict[int, float], float]:
    """Submits each arrival at its time; returns latencies by arrival index and the span throughput is over."""
    started = time.perf_counter()
    sent: list[tuple[str, float]] = []
    for arrival in arrivals:
        delay = started + arrival.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pending = pending_request(worker.spec, arrival.steps, arrival.seed, worker.size)
        sent.append((pending.request_id, started + arrival.at))
        worker.submit(pending)
    worker.wait([request_id for request_id, _ in sent], timeout=grace)
    latencies = {i: worker.answered[r] - at for i, (r, at) in enumerate(sent) if r in worker.answered}
    last = max((worker.answered[r] for r, _ in sent if r in worker.answered), default=time.perf_counter())
    return latencies, max(last - started, arrivals[-1].at if arrivals else 0.0)


class InProcessBackend:
    """Both schedulings' in-process workers around one runner, alive together, used one at a time."""

    def __init__(self, runner, spec, mix: tuple[int, ...] = STEP_MIX, size: int = 64) -> None:
        self.mix = mix
        self.workers = {
            s: InProcessWorker(runner, spec.model_copy(update={"scheduling": s}), size).start() for s in SCHEDULINGS
        }

    def lone(self, repeats: int, schedulings: tuple[str, ...] = SCHEDULINGS) -> dict[str, dict[str, float]]:
        """Median latency of a request alone, per scheduling and step count, the schedulings interleaved."""
        seen: dict[str, dict[int, list[float]]] = {s: {n: [] for n in self.mix} for s in schedulings}
        for repeat in range(repeats):
            for steps in self.mix:
                for scheduling in schedulings:
                    worker = self.workers[scheduling]
                    pending = pending_request(worker.spec, steps, 1000 + repeat, worker.size)
                    began = time.perf_counter()
                    worker.submit(pending)
                    worker.wait([pending.request_id], timeout=120)
                    seen[scheduling][steps].append(worker.answered[pending.request_id] - began)
        return median_ms(seen)

    def run(self, scheduling: str, arrivals: list[Arrival], grace: float) -> tuple[dict[int, float], float]:
        return run_arrivals(self.workers[scheduling], arrivals, grace)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()


def median_ms(seen: dict[str, dict[int, list[float]]]) -> dict[str, dict[str, float]]:
    return {s: {str(n): sorted(v)[len(v) // 2] * 1000 for n, v in by.items() if v} for s, by in seen.items()}


def _print(line: str) -> None:
    print(line, flush=True)


def sweep(
    backend,
    multiples: tuple[float, ...],
    requests: int,
    repeats: int,
    progress: Callable = _print,
    rates: tuple[float, ...] | None = None,
    lone_ms: dict | None = None,
) -> dict:
    """The whole comparison: lone latencies, then each offered rate for both schedulings in turn (the order
    alternating from one rate to the next, so drift in the machine's load hits both alike). `rates`: offered
    rates in requests/s instead of `multiples` of the lone service rate (a GPU's batch capacity is far above
    it); `lone_ms`: lone latencies already measured for this mix, not measured again.

    A backend that restarts its worker for each change of scheduling (it has `active`: the system's, seconds a
    restart) measures a scheduling's lone latency just before that scheduling's first run, so the sweep starts each
    scheduling's worker once: request-level's first (the service rate and the SLO come from it)."""
    restarts = hasattr(backend, "active")
    try:
        lone_ms = dict(lone_ms or backend.lone(repeats, ("request",) if restarts else SCHEDULINGS))
        mix = backend.mix
        service_rate = 1000 / (sum(lone_ms["request"].values()) / len(mix))
        slo = {n: SLO_FACTOR * lone_ms["request"][str(n)] / 1000 for n in mix}
        points: dict[str, list[dict]] = {s: [] for s in SCHEDULINGS}
        order = list(SCHEDULINGS)  # request-level first: its worker is the one running now
        printed = False
        for index, rate in enumerate(rates or tuple(multiple * service_rate for multiple in multiples)):
            arrivals = poisson_arrivals(rate, requests, index, mix)
            # Past this wait after the last arrival, what is unanswered counts as missed: bounded overload.
            grace = max(30.0, arrivals[-1].at)
            for scheduling in order:
                if scheduling not in lone_ms:
                    lone_ms.update(backend.lone(repeats, (scheduling,)))
                if all(s in lone_ms for s in SCHEDULINGS) and not printed:
                    printed = True
                    rounded = {s: {n: round(v) for n, v in lone_ms[s].items()} for s in SCHEDULINGS}
                    progress(f"  lone latency ms: {json.dumps(rounded)}")
                latencies, span = backend.run(scheduling, arrivals, grace)
                summary = summarize(arrivals, latencies, span, slo)
                point = {"scheduling": scheduling, "offered_rps": round(rate, 2), **summary}
                points[scheduling].append(point)
                progress(
                    f"  {scheduling:>7}-level at {rate:5.1f} req/s offered: {point['throughput_rps']:5.1f} req/s, "
                    f"p50 {point['p50_ms']:.0f} / p95 {point['p95_ms']:.0f} / p99 {point['p99_ms']:.0f} ms, "
                    f"SLO {point['slo_attainment']:.0%} ({point['answered']}/{point['requests']} answered)"
                )
            order.reverse()
    finally:
        backend.close()
    result = {"lone_ms": lone_ms, "slo_ms": {str(n): v * 1000 for n, v in slo.items()}, "points": points,
              "requests_per_rate": requests, "step_mix": list(mix)}  # fmt: skip
    result["targets"] = targets(result)
    return result


def print_targets(result: dict, progress: Callable = print) -> None:
    for t in result["targets"]:
        measured = "–" if t["measured"] is None else f"{t['measured']:.2f}"
        progress(f"  {t['result']:<11} {t['target']}: {measured} {t['unit']} (target {t['threshold']})")


def plot(sweeps: dict[str, dict], path: Path) -> Path:
    """SLO attainment, throughput and p99 against offered rate, one row per sweep (in-process, whole system)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sweeps), 3, figsize=(13, 3.6 * len(sweeps)), squeeze=False)
    for row, (title, result) in enumerate(sweeps.items()):
        for scheduling, style in zip(SCHEDULINGS, ("o--", "s-"), strict=True):
            points = sorted(result["points"][scheduling], key=lambda p: p["offered_rps"])
            rates = [p["offered_rps"] for p in points]
            p99 = [p["p99_ms"] if math.isfinite(p["p99_ms"]) else math.nan for p in points]
            axes[row][0].plot(rates, [100 * p["slo_attainment"] for p in points], style, label=f"{scheduling}-level")
            axes[row][1].plot(rates, [p["throughput_rps"] for p in points], style, label=f"{scheduling}-level")
            axes[row][2].plot(rates, p99, style, label=f"{scheduling}-level")
        axes[row][0].axhline(90, color="grey", linewidth=0.8)
        axes[row][1].plot(rates, rates, ":", color="grey", linewidth=0.8, label="offered")
        for ax, label in zip(axes[row], ("SLO attainment %", "throughput req/s", "p99 latency ms"), strict=True):
            ax.set_xlabel("offered req/s (Poisson)")
            ax.set_ylabel(label)
            ax.set_title(f"{title}: {label}", fontsize=9)
            ax.legend(fontsize=8)
        axes[row][2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(sweeps: dict[str, dict]) -> str:
    """The open-loop tables and targets, for results.md."""
    lines = ["## Open loop: request-level vs step-level scheduling", ""]
    for title, result in sweeps.items():
        lone = result["lone_ms"]
        lines += [f"### {title}", "",
                  f"lone latency ms ({' / '.join(map(str, result['step_mix']))} steps): request-level "
                  f"{' / '.join(f'{v:.0f}' for v in lone['request'].values())}, step-level "
                  f"{' / '.join(f'{v:.0f}' for v in lone['step'].values())}; SLO = 2x request-level's lone latency",
                  "", "| offered req/s | scheduling | throughput req/s | p50 ms | p95 ms | p99 ms | SLO attainment |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        rows = sorted((p for s in SCHEDULINGS for p in result["points"][s]), key=lambda p: p["offered_rps"])
        for p in rows:
            cells = [f"{p['offered_rps']:.1f}", f"{p['scheduling']}-level", f"{p['throughput_rps']:.1f}"]
            cells += ["∞" if not math.isfinite(p[k]) else f"{p[k]:.0f}" for k in ("p50_ms", "p95_ms", "p99_ms")]
            lines.append("| " + " | ".join([*cells, f"{p['slo_attainment']:.0%}"]) + " |")
        lines += ["", "| target | measured | threshold | result |", "|---|---|---|---|"]
        for t in result["targets"]:
            measured = "–" if t["measured"] is None else f"{t['measured']:.2f} {t['unit']}"
            lines.append(f"| {t['target']} | {measured} | {t['threshold']} {t['unit']} | {t['result']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--model", default="sd15-txt2img")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sweep that runs (bench.suite --smoke)")
    parser.add_argument("--requests", type=int, help="arrivals per offered rate and scheduling (default 30, quick 12)")
    parser.add_argument("--multiples", type=float, nargs="+", help="offered rates, as multiples of the service rate")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("MAAS_TORCH_THREADS", "1")))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from emulators.stack import local_catalog
    from model_worker.model.pipeline import DiffusionRunner

    spec = local_catalog().get(args.model)
    runner = DiffusionRunner(spec.model_copy(update={"scheduling": "step"}), args.model_dir, torch_threads=args.threads)
    runner.warm_up()
    kind = "smoke" if args.smoke else "quick" if args.quick else "full"
    requests = args.requests or REQUESTS_PER_RATE[kind]
    multiples = tuple(args.multiples or RATE_MULTIPLES[kind])
    result = sweep(InProcessBackend(runner, spec), multiples, requests, repeats=LONE_REPEATS[kind])
    result.update({"model": args.model, "threads": args.threads, "size": 64})
    print_targets(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
