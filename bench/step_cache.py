"""Step caches on the worker's runner (model_worker/model/step_cache.py), on the CPU with the stack's tiny models: the
time of a denoising call and of an image's denoising with every image skipping the expensive part, none, and half,
against no cache; the decision's own cost; and the fraction of the expensive part's rows skipped.

FLUX.1's `first_block` and `taylorseer` (the tiny [schnell]), SD 3.5's `first_block` (its guided pair of rows
deciding together) and SD 1.5's `deepcache`, a running set of `--batch` images stepped together, all in one process
(one import, each model's components loaded once and shared by its variants). The skip patterns are forced (the
random tiny weights say nothing about real hit rates, which depend on the model and the threshold:
docs/guides/step-caching.md), except `decided`: the kind's own decision made at a setting where it never skips
(first_block at a threshold every step passes, taylorseer at interval 1), so its cost shows against `forced none`.

    .venv/bin/python -m bench.step_cache --model-root .stack/tiny-model --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from contract.messages import GenerationParameters
from contract.model_spec import ModelSpec
from emulators.stack import local_catalog
from model_worker.model.runners import GenerationItem

# Each case: the tiny model, its cache settings, and the settings at which its decision runs but never skips (None:
# decided by count, as deepcache by interval is, the forced pattern's own cost).
CASES = {
    "flux.first_block": ("flux-schnell", {"kind": "first_block", "threshold": 0.08}, {"threshold": 1e-9}),
    "flux.taylorseer": ("flux-schnell", {"kind": "taylorseer", "interval": 2, "warmup_steps": 1}, {"interval": 1}),
    "sd35.first_block": ("sd35-txt2img", {"kind": "first_block", "threshold": 0.08}, {"threshold": 1e-9}),
    "sd15.deepcache": ("sd15-txt2img", {"kind": "deepcache", "interval": 2}, None),
}
# The stack's tiny SD 3.5 has one joint block, so nothing behind its first block to skip: the bench runs a copy with
# two (the same components, its transformer rebuilt at this depth, seeded), as tests/unit/test_step_cache_sd3.py does.
DEEPER = {"sd35-txt2img": {"num_layers": 2}}
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


def deeper_copy(directory: Path, out: Path, transformer: dict) -> Path:
    """`directory`'s pipeline with its transformer rebuilt from its config updated by `transformer` (random weights,
    seed 0) under `out`; the other components linked."""
    import diffusers
    import torch

    out.mkdir(parents=True)
    for part in directory.iterdir():
        if part.name != "transformer":
            (out / part.name).symlink_to(part.resolve(), target_is_directory=part.is_dir())
    model_class = getattr(diffusers, json.loads((directory / "transformer" / "config.json").read_text())["_class_name"])
    torch.manual_seed(0)
    config = {**model_class.load_config(directory / "transformer"), **transformer}
    model_class.from_config(config).save_pretrained(out / "transformer")
    return out


def measure(model_root: Path, case: str, batch: int, steps: int, repeats: int, loaded: dict, scratch: Path) -> dict:
    """One case's variants; `loaded`: each model's plain runner, loaded once for every case on it (the cached
    runners are built from its components)."""
    from model_worker.model.pipeline import DiffusionRunner

    name, settings, never_skips = CASES[case]
    plain = local_catalog().get(name).model_copy(update={"scheduling": "step"})
    directory = model_root / name
    if name in DEEPER:
        directory = scratch / name
        if not directory.exists():
            deeper_copy(model_root / name, directory, DEEPER[name])
    if name not in loaded:
        loaded[name] = DiffusionRunner(plain, directory)

    def with_cache(cache: dict) -> DiffusionRunner:
        spec = ModelSpec.model_validate({**plain.model_dump(), "step_cache": cache})
        return DiffusionRunner(spec, directory, share=loaded[name])

    guidance = 0.0 if plain.guidance_mode == "none" else 7.5
    variants = {"no cache": (loaded[name], None)}
    runner = with_cache(settings)
    for pattern, forced in PATTERNS.items():
        variants[f"forced {pattern}"] = (runner, forced)
    if never_skips is not None:
        variants["decided"] = (with_cache({**settings, **never_skips}), None)
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
    return {"kind": settings["kind"], "model": name, "settings": settings, "batch": batch, "steps": steps,
            "variants": rows}  # fmt: skip


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
    loaded: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-step-cache-") as scratch:
        report = {case: measure(args.model_root, case, args.batch, args.steps, args.repeats, loaded, Path(scratch))
                  for case in CASES}  # fmt: skip
    for case, result in report.items():
        size = f"{result['batch']} images, {result['steps']} steps, CPU"
        print(f"{case}: {result['kind']} on {result['model']} ({size}):")
        for variant, row in result["variants"].items():
            extra = f", decision {row['decision_ms_per_call']} ms/call" if "decision_ms_per_call" in row else ""
            print(f"  {variant:>12}: {row['call_ms']:8.2f} ms/call {row['image_ms']:8.2f} ms/image "
                  f"x{row['speedup_per_call']} expensive rows ran {row['expensive_rows_ran']:.0%}{extra}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
