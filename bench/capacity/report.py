"""What a simulated day comes to: GPUs per hour, GPU-hours, latency percentiles, SLO attainment, expired; tables and a plot."""

from __future__ import annotations

import math

import numpy as np

from bench.capacity.simulator import EXPIRED, LATE, ON_TIME, REFUSED, SimulationResult
from bench.capacity.traffic import DAY_SECONDS


def latencies(result: SimulationResult, mask: np.ndarray) -> np.ndarray:
    """Seconds from arrival to answer; an expired request counts as infinitely late (open_loop.py's rule), and so does
    one refused by admission (answered at once, without an image)."""
    values = result.done[mask] - result.arrival[mask]
    return np.where(np.isin(result.outcome[mask], (EXPIRED, REFUSED)), np.inf, values)


def nearest_rank(sorted_values: np.ndarray, share: float) -> float:
    if not len(sorted_values):
        return math.nan
    return float(sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(share * len(sorted_values)) - 1))])


def summarize(result: SimulationResult, slo_seconds: dict[str, float], day: float = DAY_SECONDS) -> dict:
    """One run: per model latency percentiles, SLO attainment, late and expired; GPUs per hour and for the day."""
    in_day = (result.arrival >= result.start) & (result.arrival < result.start + day)
    ticks = np.array(result.ticks)
    day_ticks = (ticks >= result.start) & (ticks < result.start + day)
    first_hour, last_hour = math.floor(result.start / 3600), math.floor((result.start + day) / 3600)
    models = {}
    for index, name in enumerate(result.models):
        mask = in_day & (result.model_of == index)
        values = np.sort(latencies(result, mask))
        count = int(mask.sum())
        models[name] = {
            "requests": count,
            "p50_s": nearest_rank(values, 0.50),
            "p95_s": nearest_rank(values, 0.95),
            "p99_s": nearest_rank(values, 0.99),
            "slo_s": slo_seconds[name],
            "slo_attainment": float((values <= slo_seconds[name]).sum() / count) if count else math.nan,
            "late": int((result.outcome[mask] == LATE).sum()),
            "expired": int((result.outcome[mask] == EXPIRED).sum()),
            "gpu_hours": float(np.array(result.held[name])[day_ticks].mean() * day / 3600)
            if day_ticks.any()
            else math.nan,
            "busy_gpu_hours": sum(v for h, v in result.busy_seconds[name].items() if first_hour <= h < last_hour)
            / 3600,
        }
    held = sum(np.array(v, dtype=float) for v in result.held.values())
    hours = []
    for hour in range(int(day // 3600)):
        begin = result.start + hour * 3600
        window = (ticks >= begin) & (ticks < begin + 3600)
        arrivals = in_day & (result.arrival >= begin) & (result.arrival < begin + 3600)
        values = np.sort(latencies(result, arrivals))
        busy = sum(seconds.get(math.floor(begin / 3600), 0.0) for seconds in result.busy_seconds.values())
        hours.append({
            "hour": hour,
            "requests": int(arrivals.sum()),
            "gpus_mean": float(held[window].mean()) if window.any() else math.nan,
            "gpus_peak": float(held[window].max()) if window.any() else math.nan,
            "gpus_busy": busy / 3600,
            "p95_s": nearest_rank(values, 0.95),
        })  # fmt: skip
    gpu_hours = float(held[day_ticks].mean() * day / 3600) if day_ticks.any() else math.nan
    return {
        "scheduling": result.scheduling,
        "autoscaler": result.scaler,
        "gpu_hours": gpu_hours,
        "buffer_gpu_hours": result.buffer_nodes * day / 3600,
        "busy_gpu_hours": sum(h["gpus_busy"] for h in hours),
        "peak_gpus": max((h["gpus_peak"] for h in hours if math.isfinite(h["gpus_peak"])), default=math.nan),
        "models": models,
        "hours": hours,
    }


def summary_table(runs: list[dict]) -> str:
    lines = [
        "| scheduling | autoscaler | model | GPU-hours (+ buffer) | busy GPU-hours | peak GPUs (all models) | p50 s | p95 s | p99 s "
        "| SLO attainment | late | expired |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for name, m in run["models"].items():
            lines.append(
                f"| {run['scheduling']}-level | {run['autoscaler']} | {name} | {m['gpu_hours']:,.0f} "
                f"(+ {run['buffer_gpu_hours']:.0f}) | {m['busy_gpu_hours']:,.0f} | {run['peak_gpus']:g} | "
                f"{_seconds(m['p50_s'])} | {_seconds(m['p95_s'])} | {_seconds(m['p99_s'])} | "
                f"{m['slo_attainment']:.1%} (≤ {m['slo_s']:.1f} s) | {m['late']:,} | {m['expired']:,} |"
            )
    return "\n".join(lines)


def hourly_table(runs: list[dict]) -> str:
    """GPUs held (mean / peak) and busy, per hour of the day, one column per run."""
    head = "| hour | requests | " + " | ".join(f"{r['scheduling']}-level, {r['autoscaler']}" for r in runs) + " |"
    lines = [head, "|---|---|" + "---|" * len(runs)]
    for hour in range(len(runs[0]["hours"])):
        cells = [f"{hour:02d}", f"{runs[0]['hours'][hour]['requests']:,}"]
        for run in runs:
            h = run["hours"][hour]
            cells.append(
                f"{h['gpus_mean']:.0f} / {h['gpus_peak']:.0f} / {h['gpus_busy']:.0f}; p95 {_seconds(h['p95_s'])}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return "∞" if not math.isfinite(value) else f"{value:.1f}"


def plot(runs: list[dict], path, title: str) -> None:
    """GPUs held per hour (and busy, dashed) and p95 latency per hour, one line per run; requests per hour behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gpus, p95) = plt.subplots(1, 2, figsize=(13, 4.2))
    hours = [h["hour"] + 0.5 for h in runs[0]["hours"]]
    for run in runs:
        label = f"{run['scheduling']}-level, {run['autoscaler']}"
        line = gpus.plot(hours, [h["gpus_mean"] for h in run["hours"]], "-", label=f"{label}: held")[0]
        gpus.plot(hours, [h["gpus_busy"] for h in run["hours"]], "--", color=line.get_color(), linewidth=0.9)
        p95.plot(hours, [min(h["p95_s"], 1e3) for h in run["hours"]], "-", color=line.get_color(), label=label)
    demand = gpus.twinx()
    demand.bar(hours, [h["requests"] for h in runs[0]["hours"]], width=0.9, color="grey", alpha=0.15)
    demand.set_ylabel("requests per hour (bars)")
    gpus.set_zorder(demand.get_zorder() + 1)
    gpus.patch.set_visible(False)
    gpus.set_xlabel("hour of the day")
    gpus.set_ylabel("GPUs held (solid), busy (dashed)")
    gpus.legend(fontsize=7, loc="upper left")
    p95.set_yscale("log")
    p95.set_xlabel("hour of the day")
    p95.set_ylabel("p95 latency, s (expired = off the scale)")
    p95.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch_table(runs: list[dict]) -> str:
    """Issue 35: what a day absorbs of a batch backlog, and what it costs the interactive traffic."""
    lines = [
        "| scheduling | batch images (at hour) | Spot workers ≤ | done by the day's end (on Spot) | finished at hour "
        "| GPU-hours on-demand (without the batch) | Spot GPU-hours | on-demand GPU-hours on batch lines "
        "| SLO attainment (without) | p95 s (without) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        batch, base = run["batch"], run["batch"]["baseline"]
        model = next(iter(run["models"].values()))
        gpu_hours = sum(m["gpu_hours"] for m in run["models"].values())
        finished = "–" if batch["finished_hour"] is None else f"{batch['finished_hour']:.1f}"
        lines.append(
            f"| {run['scheduling']}-level | {batch['images']:,} ({batch['hour']:g}:00) | {batch['spot_max_replicas']} | "
            f"{batch['done']:,} ({batch['done_spot']:,}) | {finished} | {gpu_hours:,.0f} ({base['gpu_hours']:,.0f}) | "
            f"{batch['spot_gpu_hours']:,.0f} | {batch['on_demand_busy_gpu_hours']:,.0f} | "
            f"{model['slo_attainment']:.2%} ({base['slo_attainment']:.2%}) | {_seconds(model['p95_s'])} "
            f"({_seconds(base['p95_s'])}) |"
        )
    return "\n".join(lines)


def overload_outcomes(result: SimulationResult, begin: float, end: float) -> dict:
    """Issue 43: what became of the requests that arrived from `begin` to `end` (seconds): answered in time by the
    model asked, answered in time by its fallback, refused at once, expired after waiting, answered late; the
    device time spent on those that expired anyway, and the p95 latency of the answered."""
    mask = (result.arrival >= begin) & (result.arrival < end)
    outcome, fell_back = result.outcome[mask], result.fell_back[mask]
    expired = outcome == EXPIRED
    answered = np.isin(outcome, (ON_TIME, LATE))
    waits = np.sort(result.done[mask][answered] - result.arrival[mask][answered])
    return {
        "requests": int(mask.sum()),
        "in_time": int(((outcome == ON_TIME) & ~fell_back).sum()),
        "fallback_in_time": int(((outcome == ON_TIME) & fell_back).sum()),
        "refused": int((outcome == REFUSED).sum()),
        "expired": int(expired.sum()),
        "expired_fallback": int((expired & fell_back).sum()),
        "late": int((outcome == LATE).sum()),
        "wasted_gpu_seconds": float(result.spent[mask][expired].sum()),
        "gpu_seconds": float(result.spent[mask].sum()),
        "answered_p95_s": nearest_rank(waits, 0.95),
    }


def held_gpu_hours(result: SimulationResult, begin: float, end: float) -> float:
    """GPU-hours held by every simulated deployment from `begin` to `end` (seconds), from the autoscaler's ticks."""
    ticks = np.array(result.ticks)
    inside = (ticks >= begin) & (ticks < end)
    held = sum(np.array(v, dtype=float) for v in result.held.values())
    return float(held[inside].mean() * (end - begin) / 3600) if inside.any() else math.nan


def overload_table(runs: list[dict]) -> str:
    """The arms of the burst side by side: the four outcomes, late answers, and the GPU time the expired took."""
    lines = [
        "| scheduling | arm | requests | answered in time | fell back (answered in time) | refused at once "
        "| expired after waiting | answered late | GPU-s on requests that expired | GPU-hours held | p95 s of the answered |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        o = run["outcomes"]
        total = max(o["requests"], 1)
        lines.append(
            f"| {run['scheduling']}-level | {run['arm']} | {o['requests']:,} | {o['in_time']:,} ({o['in_time'] / total:.1%}) "
            f"| {o['fallback_in_time']:,} ({o['fallback_in_time'] / total:.1%}) | {o['refused']:,} ({o['refused'] / total:.1%}) "
            f"| {o['expired']:,} ({o['expired'] / total:.1%}) | {o['late']:,} | {o['wasted_gpu_seconds']:,.0f} "
            f"({o['wasted_gpu_seconds'] / max(o['gpu_seconds'], 1e-9):.1%} of {o['gpu_seconds']:,.0f}) "
            f"| {run['gpu_hours']:,.1f} | {_seconds(o['answered_p95_s'])} |"
        )
    return "\n".join(lines)
