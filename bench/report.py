"""Turns one run's results into the targets (PASS/MISS, never asserted), a markdown report and two plots."""

from __future__ import annotations

import math
from pathlib import Path

from bench.admin_ops import ADMIN_OPS_PER_MINUTE, sustainable_rps
from bench.breakdown import STAGES

# The README's advice: per-request mode costs two admin operations a request, so ~50 requests/s a project.
README_SWITCH_RPS = 50


def find(rows: list[dict], scenario: str, concurrency: int, mode: str | None = None) -> dict | None:
    for row in rows:
        if row["scenario"] == scenario and row["concurrency"] == concurrency and row.get("mode") == mode:
            return row
    return None


def target_row(
    name: str,
    measured: float | None,
    threshold: float | None,
    higher_is_better: bool,
    unit: str,
    missing: str = "NOT RUN",
) -> dict:
    """One target's row; `missing` is the result when nothing was measured."""
    if measured is None or threshold is None or math.isnan(measured):
        return {"target": name, "measured": None, "threshold": threshold, "unit": unit, "result": missing}
    ok = measured >= threshold if higher_is_better else measured <= threshold
    return {
        "target": name,
        "measured": measured,
        "threshold": threshold,
        "unit": unit,
        "result": "PASS" if ok else "MISS",
    }


def evaluate_targets(rows: list[dict], direct: dict | None, available: dict[str, bool]) -> list[dict]:
    """The issue's targets, each measured in this run against numbers from this run."""
    floor1, floor32 = find(rows, "pubsub floor", 1), find(rows, "pubsub floor", 32)
    naive32 = find(rows, "naive per-request", 32)
    targets = []
    noop1 = find(rows, "noop", 1, "per-instance")
    targets.append(target_row(
        "per-instance noop c=1 p50 within 10 ms of the floor's p50",
        noop1 and noop1["p50_ms"], floor1 and floor1["p50_ms"] + 10, False, "ms",
    ))  # fmt: skip
    noop32 = find(rows, "noop", 32, "per-instance")
    targets.append(target_row(
        "per-instance noop c=32 at least 80% of the floor's req/s",
        noop32 and noop32["rps"], floor32 and 0.8 * floor32["rps"], True, "req/s",
    ))  # fmt: skip
    pr32 = find(rows, "noop", 32, "per-request")
    targets.append(target_row(
        "per-request noop c=32 at least 1.5x the naive create-publish-pull-delete req/s",
        pr32 and pr32["rps"], naive32 and 1.5 * naive32["rps"], True, "req/s",
    ))  # fmt: skip
    for mode in ("per-instance", "per-request"):
        sleep16, sleep1 = find(rows, "sleep", 16, mode), find(rows, "sleep", 1, mode)
        if sleep16:
            targets.append(
                target_row(f"{mode}: sleep c=16 at least 38 req/s (ideal 40)", sleep16["rps"], 38, True, "req/s")
            )
        if sleep1:
            targets.append(target_row(
                f"{mode}: sleep c=1 p50 within 215 ms of the floor's p50",
                sleep1["p50_ms"], floor1 and floor1["p50_ms"] + 215, False, "ms",
            ))  # fmt: skip
    cache = find(rows, "noop cache hits", 32, "per-instance")
    if available.get("cache"):
        targets.append(target_row("cache hits c=32 at least 1,500 req/s", cache and cache["rps"], 1500, True, "req/s"))
    else:
        targets.append({"target": "cache hits c=32 at least 1,500 req/s", "measured": None, "threshold": 1500,
                        "unit": "req/s", "result": "not available yet"})  # fmt: skip
    ideal = direct_rate(direct, 4)
    for mode in ("per-instance", "per-request"):
        tiny = find(rows, "sd15-txt2img", 4, mode)
        if tiny:
            targets.append(target_row(
                f"{mode}: tiny diffusion c=4 at least 90% of the direct pipeline's images/s (batch 4)",
                tiny["rps"], ideal and 0.9 * ideal, True, "img/s",
            ))  # fmt: skip
    return targets


def direct_rate(direct: dict | None, batch: int, path: str = "direct") -> float | None:
    for row in (direct or {}).get("rows", []):
        if row["batch"] == batch:
            return row[path]["images_per_s"]
    return None


def admin_rows(rows: list[dict]) -> list[dict]:
    """Admin operations per request in each reply mode (summed over its scenarios) and the rate they allow."""
    out = []
    for mode in ("per-request", "per-instance"):
        mine = [r for r in rows if r.get("mode") == mode and "admin_ops" in r]
        requests = sum(r["requests_sent"] for r in mine)
        ops = sum(sum(r["admin_ops"].values()) for r in mine)
        by_method: dict[str, int] = {}
        for r in mine:
            for name, count in r["admin_ops"].items():
                by_method[name] = by_method.get(name, 0) + count
        per_request = ops / requests if requests else math.nan
        out.append({
            "mode": mode, "requests": requests, "admin_ops": ops, "by_method": by_method,
            "ops_per_request": per_request, "sustainable_rps": sustainable_rps(per_request) if requests else None,
        })  # fmt: skip
    return out


def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def markdown(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        f"# Benchmark results ({'quick' if meta['quick'] else 'full'} run)",
        "",
        f"{meta['when']} · commit `{meta['commit']}` · {meta['cpus']} CPUs · load average before/after "
        f"{meta['load_before']} / {meta['load_after']} · API: 1 gunicorn worker, asyncio (the Flask app on its thread pool) · "
        f"{meta['warmup_seconds']} s warm-up + {meta['seconds']} s measured per scenario",
        "",
        "## Scenarios",
        "",
        "| scenario | reply mode | conc | req/s | p50 ms | p95 ms | p99 ms | errors | requests | in flight | mean batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r.get('mode') or '–'} | {r['concurrency']} | {_fmt(r['rps'])} | {_fmt(r['p50_ms'])} "
            f"| {_fmt(r['p95_ms'])} | {_fmt(r['p99_ms'])} | {r['errors']} | {r['requests']} | {_fmt(r['mean_in_flight'])} "
            f"| {_fmt(r.get('mean_batch'))} |"
        )
    for name, note in result.get("unavailable", {}).items():
        lines.append(f"| {name} | – | – | {note} | | | | | | | |")
    lines += ["", "## Where the time goes (median ms per stage, see `bench/breakdown.py`)", ""]
    lines.append("| scenario | reply mode | conc | " + " | ".join(STAGES) + " |")
    lines.append("|---|---|---|" + "---|" * len(STAGES))
    for r in rows:
        if r.get("stages"):
            lines.append(
                f"| {r['scenario']} | {r['mode']} | {r['concurrency']} | "
                + " | ".join(_fmt(r["stages"][s]) for s in STAGES)
                + " |"
            )
    lines += ["", "## Pub/Sub admin operations", ""]
    lines.append(
        f"| reply mode | requests | admin ops counted | ops/request | sustained req/s at {ADMIN_OPS_PER_MINUTE:,}/min | README switches at |"
    )
    lines.append("|---|---|---|---|---|---|")
    for a in result["admin"]:
        allowed = (
            "not capped by admin ops (one create per API process start)"
            if a["sustainable_rps"] is None
            else _fmt(a["sustainable_rps"])
        )
        methods = ", ".join(f"{k} {v}" for k, v in sorted(a["by_method"].items())) or "none"
        lines.append(
            f"| {a['mode']} | {a['requests']} | {a['admin_ops']} ({methods}) | {_fmt(a['ops_per_request'], 3)} "
            f"| {allowed} | ~{README_SWITCH_RPS} req/s: use per-instance above |"
        )
    if result.get("direct"):
        d = result["direct"]
        lines += ["", f"## Tiny diffusion pipeline, direct vs the worker's path ({d['size']}x{d['size']}, "
                  f"{d['steps']} steps, {d['threads']} torch thread)", ""]  # fmt: skip
        lines.append("| batch | direct img/s | worker path img/s | worker / direct |")
        lines.append("|---|---|---|---|")
        for row in d["rows"]:
            ratio = row["worker"]["images_per_s"] / row["direct"]["images_per_s"]
            lines.append(
                f"| {row['batch']} | {_fmt(row['direct']['images_per_s'], 2)} | {_fmt(row['worker']['images_per_s'], 2)} "
                f"| {ratio:.0%} |"
            )
    if result.get("adapters"):
        lines += adapter_lines(result["adapters"])
    if result.get("step_caches"):
        lines += step_cache_lines(result["step_caches"])
    if result.get("edit_scheduling"):
        lines += edit_scheduling_lines(result["edit_scheduling"])
    lines += ["", "## Targets (measured side by side in this run; printed, never asserted)", ""]
    lines.append("| target | measured | threshold | result |")
    lines.append("|---|---|---|---|")
    for t in result["targets"]:
        lines.append(
            f"| {t['target']} | {_fmt(t['measured'])} {t['unit']} | {_fmt(t['threshold'])} {t['unit']} | **{t['result']}** |"
        )
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    written = []
    fig, (latency_ax, rate_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [("pubsub floor", None), ("naive per-request", None), ("noop", "per-instance"), ("noop", "per-request"),
              ("sleep", "per-instance"), ("sleep", "per-request")]  # fmt: skip
    for scenario, mode in series:
        points = sorted((r for r in rows if r["scenario"] == scenario and r.get("mode") == mode),
                        key=lambda r: r["concurrency"])  # fmt: skip
        if not points:
            continue
        label = scenario if mode is None else f"{scenario} ({mode})"
        conc = [p["concurrency"] for p in points]
        line = latency_ax.plot(conc, [p["p50_ms"] for p in points], marker="o", label=f"{label} p50")[0]
        latency_ax.fill_between(conc, [p["p50_ms"] for p in points], [p["p99_ms"] for p in points],
                                color=line.get_color(), alpha=0.15)  # fmt: skip
        latency_ax.plot(conc, [p["p95_ms"] for p in points], ls="--", color=line.get_color(), lw=0.8)
        rate_ax.plot(conc, [p["rps"] for p in points], marker="o", color=line.get_color(), label=label)
    latency_ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="latency ms (p50 line, p95 dashed, to p99 shaded)",
                   title="Latency against concurrency")  # fmt: skip
    rate_ax.set(xscale="log", xlabel="concurrency", ylabel="requests/s", title="Throughput against concurrency")
    rate_ax.axhline(40, color="grey", ls=":", lw=0.8)
    rate_ax.text(1, 41, "sleep ideal 40/s", fontsize=7, color="grey")
    for ax in (latency_ax, rate_ax):
        ax.grid(True, which="both", alpha=0.3)
    latency_ax.legend(fontsize=6)
    rate_ax.legend(fontsize=6)
    fig.tight_layout()
    path = out_dir / "latency_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    staged = [r for r in rows if r.get("stages")]
    if staged:
        fig, ax = plt.subplots(figsize=(11, 0.38 * len(staged) + 1.5))
        labels = [f"{r['scenario']} {r['mode']} c={r['concurrency']}" for r in staged]
        left = [0.0] * len(staged)
        colors = plt.get_cmap("tab10").colors
        for index, stage in enumerate(STAGES):
            widths = [r["stages"][stage] for r in staged]
            ax.barh(labels, widths, left=left, color=colors[index % len(colors)], label=stage)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.invert_yaxis()
        ax.set(xlabel="median ms per request, by stage", title="Where a request's time goes")
        ax.legend(ncol=4, fontsize=7, loc="lower right")
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        path = out_dir / "breakdown.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def step_cache_lines(caches: dict) -> list[str]:
    """Step caches (bench/step_cache.py): a running set's call and image times with forced skip patterns, CPU."""
    lines = ["", "## Step caches (tiny models on the CPU, forced skip patterns: no hit rate, no quality)", "",
             "| kind | model | variant | ms per call | ms per image | x no cache | expensive rows run | decision ms per call |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in caches.values():
        for variant, r in c["variants"].items():
            decision = _fmt(r["decision_ms_per_call"], 2) if "decision_ms_per_call" in r else ""
            lines.append(f"| {c['kind']} | {c['model']} | {variant} | {_fmt(r['call_ms'], 2)} | {_fmt(r['image_ms'], 2)} | "
                         f"{r['speedup_per_call']} | {r['expensive_rows_ran']:.0%} | {decision} |")  # fmt: skip
    return lines


def edit_scheduling_lines(e: dict) -> list[str]:
    """Inpainting and editing mixed with text-to-image (bench/step_vs_request.py --mixed): both schedulings."""
    lines = ["", f"## Inpainting and editing mixed with text-to-image (tiny models on the CPU, {e['size']}², "
                 f"{e['steps']} steps, {e['images']} images, batch {e['batch']})", "",
             "| mix | models | request-level img/s | images a call | step-level img/s | images a call | step / request |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mix, m in e["mixes"].items():
        lines.append(f"| {mix} | {' + '.join(m['models'])} | {_fmt(m['request']['images_per_s'], 2)} | "
                     f"{m['request']['images_per_call']} | {_fmt(m['step']['images_per_s'], 2)} | "
                     f"{m['step']['images_per_call']} | {m['step_over_request']:.0%} |")  # fmt: skip
    return lines


def adapter_lines(a: dict) -> list[str]:
    """LoRA adapters per family (bench/adapters.py): per denoising call against the base model, and load times."""
    accelerator = a["families"][0]["accelerator"] if a["families"] else "?"
    lines = ["", f"## LoRA adapters per call (diffusers' LoRA layers, not fused; {a['size']}x{a['size']}, "
             f"{a['threads']} torch thread, {accelerator}; load average {' '.join(a['loadavg_before'])}), "
             "median ms per denoising call", ""]  # fmt: skip
    lines += [
        "| family | batch | base | 1 adapter | 2 adapters | 1 adapter, set switched before each call |",
        "|---|---|---|---|---|---|",
    ]
    for family in a["families"]:
        for r in family["rows"]:
            cells = [r["one_adapter_ms"], r["two_adapters_ms"], r["one_adapter_switching_ms"]]
            lines.append(f"| {family['family']} | {r['batch']} | {_fmt(r['base_ms'], 2)} | "
                         + " | ".join(f"{_fmt(c, 2)} ({c / r['base_ms']:.2f}x)" for c in cells) + " |")  # fmt: skip
    lines += [
        "",
        "| family | adapter | cold load from the bucket, ms | onto the device, ms | kB |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {f['family']} | {x['adapter']} | {_fmt(x['bucket_ms'], 2)} | {_fmt(x['device_ms'], 2)} | "
              f"{x['bytes'] / 1e3:.0f} |" for f in a["families"] for x in f["loads"]]  # fmt: skip
    return lines
