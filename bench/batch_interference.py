"""An interactive request's latency on one worker with and without a batch backlog (issue 35); the ratio printed.

The worker's own pool, device loop and finisher (bench/worker_harness.py's in-memory stand-ins for Pub/Sub,
Redis and the bucket) around a stand-in GPU (the synthetic runner: `--call-seconds` per call, in 10 steps,
sleeping, so the machine's CPU load does not blur what the worker's rules cost) or the tiny diffusion pipeline
on the CPU (`--model-dir`). Interactive single-image requests arrive one at a time at random gaps, on an
otherwise idle worker (the capacity batch lines fill); in the batch run a feeder keeps the worker's batch room
full, as the batch subscription's puller does. Both schedulings, at the worker's MAAS_BATCH_IMAGES (1 beside
interactive traffic) and at full batches.

    .venv/bin/python -m bench.batch_interference --json bench/results/batch_interference.json
    .venv/bin/python -m bench.batch_interference --model-dir .stack/tiny-model/sd15-txt2img
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from contract.messages import GenerationParameters
from emulators.stack import local_catalog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="the tiny pipeline's directory (else the synthetic runner)")
    parser.add_argument("--model", default="sd15-txt2img")
    parser.add_argument("--call-seconds", type=float, default=1.0, help="the synthetic runner's call, 10 steps")
    parser.add_argument("--requests", type=int, default=40, help="interactive requests per run")
    parser.add_argument("--gap", type=float, default=1.5, help="mean seconds between a reply and the next request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch-images", type=int, nargs="+", default=[1, 0], help="0: max_batch_size")
    parser.add_argument("--schedulings", nargs="+", default=["step", "request"])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("MAAS_TORCH_THREADS", "1")))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from bench.worker_harness import interactive_latencies
    from model_worker.model.runners import SyntheticRunner

    base = local_catalog().get(args.model)
    params = GenerationParameters(seed=0, num_inference_steps=args.steps, guidance_scale=base.defaults.guidance_scale,
                                  width=args.size, height=args.size)  # fmt: skip
    rows = []
    for scheduling in args.schedulings:
        spec = base.model_copy(update={"scheduling": scheduling})
        if args.model_dir:
            import torch

            from model_worker.model.pipeline import DiffusionRunner

            torch.set_num_threads(args.threads)
            runner = DiffusionRunner(spec, args.model_dir, torch_threads=args.threads)
        else:
            spec = spec.model_copy(update={"runner": "sleep"})
            params = params.model_copy(update={"num_inference_steps": 10})
            runner = SyntheticRunner(spec, call_seconds=args.call_seconds)
        runner.warm_up()
        alone = interactive_latencies(runner, spec, params, args.requests, args.gap, batch_backlog=False)
        for batch_images in args.batch_images:
            with_batch = interactive_latencies(runner, spec, params, args.requests, args.gap, batch_backlog=True,
                                               batch_images=batch_images or None)  # fmt: skip
            row = {"scheduling": scheduling, "runner": "tiny pipeline" if args.model_dir else "synthetic",
                   "batch_images": batch_images or spec.max_batch_size, "alone": alone,
                   "with_batch": with_batch, "p50_ratio": with_batch["p50_s"] / alone["p50_s"],
                   "mean_ratio": with_batch["mean_s"] / alone["mean_s"], "load_average": os.getloadavg()}  # fmt: skip
            rows.append(row)
            print(f"{scheduling}-level, {row['batch_images']} batch image(s) at once: interactive p50 "
                  f"{alone['p50_s'] * 1000:.0f} ms alone, {with_batch['p50_s'] * 1000:.0f} ms with a batch backlog "
                  f"(x{row['p50_ratio']:.2f}); mean x{row['mean_ratio']:.2f}; p95 {alone['p95_s'] * 1000:.0f} -> "
                  f"{with_batch['p95_s'] * 1000:.0f} ms; {with_batch['batch_lines_done']} batch lines done meanwhile; "
                  f"load average {row['load_average'][0]:.1f}", flush=True)  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
