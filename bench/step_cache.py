"""Step caches on the worker's runner (model_worker/model/step_cache.py), on the CPU with the stack's tiny models: the
time of a denoising call and of an image's denoising with every image skipping the expensive part, none, and half,
against no cache; the decision's own cost; and the fraction of the expensive part's rows skipped.

FLUX.1's `first_block` (the tiny [schnell]) and SD 1.5's `deepcache`, a running set of `--batch` images stepped
together. The skip patterns are forced (the random tiny weights say nothing about real hit rates, which depend on
the model and the threshold: docs/guides/step-caching.md), except `decided`: first_block at a threshold every
step passes, so its decision runs and never skips (its cost against `forced none`).

    .venv/bin/python -m bench.step_cache --model-root .stack/tiny-model --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from contract.messages import GenerationParameters
from contract.model_spec import ModelSpec
from emulators.stack import local_catalog
from model_worker.model.runners import GenerationItem

MODELS = {"first_block": ("flux-schnell", {"kind": "first_block", "threshold": 0.08}),
          "deepcache": ("sd15-txt2img", {"kind": "deepcache", "interval": 2})}  # fmt: skip
# Forced skip patterns (image, call) -> skip; the first call of an image is always full (nothing cached yet).
PATTERNS = {"none": lambda r, call: False, "half": lambda r, call: call % 2 == 1, "all": lambda r, call: True}
SIZE = 64


def run_set(runner, batch: int, steps: int, guidance: float) -> dict:
    """One running set of `batch` images through all its calls: per call and per image milliseconds, and the share
    of the expensive part's rows that ran."""
    params = GenerationParameters(seed=0, num_inference_steps=steps, guidance_scale=guidance, width=SIZE, height=SIZE)
    items = [GenerationItem(prompt=f"bench {i}", seed=i) for i in range(batch)]
    running = runner.start_items(items, params)
    tail = runner._denoiser.tail_calls
    rows_before, calls, times = tail.rows, 0, []
    while not all(r.finished for r in running):
        started = time.perf_counter()
        runner.denoise_step(running)
        times.append((time.perf_counter() - started) * 1000)
        calls += 1
    rows_per_image = 2 if guidance > 1 else 1
    cached = any(r.state.get("step_cache") is not None for r in running)
    ran = (tail.rows - rows_before) / (calls * batch * rows_per_image) if cached else 1.0
    runner.decode(running)
    return {"call_ms": statistics.median(times), "image_ms": sum(times) / batch, "expensive_rows_ran": ran}


def measure(model_root: Path, kind: str, batch: int, steps: int, repeats: int) -> dict:
    from model_worker.model.pipeline import DiffusionRunner

    name, settings = MODELS[kind]
    plain = local_catalog().get(name).model_copy(update={"scheduling": "step"})
    cached = ModelSpec.model_validate({**plain.model_dump(), "step_cache": settings})
    directory = model_root / name
    guidance = 0.0 if plain.guidance_mode == "none" else 7.5
    variants = {"no cache": (DiffusionRunner(plain, directory), None)}
    runner = DiffusionRunner(cached, directory)
    for pattern, forced in PATTERNS.items():
        variants[f"forced {pattern}"] = (runner, forced)
    if kind == "first_block":
        decided = ModelSpec.model_validate({**plain.model_dump(), "step_cache": {**settings, "threshold": 1e-9}})
        variants["decided"] = (DiffusionRunner(decided, directory), None)
    results: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for variant, (variant_runner, forced) in variants.items():
            variant_runner._denoiser.forced_skips = forced
            results[variant].append(run_set(variant_runner, batch, steps, guidance))
    rows = {}
    for variant, runs in results.items():
        kept = runs[1:] or runs
        rows[variant] = {key: round(statistics.median(run[key] for run in kept), 3) for key in kept[0]}
    base = rows["no cache"]["call_ms"]
    for row in rows.values():
        row["speedup_per_call"] = round(base / row["call_ms"], 3) if row["call_ms"] else None
    if "decided" in rows:
        rows["decided"]["decision_ms_per_call"] = round(rows["decided"]["call_ms"] - rows["forced none"]["call_ms"], 3)
    return {"model": name, "settings": settings, "batch": batch, "steps": steps, "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-root", type=Path, required=True, help="the stack's tiny model directories")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest run: that it works, no figure")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps, args.repeats = 2, 3, 0
    import torch

    torch.set_num_threads(1)
    report = {kind: measure(args.model_root, kind, args.batch, args.steps, args.repeats) for kind in MODELS}
    for kind, result in report.items():
        print(f"{kind} on {result['model']} ({result['batch']} images, {result['steps']} steps, CPU):")
        for variant, row in result["variants"].items():
            extra = f", decision {row['decision_ms_per_call']} ms/call" if "decision_ms_per_call" in row else ""
            print(f"  {variant:>12}: {row['call_ms']:8.2f} ms/call {row['image_ms']:8.2f} ms/image "
                  f"x{row['speedup_per_call']} expensive rows ran {row['expensive_rows_ran']:.0%}{extra}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
