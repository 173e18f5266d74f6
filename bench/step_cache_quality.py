"""An operator's check of a step cache on their own weights: N prompts with the catalog's `step_cache` and without,
in the worker's own runner, reporting per prompt the steps skipped, the time, and how far the image moved.

Hit rates and quality depend on the real weights (a random-weight model says nothing of either): run this on the
model's weights, on a GPU, before turning a cache on or changing its threshold (docs/guides/step-caching.md).

    .venv/bin/python -m bench.step_cache_quality --model flux-dev --weights /models/flux-dev --prompts my-prompts-file
    .venv/bin/python -m bench.step_cache_quality --model sd15-txt2img --weights DIR --threshold 0.12 --count 20
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

DEFAULT_PROMPTS = ["a red fox in fresh snow, morning light", "a bowl of ramen on a wooden table, top view",
                   "a lighthouse on a cliff in a storm", "portrait of an old sailor, oil painting",
                   "a city street at night in the rain, neon signs"]  # fmt: skip


def generate(runner, prompt: str, seed: int, params: GenerationParameters) -> tuple:
    """One image stepped alone as the worker steps it: (the image, steps skipped, seconds)."""
    started = time.perf_counter()
    running = runner.start_items([GenerationItem(prompt=prompt, seed=seed)], params)
    while not running[0].finished:
        runner.denoise_step(running)
    skipped = running[0].skipped
    image = runner.decode(running)[0]
    return image, skipped, time.perf_counter() - started


def compare(cached, plain) -> dict:
    """How far the cached image is from the uncached one: the largest and mean pixel difference (of 255), PSNR."""
    import numpy as np

    difference = np.abs(np.asarray(cached, dtype=np.float64) - np.asarray(plain, dtype=np.float64)) * 255
    mse = float((difference**2).mean())
    return {"max": round(float(difference.max()), 1), "mean": round(float(difference.mean()), 2),
            "psnr_db": round(10 * np.log10(255**2 / mse), 2) if mse else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a catalog model with (or to try) a step_cache")
    parser.add_argument("--weights", type=Path, required=True, help="its diffusers weights directory")
    parser.add_argument("--prompts", type=Path, help="one prompt a line (default: a few built in)")
    parser.add_argument("--count", type=int, default=5, help="prompts to run (cycled)")
    parser.add_argument("--threshold", type=float, help="first_block: try this threshold instead of the catalog's")
    parser.add_argument("--interval", type=int, help="deepcache: try this interval instead of the catalog's")
    parser.add_argument("--steps", type=int, help="steps (default: the catalog's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from model_worker.model.pipeline import DiffusionRunner

    spec = local_catalog().get(args.model).model_copy(update={"scheduling": "step"})
    settings = spec.step_cache.model_dump() if spec.step_cache else {"kind": spec.family.step_caches[0]}
    settings.update({key: value for key, value in (("threshold", args.threshold), ("interval", args.interval))
                     if value is not None})  # fmt: skip
    cached_spec = ModelSpec.model_validate({**spec.model_dump(), "step_cache": settings})
    plain = DiffusionRunner(spec.model_copy(update={"step_cache": None}), args.weights)
    cached = DiffusionRunner(cached_spec, args.weights, share=plain)
    defaults = spec.defaults
    params = GenerationParameters(
        seed=0,
        num_inference_steps=args.steps or defaults.num_inference_steps,
        guidance_scale=defaults.guidance_scale,
        width=defaults.width,
        height=defaults.height,
    )
    prompts = args.prompts.read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    generate(plain, prompts[0], 0, params)  # warm-up, untimed
    rows = []
    for index in range(args.count):
        prompt = prompts[index % len(prompts)]
        without, _, plain_s = generate(plain, prompt, index, params)
        with_cache, skipped, cached_s = generate(cached, prompt, index, params)
        rows.append({"prompt": prompt, "seed": index, "steps_skipped": skipped, "seconds_without": round(plain_s, 3),
                     "seconds_with": round(cached_s, 3), "difference": compare(with_cache, without)})  # fmt: skip
        print(f"{skipped:>3} skipped  {plain_s:6.2f}s -> {cached_s:6.2f}s  max {rows[-1]['difference']['max']:5.1f}/255  "
              f"PSNR {rows[-1]['difference']['psnr_db']} dB  {prompt[:50]}")  # fmt: skip
    speedup = statistics.mean(r["seconds_without"] for r in rows) / statistics.mean(r["seconds_with"] for r in rows)
    print(
        f"{cached_spec.step_cache.kind} {settings}: x{speedup:.2f} per image, "
        f"{statistics.mean(r['steps_skipped'] for r in rows):.1f} of {params.num_inference_steps} steps skipped"
    )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "step_cache": settings, "speedup": speedup, "rows": rows},
                                        indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
