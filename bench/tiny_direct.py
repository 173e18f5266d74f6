"""The tiny diffusion pipeline called directly, beside the worker's runner and stages, at batches 1, 4 and 8.

Both load the same saved pipeline (the stack's tiny model directory) in this one process, with the
worker's thread count (MAAS_TORCH_THREADS=1 in the local stack), so the difference is the worker's own
cost: per-item generators and prompts, the pool, the device loop, PNG encoding, storing and publishing.

    .venv/bin/python -m bench.tiny_direct --model-dir .stack/tiny-model/sd15-txt2img --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from contract.messages import GenerationParameters
from emulators.stack import local_catalog


def direct_images_per_second(pipeline, torch, batch: int, params: GenerationParameters, seconds: float) -> dict:
    """Back-to-back pipeline calls of `batch` images for about `seconds` (after one warm-up call)."""

    def call(seed: int) -> None:
        with torch.inference_mode():
            pipeline(
                prompt=[f"bench {seed + i}" for i in range(batch)],
                num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale,
                width=params.width,
                height=params.height,
                generator=[torch.Generator(device="cpu").manual_seed(seed + i) for i in range(batch)],
            )

    call(0)
    calls, started = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - started < seconds:
        call(calls * batch)
        calls += 1
    elapsed = time.perf_counter() - started
    return {
        "batch": batch,
        "images": calls * batch,
        "seconds": round(elapsed, 3),
        "images_per_s": calls * batch / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--model", default="sd15-txt2img")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=6.0, help="measurement time per batch size and path")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("MAAS_TORCH_THREADS", "1")))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import diffusers
    import torch

    from bench.worker_harness import worker_images_per_second
    from model_worker.model.pipeline import DiffusionRunner

    torch.set_num_threads(args.threads)
    spec = local_catalog().get(args.model)
    params = GenerationParameters(
        seed=0, num_inference_steps=args.steps, guidance_scale=spec.defaults.guidance_scale,
        width=args.size, height=args.size,
    )  # fmt: skip
    pipeline = getattr(diffusers, spec.pipeline).from_pretrained(
        args.model_dir, torch_dtype=torch.float32, use_safetensors=True, safety_checker=None,
        requires_safety_checker=False,
    )  # fmt: skip
    pipeline.set_progress_bar_config(disable=True)
    runner = DiffusionRunner(spec, args.model_dir, torch_threads=args.threads)
    runner.warm_up()
    rows = []
    for batch in args.batches:
        direct = direct_images_per_second(pipeline, torch, batch, params, args.seconds)
        per_call = direct["seconds"] / (direct["images"] / batch)
        images = max(2 * batch, int(args.seconds / per_call) * batch)
        worker = worker_images_per_second(runner, spec, params, batch, images=images, warmup_images=batch)
        rows.append({"batch": batch, "direct": direct, "worker": worker})
        print(
            f"batch {batch}: direct {direct['images_per_s']:.2f} img/s, worker {worker['images_per_s']:.2f} img/s "
            f"({worker['images_per_s'] / direct['images_per_s']:.0%})",
            flush=True,
        )
    result = {"model": args.model, "size": args.size, "steps": args.steps, "threads": args.threads, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
