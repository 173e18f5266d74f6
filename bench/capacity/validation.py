"""The simulator against what runs here: `bench/open_loop.py`'s in-process sweep on the tiny pipeline, measured,
and the very same arrivals simulated with the CPU tiny profile; one table with both.

The sweep's arrivals are reproduced exactly (`open_loop.poisson_arrivals` with the sweep's rates and seeds), one
worker with the catalog's `max_batch_size`, no autoscaler, nothing outside the worker (the in-process sweep has
no Pub/Sub), and SLO attainment judged against the measured run's own SLO.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import open_loop
from bench.capacity.profiles import CostProfile, load_profiles
from bench.capacity.scenario import catalog_deployments
from bench.capacity.simulator import EXPIRED, Simulation
from bench.capacity.traffic import Arrivals, RequestClass

MODEL = "sd15-txt2img"
TOLERANCE = 0.15


def measure_open_loop(model_dir: Path, requests: int) -> dict:
    """`open_loop.py`'s full sweep, in process, as its `main` runs it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from emulators.stack import local_catalog
    from model_worker.model.pipeline import DiffusionRunner

    spec = local_catalog().get(MODEL)
    runner = DiffusionRunner(spec.model_copy(update={"scheduling": "step"}), model_dir, torch_threads=1)
    runner.warm_up()
    backend = open_loop.InProcessBackend(runner, spec)
    result = open_loop.sweep(backend, open_loop.RATE_MULTIPLES["full"], requests, open_loop.LONE_REPEATS["full"])
    result["multiples"] = list(open_loop.RATE_MULTIPLES["full"])
    return result


def simulate_sweep(measured: dict, profile: CostProfile) -> dict:
    """The measured sweep's arrivals through the simulator: points shaped like `open_loop.sweep`'s."""
    from emulators.stack import local_catalog

    mix_steps = tuple(measured["step_mix"])
    mix = [RequestClass(MODEL, steps, 64, 64) for steps in mix_steps]
    # One worker process with the machine to itself: no GPU time-sharing with another model's pod.
    deployment = [
        replace(d, gpu_share=1.0) for d in catalog_deployments({MODEL}, catalog=local_catalog(), buffer_nodes=0)
    ]
    lone = measured["lone_ms"]["request"]
    service_rate = 1000 / (sum(lone.values()) / len(mix_steps))
    slo = {int(steps): ms / 1000 for steps, ms in measured["slo_ms"].items()}
    points: dict[str, list[dict]] = {s: [] for s in open_loop.SCHEDULINGS}
    multiples = measured.get("multiples", open_loop.RATE_MULTIPLES["full"])
    for index, multiple in enumerate(multiples):
        rate = multiple * service_rate
        sent = open_loop.poisson_arrivals(rate, measured["requests_per_rate"], index, mix_steps)
        arrivals = Arrivals(np.array([a.at for a in sent]),
                            np.array([mix_steps.index(a.steps) for a in sent], dtype=np.int32), mix)  # fmt: skip
        for scheduling in open_loop.SCHEDULINGS:
            result = Simulation(arrivals, deployment, profile, scheduling, initial_replicas={MODEL: 1},
                                autoscale=False).run()  # fmt: skip
            latencies = {i: float(result.done[i] - arrivals.times[i]) for i in range(len(sent))
                         if result.outcome[i] != EXPIRED}  # fmt: skip
            span = max(max((float(result.done[i]) for i in latencies), default=0.0), sent[-1].at)
            points[scheduling].append({"scheduling": scheduling, "offered_rps": round(rate, 2),
                                       **open_loop.summarize(sent, latencies, span, slo)})  # fmt: skip
    lone_sim = {}
    for scheduling in open_loop.SCHEDULINGS:
        lone_sim[scheduling] = {}
        for steps in mix_steps:
            alone = Arrivals(np.array([0.0]), np.array([mix_steps.index(steps)], dtype=np.int32), mix)
            result = Simulation(alone, deployment, profile, scheduling, initial_replicas={MODEL: 1},
                                autoscale=False).run()  # fmt: skip
            lone_sim[scheduling][str(steps)] = float(result.done[0]) * 1000
    return {"points": points, "lone_ms": lone_sim}


def comparison(measured: dict, simulated: dict) -> list[dict]:
    rows = []
    for scheduling in open_loop.SCHEDULINGS:
        for m, s in zip(measured["points"][scheduling], simulated["points"][scheduling], strict=True):
            row = {"offered_rps": m["offered_rps"], "scheduling": scheduling}
            for key in ("p50_ms", "p95_ms", "p99_ms", "slo_attainment"):
                row[key] = (m[key], s[key])
                row[f"{key}_error"] = _relative(s[key], m[key])
            rows.append(row)
    return sorted(rows, key=lambda r: (r["offered_rps"], r["scheduling"]))


def _relative(simulated: float, measured: float) -> float:
    if not (math.isfinite(simulated) and math.isfinite(measured)) or measured == 0:
        return 0.0 if simulated == measured else math.inf
    return (simulated - measured) / measured


def markdown(measured: dict, simulated: dict, rows: list[dict], profile: CostProfile) -> str:
    lone_m, lone_s = measured["lone_ms"], simulated["lone_ms"]
    steps = " / ".join(map(str, measured["step_mix"]))
    lines = [
        "## Simulated against measured: bench/open_loop.py, in process, tiny pipeline",
        "",
        f"Profile `cpu-tiny`: {profile.source} {json.dumps(profile.meta)}",
        f"Lone latency ms ({steps} steps), measured / simulated: request-level "
        f"{' / '.join(f'{v:.0f}' for v in lone_m['request'].values())} / "
        f"{' / '.join(f'{v:.0f}' for v in lone_s['request'].values())}, step-level "
        f"{' / '.join(f'{v:.0f}' for v in lone_m['step'].values())} / "
        f"{' / '.join(f'{v:.0f}' for v in lone_s['step'].values())}; "
        f"{measured['requests_per_rate']} Poisson arrivals per rate and scheduling, the same in both.",
        "",
        "| offered req/s | scheduling | p50 ms meas. / sim. | p95 ms | p99 ms | SLO attainment | within 15% |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"{row['offered_rps']:.1f}", f"{row['scheduling']}-level"]
        for key in ("p50_ms", "p95_ms", "p99_ms"):
            m, s = row[key]
            cells.append(f"{m:.0f} / {s:.0f} ({row[f'{key}_error']:+.0%})")
        m, s = row["slo_attainment"]
        cells.append(f"{m:.0%} / {s:.0%} ({100 * (s - m):+.0f} pt)")
        errors = [abs(row[f"{k}_error"]) for k in ("p50_ms", "p95_ms", "p99_ms")]
        ok = all(e <= TOLERANCE for e in errors) and abs(s - m) <= TOLERANCE
        cells.append("yes" if ok else "no")
        lines.append("| " + " | ".join(cells) + " |")
    within = sum(
        1
        for r in rows
        if all(abs(r[f"{k}_error"]) <= TOLERANCE for k in ("p50_ms", "p95_ms", "p99_ms"))
        and abs(r["slo_attainment"][1] - r["slo_attainment"][0]) <= TOLERANCE
    )
    lines += ["", f"{within} of {len(rows)} points within 15% on all three percentiles and 15 points of attainment."]
    return "\n".join(lines) + "\n"


def run_validation(model_dir: Path, measured_path: Path | None, requests: int, out: Path, remeasure: bool) -> None:
    began = {"utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()}
    if remeasure:
        from bench.capacity.profiles import gpu_profiles, measure_cpu_tiny, save_profile

        save_profile(measure_cpu_tiny(model_dir))
        for derived in gpu_profiles():
            save_profile(derived)
        print("measured the cpu-tiny profile", flush=True)
    if measured_path:
        measured = json.loads(measured_path.read_text())
    else:
        measured = measure_open_loop(model_dir, requests)
        ended = {"utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()}
        measured["run"] = {"began_utc": began["utc"], "ended_utc": ended["utc"],
                           "load_average_before": round(began["load_average"][0], 2),
                           "load_average_after": round(ended["load_average"][0], 2)}  # fmt: skip
    profile = load_profiles()["cpu-tiny"]
    simulated = simulate_sweep(measured, profile)
    rows = comparison(measured, simulated)
    ended = {"utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()}
    text = markdown(measured, simulated, rows, profile)
    if measured_path:
        run = measured.get("run", {})
        text += (f"\nMeasured: `{measured_path}` ({run.get('began_utc', '?')} to {run.get('ended_utc', '?')}, load "
                 f"average {run.get('load_average_before', '?')} before, {run.get('load_average_after', '?')} after).\n")  # fmt: skip
    else:
        text += (
            f"\nMeasured {began['utc']} to {ended['utc']}, load average {_load(began)} before, {_load(ended)} after.\n"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"measured": measured, "simulated": simulated, "rows": rows,
                                                    "began": began, "ended": ended}, indent=1, default=str))  # fmt: skip
    print(text)


def _load(stamp: dict) -> str:
    return " / ".join(f"{v:.1f}" for v in stamp["load_average"])
