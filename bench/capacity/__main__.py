"""How many GPUs a day of traffic needs: `python -m bench.capacity` simulates it (docs/guides/capacity.md).

.venv/bin/python -m bench.capacity                                   # the seed's day on L4s, both schedulings
.venv/bin/python -m bench.capacity --trace day.csv --profile l4-sd15 # a recorded day (traffic.TRACE_SQL)
.venv/bin/python -m bench.capacity --profile h100-sd15 --batching-gain profile  # as deployed on an H100
.venv/bin/python -m bench.capacity --batch-images 200000 --batch-hour 20 # a batch submitted at 20:00 (issue 35)
.venv/bin/python -m bench.capacity burst                             # only the overload bursts (issue 43)
.venv/bin/python -m bench.capacity measure --model-dir DIR           # the CPU tiny pipeline's cost points
.venv/bin/python -m bench.capacity validate --model-dir DIR          # against bench/open_loop.py, measured
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from api_server.predict.admission import SCAN_LIMIT
from bench.capacity.profiles import load_profiles
from bench.capacity.report import (
    batch_table,
    held_gpu_hours,
    hourly_table,
    overload_outcomes,
    overload_table,
    plot,
    summarize,
    summary_table,
)
from bench.capacity.scenario import (
    FALLBACK_STEPS,
    SEED_MIX,
    SEED_REQUESTS,
    catalog_deployments,
    default_strengths,
    fallback_class,
    fallback_deployment,
    lone_seconds,
    profile_gain,
    with_backlog_target,
)
from bench.capacity.simulator import Admission, BatchBacklog, ModelDeployment, PodTiming, Simulation
from bench.capacity.traffic import DayShape, RequestClass, day_arrivals, trace_arrivals, window
from infra.k8s.render import BATCH_BACKLOG_CALLS

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SEED_GPUS = 150
# More than the seed's day can absorb: what it does absorb by its end is the answer (docs/results/capacity.md).
BATCH_IMAGES = 10_000_000
# Issue 43's surges: from a quiet morning (the fleet scaled for a sixth of the surge's rate) and at the day's peak.
SURGE_HOURS = [6.0, 15.0]


def parse_mix(values: list[str] | None) -> list[RequestClass]:
    """`model:steps:width:height:strength:images:share` per class (strength `-` for text-to-image)."""
    if not values:
        return SEED_MIX
    mix = []
    for value in values:
        model, steps, width, height, strength, images, share = value.split(":")
        mix.append(RequestClass(model, int(steps), int(width), int(height),
                                None if strength == "-" else float(strength), int(images), float(share)))  # fmt: skip
    return mix


def day_runs(args: argparse.Namespace) -> None:
    profile = load_profiles()[args.profile]
    if args.trace:
        arrivals = trace_arrivals(args.trace, default_strengths())
    else:
        shape = DayShape(args.requests, peak_hour=args.peak_hour, amplitude=args.amplitude, bursts=args.bursts,
                         burst_factor=args.burst_factor)  # fmt: skip
        arrivals = day_arrivals(shape, parse_mix(args.mix), args.seed, warmup_s=args.warmup)
    models = {c.model for c in arrivals.mix}
    timing = PodTiming(args.node_provision, args.pod_start)
    deployed = catalog_deployments(models, buffer_nodes=args.buffer_nodes, metric_delay_seconds=args.metric_delay)
    if args.batching_gain is not None:
        gains = {dep.model: profile_gain(profile, arrivals.mix, dep) if args.batching_gain == "profile"
                 else float(args.batching_gain) for dep in deployed}  # fmt: skip
        deployed = catalog_deployments(models, buffer_nodes=args.buffer_nodes, metric_delay_seconds=args.metric_delay,
                                       batching_gains=gains)  # fmt: skip
        print("batching_gain " + ", ".join(f"{m} {g:.2f}" for m, g in gains.items())
              + "; deployed targets " + ", ".join(f"{d.scaler.backlog_per_replica:g}" for d in deployed), flush=True)  # fmt: skip
    slo = {}
    for dep in deployed:
        first = max((c for c in arrivals.mix if c.model == dep.model), key=lambda c: c.share)
        slo[dep.model] = args.slo or args.slo_factor * lone_seconds(profile, first, dep, args.overhead)
    settings: list[tuple[str, list[ModelDeployment], bool]] = []
    for target in args.backlog_targets:
        if target == "deployed":
            settings.append(("deployed", deployed, True))
        elif target == "batch":  # the rule before `batching_gain`: one full batch per replica, whatever the device
            one_batch = [replace(d, scaler=replace(d.scaler, name="one batch/replica", backlog_per_replica=d.max_batch_size))
                         for d in deployed]  # fmt: skip
            settings.append(("one batch/replica", one_batch, True))
        else:
            settings.append((f"backlog {target}/replica", with_backlog_target(deployed, float(target), f"backlog {target}/replica"), True))  # fmt: skip
    if args.fixed_replicas:
        fixed = [replace(d, scaler=replace(d.scaler, name=f"fixed {args.fixed_replicas}")) for d in deployed]
        settings.append((f"fixed {args.fixed_replicas}", fixed, False))
    print(f"{len(arrivals):,} arrivals ({args.warmup / 3600:g} h of warm-up first), profile {profile.name}: "
          f"{profile.source}", flush=True)  # fmt: skip
    runs = []
    for scheduling in args.schedulings:
        for name, deployments, autoscale in settings:
            began = time.perf_counter()
            initial = {d.model: (args.fixed_replicas if not autoscale else d.scaler.min_replicas) for d in deployments}
            simulation = Simulation(
                arrivals, deployments, profile, scheduling, timing, args.overhead, initial, autoscale
            )
            result = simulation.run()
            run = summarize(result, slo)
            run["autoscaler"] = name
            run["seconds"] = time.perf_counter() - began
            runs.append(run)
            model = next(iter(run["models"].values()))
            print(f"  {scheduling}-level, {name}: {run['gpu_hours']:,.0f} GPU-hours, peak {run['peak_gpus']:.0f}, "
                  f"p95 {model['p95_s']:.1f} s, SLO {model['slo_attainment']:.1%}, expired {model['expired']:,} "
                  f"({run['seconds']:.0f} s to simulate)", flush=True)  # fmt: skip
    batch_runs = batch_day_runs(args, arrivals, settings, profile, timing, slo, runs)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"{len(arrivals):,} requests ({', '.join(c.label for c in arrivals.mix)}), profile {profile.name}"
    meta = {"title": title, "profile": profile.name, "profile_source": profile.source, "timing": vars(timing),
            "overhead_s": args.overhead, "metric_delay_s": args.metric_delay, "buffer_nodes": args.buffer_nodes,
            "seed": args.seed, "trace": str(args.trace) if args.trace else None, "load_average": os.getloadavg()}  # fmt: skip
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "runs": runs, "batch_runs": batch_runs}, indent=1, default=_jsonable)
    )
    text = f"## {title}\n\n{summary_table(runs)}\n\nGPUs held, mean / peak / busy, and p95 latency, per hour:\n\n{hourly_table(runs)}\n"
    if batch_runs:
        text += f"\n### Batch backlog (issue 35)\n\n{batch_table(batch_runs)}\n"
    out.with_suffix(".md").write_text(text)
    plot(runs, out.with_suffix(".png"), title)
    print("\n" + summary_table(runs))
    if batch_runs:
        print("\n" + batch_table(batch_runs))
    print(f"\nwritten: {out.with_suffix('.md')}, .json, .png")
    burst_runs(args)


def burst_runs(args: argparse.Namespace) -> list[dict]:
    """Issue 43: the seed's day with a surge (`--surge-factor` times the busiest hour's rate for `--surge-minutes`)
    at each of `--surge-hours`, the hour from the surge's start reported (the hour before simulated first): without
    admission, with admission by predicted wait (the API's estimate, counting the backlog as the API does and
    whole), and with admission and a fallback that every refused request allows, side by side on the same
    arrivals and the deployed autoscaler."""
    if not args.surge_hours:
        return []
    profile = load_profiles()[args.profile]
    mix = parse_mix(args.mix)
    models = {c.model for c in mix}
    timing = PodTiming(args.node_provision, args.pod_start)
    deployed = catalog_deployments(models, buffer_nodes=args.buffer_nodes, metric_delay_seconds=args.metric_delay)
    # The API's estimate counts the whole backlog (the requests past its scan taken as waiting); beside it, the same
    # estimate counting at most SCAN_LIMIT a priority, as the API did before: a fleet answering more than that over a
    # deadline was never refused.
    whole = Admission(args.safety_factor, args.admission_window)
    capped = replace(whole, scan_limit=SCAN_LIMIT)
    fallbacks = {d.model: fallback_class(mix, d, args.fallback_steps) for d in deployed}
    arms = [("no admission", deployed, None),
            (f"admission counting at most {SCAN_LIMIT:,} waiting (the API before)", deployed, capped),
            ("admission as the API counts (the whole backlog)", deployed, whole),
            ("the same + fallback", deployed + [fallback_deployment(d) for d in deployed], replace(whole, fallback=fallbacks))]  # fmt: skip
    runs = []
    for hour in args.surge_hours:
        shape = DayShape(args.requests, peak_hour=args.peak_hour, amplitude=args.amplitude, bursts=args.bursts,
                         burst_factor=args.burst_factor, surge_hour=hour, surge_minutes=args.surge_minutes,
                         surge_factor=args.surge_factor)  # fmt: skip
        begin = hour * 3600
        arrivals = window(day_arrivals(shape, mix, args.seed, warmup_s=0), begin, begin + 3600, warmup_s=3600)
        for scheduling in args.burst_schedulings:
            for arm, deployments, policy in arms:
                began = time.perf_counter()
                result = Simulation(arrivals, deployments, profile, scheduling, timing, args.overhead,
                                    admission=policy).run()  # fmt: skip
                run = {"surge_hour": hour, "scheduling": scheduling, "arm": arm,
                       "outcomes": overload_outcomes(result, begin, begin + 3600),
                       "gpu_hours": held_gpu_hours(result, begin, begin + 3600),
                       "seconds": time.perf_counter() - began}  # fmt: skip
                runs.append(run)
                o = run["outcomes"]
                print(f"  surge at {hour:g}:00, {scheduling}-level, {arm}: {o['in_time']:,} in time, {o['fallback_in_time']:,} "
                      f"fell back, {o['refused']:,} refused, {o['expired']:,} expired ({o['wasted_gpu_seconds']:,.0f} GPU-s "
                      f"on them) of {o['requests']:,} ({run['seconds']:.0f} s to simulate)", flush=True)  # fmt: skip
    title = (f"A surge of {args.surge_factor:g}x the busiest hour's rate for {args.surge_minutes:g} minutes on the seed's "
             f"day, profile {profile.name}; the hour from the surge's start")  # fmt: skip
    text = f"## {title}\n\n"
    for hour in args.surge_hours:
        text += f"Surge at {hour:g}:00:\n\n{overload_table([r for r in runs if r['surge_hour'] == hour])}\n\n"
    out = args.burst_out
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"title": title, "profile": profile.name, "seed": args.seed, "surge_minutes": args.surge_minutes,
            "surge_factor": args.surge_factor, "safety_factor": args.safety_factor,
            "admission_window_s": args.admission_window, "fallback_steps": args.fallback_steps,
            "load_average": os.getloadavg()}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=_jsonable))
    out.with_suffix(".md").write_text(text)
    print("\n" + text + f"written: {out.with_suffix('.md')}, .json")
    return runs


def batch_day_runs(args, arrivals, settings, profile, timing, slo, runs) -> list[dict]:
    """Issue 35: the same day with `--batch-images` lines submitted at `--batch-hour`, on the deployed autoscaler:
    idle on-demand workers only, then with Spot workers too; each compared with the day without it."""
    if not args.batch_images:
        return []
    deployed = next((deps for name, deps, autoscale in settings if name == "deployed"), None)
    if deployed is None:
        raise SystemExit("--batch-images needs the 'deployed' backlog target among --backlog-targets")
    batch_runs = []
    for scheduling in args.batch_schedulings:
        baseline = next((r for r in runs if r["scheduling"] == scheduling and r["autoscaler"] == "deployed"), None)
        if baseline is None:
            raise SystemExit(f"--batch-schedulings {scheduling}: not among --schedulings")
        for images in args.batch_images:
            for spot in sorted({0, args.batch_spot_replicas}):
                backlog = BatchBacklog(images, args.batch_hour, spot_max_replicas=spot, fill_images=args.batch_fill_images,
                                       spot_backlog_per_replica=BATCH_BACKLOG_CALLS * deployed[0].max_batch_size)  # fmt: skip
                began = time.perf_counter()
                initial = {d.model: d.scaler.min_replicas for d in deployed}
                result = Simulation(arrivals, deployed, profile, scheduling, timing, args.overhead, initial, True,
                                    batch=backlog).run()  # fmt: skip
                run = summarize(result, slo)
                run["autoscaler"] = "deployed"
                run["seconds"] = time.perf_counter() - began
                outcome = result.batch
                run["batch"] = {**vars(backlog), "done": outcome.done, "done_on_demand": outcome.done_on_demand,
                                "done_spot": outcome.done_spot, "restarted": outcome.restarted,
                                "on_demand_busy_gpu_hours": outcome.on_demand_busy_seconds / 3600,
                                "spot_gpu_hours": outcome.spot_seconds / 3600, "spot_peak": outcome.spot_peak,
                                "finished_hour": (outcome.last_done - result.start) / 3600
                                if outcome.done == images else None,
                                "baseline": {"gpu_hours": _total(baseline, "gpu_hours"),
                                             "slo_attainment": _first(baseline, "slo_attainment"),
                                             "p95_s": _first(baseline, "p95_s")}}  # fmt: skip
                batch_runs.append(run)
                print(f"  {scheduling}-level, {images:,} batch images at {args.batch_hour:g}:00, Spot <= {spot}: "
                      f"{outcome.done:,} done by the day's end ({outcome.done_spot:,} on Spot), GPU-hours "
                      f"{_total(run, 'gpu_hours'):,.0f} (without: {_total(baseline, 'gpu_hours'):,.0f}) + Spot "
                      f"{outcome.spot_seconds / 3600:,.0f}, SLO {_first(run, 'slo_attainment'):.2%} (without: "
                      f"{_first(baseline, 'slo_attainment'):.2%}) ({run['seconds']:.0f} s to simulate)", flush=True)  # fmt: skip
    return batch_runs


def _total(run: dict, field: str) -> float:
    return sum(m[field] for m in run["models"].values())


def _first(run: dict, field: str) -> float:
    return next(iter(run["models"].values()))[field]


def _jsonable(value):
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def measure(args: argparse.Namespace) -> None:
    from bench.capacity.profiles import gpu_profiles, measure_cpu_tiny, save_profile

    profile = measure_cpu_tiny(args.model_dir)
    save_profile(profile)
    for derived in gpu_profiles():
        save_profile(derived)
    print(json.dumps(profile.to_json(), indent=1))


def trace(args: argparse.Namespace) -> None:
    """One day of the inference log as a trace CSV: the configured BigQuery, or a local stack's emulator."""
    from bench.capacity.traffic import export_trace
    from contract import google_clients
    from contract.settings import Settings

    if args.stack is not None:  # the stack's own settings, as `python -m analytics --stack` reads them
        os.environ.update({k: v for k, v in json.loads((args.stack / "stack.json").read_text()).items() if k.isupper()})
    settings = Settings.from_env()
    table = f"{settings.project_id}.{settings.dataset}.inference_log_unique"
    count = export_trace(google_clients.bigquery_client(settings), table, args.day, args.out)
    print(f"{count:,} requests of {args.day} from {table} in {args.out}")


def validate(args: argparse.Namespace) -> None:
    from bench.capacity.validation import run_validation

    run_validation(args.model_dir, args.measured, args.requests, args.out, remeasure=not args.no_measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--requests", type=int, default=SEED_REQUESTS, help="requests in the day (curve)")
    parser.add_argument("--mix", nargs="+", help="model:steps:width:height:strength:images:share (default: the seed's)")
    parser.add_argument("--trace", type=Path, help="a recorded day instead of the curve (CSV or JSON lines)")
    parser.add_argument("--profile", default="l4-sd15", help="cost profile in bench/capacity/profiles.json")
    parser.add_argument("--schedulings", nargs="+", default=["request", "step"])
    parser.add_argument("--backlog-targets", nargs="+", default=["deployed", "batch"],
                        help="KEDA backlog targets per replica to compare ('deployed': the rendered one; 'batch': "
                        "one full batch, the rule before batching_gain)")  # fmt: skip
    parser.add_argument("--batching-gain",
                        help="the catalog's batching_gain replaced by this ('profile': the profile's own, at the model's "
                        "max_batch_size): what the renderer would deploy on that device")  # fmt: skip
    parser.add_argument("--fixed-replicas", type=int, default=SEED_GPUS, help="also a run with this many GPUs held")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peak-hour", type=float, default=15.0)
    parser.add_argument("--amplitude", type=float, default=0.6, help="peak is 1 + amplitude times the mean rate")
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--burst-factor", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=3600.0, help="seconds simulated before the day, not reported")
    parser.add_argument("--overhead", type=float, default=0.1, help="seconds per request outside the worker")
    parser.add_argument("--node-provision", type=float, default=PodTiming.node_provision_seconds)
    parser.add_argument("--pod-start", type=float, default=PodTiming.pod_start_seconds)
    parser.add_argument("--metric-delay", type=float, default=120.0, help="Cloud Monitoring's lag, seconds")
    parser.add_argument("--buffer-nodes", type=int, default=1, help="warm GPU nodes (the capacity reservation)")
    parser.add_argument("--slo", type=float, help="SLO seconds (default: slo-factor x a lone request's latency)")
    parser.add_argument("--slo-factor", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "capacity")
    parser.add_argument("--batch-images", nargs="*", type=int, default=[BATCH_IMAGES],
                        help="batch lines submitted at --batch-hour (issue 35), one run per value; none: no batch runs")  # fmt: skip
    parser.add_argument("--batch-hour", type=float, default=0.0, help="hour of the day the batch is submitted")
    parser.add_argument("--batch-spot-replicas", type=int, default=40,
                        help="Spot batch workers at most, for the runs with Spot (Terraform's l4-spot pool: 40)")  # fmt: skip
    parser.add_argument("--batch-fill-images", type=int, default=0,
                        help="batch lines an on-demand worker runs at once (the worker's MAAS_BATCH_IMAGES; 0, its "
                        "default: max_batch_size)")  # fmt: skip
    parser.add_argument("--batch-schedulings", nargs="+", default=["step"],
                        help="schedulings to run the batch days on (each also in --schedulings)")  # fmt: skip
    parser.add_argument("--surge-hours", nargs="*", type=float, default=SURGE_HOURS,
                        help="hours of the day a surge starts (issue 43), one set of runs each; none: no surge runs")  # fmt: skip
    parser.add_argument("--surge-minutes", type=float, default=20.0)
    parser.add_argument("--surge-factor", type=float, default=2.0, help="times the busiest hour's mean rate")
    parser.add_argument("--burst-schedulings", nargs="+", default=["step"], help="schedulings of the surge runs")
    parser.add_argument("--safety-factor", type=float, default=1.0, help="admission's (the catalog's `safety_factor`)")
    parser.add_argument("--admission-window", type=float, default=60.0, help="MAAS_ADMISSION_WINDOW_SECONDS")
    parser.add_argument("--fallback-steps", type=int, default=FALLBACK_STEPS, help="steps of the fallback's requests")
    parser.add_argument("--burst-out", type=Path, default=RESULTS / "capacity_burst")
    sub.add_parser("burst", help="only the surge runs (issue 43): no admission, admission, admission + fallback")
    measure_parser = sub.add_parser("measure", help="time the CPU tiny pipeline; rewrite profiles.json")
    measure_parser.add_argument("--model-dir", type=Path, required=True)
    validate_parser = sub.add_parser("validate", help="simulate bench/open_loop.py's sweep and compare")
    validate_parser.add_argument("--model-dir", type=Path, required=True)
    validate_parser.add_argument("--measured", type=Path, help="an open_loop.py --json result (else run it now)")
    validate_parser.add_argument("--requests", type=int, default=48, help="arrivals per rate and scheduling")
    validate_parser.add_argument("--no-measure", action="store_true", help="keep profiles.json's cpu-tiny points")
    validate_parser.add_argument("--out", type=Path, default=RESULTS / "capacity_validation")
    trace_parser = sub.add_parser("trace", help="export one day of the inference log as a trace CSV")
    trace_parser.add_argument("--day", required=True, help="YYYY-MM-DD (UTC)")
    trace_parser.add_argument("--stack", type=Path, help="a local stack directory: query its BigQuery emulator")
    trace_parser.add_argument("--out", type=Path, default=Path("day.csv"))
    args = parser.parse_args()
    if args.command == "trace":
        trace(args)
    elif args.command == "measure":
        measure(args)
    elif args.command == "validate":
        validate(args)
    elif args.command == "burst":
        burst_runs(args)
    else:
        day_runs(args)


if __name__ == "__main__":
    main()
