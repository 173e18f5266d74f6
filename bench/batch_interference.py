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
    .venv/bin/python -m bench.batch_interference --stand-in --steps 25 --batch-images 0

`--stand-in` replaces the synthetic runner by one that takes an H100's measured times for SD 1.5 at 512x512
(issue 42): a guided step 38 ms at 2 rows to 55 ms at 16 (linear), a prompt encode 1.4 ms and a VAE decode
91 ms an image; all sleeping, so the worker's own threads show as on the card. It prints the longest wait a
running batch can add to an interactive request, as the worker's rules bound it (one batched step, plus an
encode or a decode already under way: step-level one line's decode, request-level the whole call's), beside
the longest extra latency measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

from contract.messages import GenerationParameters
from emulators.stack import local_catalog

# An H100's SD 1.5 times at 512x512 (../shared/gpu/H100-2026-11.md; bench/capacity/profiles.json's h100-sd15).
STEP_SECONDS = {2: 0.038, 16: 0.055}  # a guided UNet call, by rows (two per image)
ENCODE_SECONDS = 0.0014  # a prompt's text encoding, per image
DECODE_SECONDS = 0.0915  # a VAE decode, per image (slicing: one image a call, back to back)


def step_seconds(images: int) -> float:
    """A guided step of `images` images on the H100: linear between 2 and 16 rows."""
    (low, low_s), (high, high_s) = sorted(STEP_SECONDS.items())
    rows = 2 * images
    return low_s + (high_s - low_s) * (max(rows, low) - low) / (high - low)


def longest_wait(scheduling: str, batch_images: int) -> float:
    """The longest a running batch of `batch_images` lines can delay an interactive request: the step under way,
    plus what cannot be cut short: step-level one line's encode or decode (the others give way), request-level the
    whole call's (they run inside the pipeline call)."""
    lines = 1 if scheduling == "step" else batch_images
    return step_seconds(batch_images) + max(ENCODE_SECONDS, DECODE_SECONDS) * lines


class StandInRunner:
    """The synthetic runner's interface with the H100's times (module docstring); images from the synthetic one."""

    def __init__(self, spec) -> None:
        from model_worker.model.runners import SyntheticRunner

        self._images = SyntheticRunner(spec)
        self.spec = spec
        self.accelerator = "stand-in H100"

    def warm_up(self) -> None:
        self._images.warm_up()

    def start_items(self, items, params):
        time.sleep(ENCODE_SECONDS * len(items))
        return self._images.start_items(items, params)

    def denoise_step(self, running) -> None:
        time.sleep(step_seconds(len(running)))
        for r in running:
            r.done += 1

    def decode(self, running) -> list:
        time.sleep(DECODE_SECONDS * len(running))
        return self._images.decode(running)

    def generate(self, items, params, on_step) -> list:
        time.sleep(ENCODE_SECONDS * len(items))
        steps = params.num_inference_steps
        for step in range(1, steps + 1):
            time.sleep(step_seconds(len(items)))
            on_step(step, steps)  # a call of batch lines stops here for an interactive request
        time.sleep(DECODE_SECONDS * len(items))
        return [self._images.decode([SimpleNamespace(item=item)])[0] for item in items]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="the tiny pipeline's directory (else the synthetic runner)")
    parser.add_argument("--model", default="sd15-txt2img")
    parser.add_argument("--call-seconds", type=float, default=1.0, help="the synthetic runner's call, 10 steps")
    parser.add_argument("--stand-in", action="store_true", help="the H100 stand-in runner (module docstring)")
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
        elif args.stand_in:
            spec = spec.model_copy(update={"runner": "sleep"})
            runner = StandInRunner(spec)
        else:
            spec = spec.model_copy(update={"runner": "sleep"})
            params = params.model_copy(update={"num_inference_steps": 10})
            runner = SyntheticRunner(spec, call_seconds=args.call_seconds)
        runner.warm_up()
        alone = interactive_latencies(runner, spec, params, args.requests, args.gap, batch_backlog=False)
        for batch_images in args.batch_images:
            with_batch = interactive_latencies(runner, spec, params, args.requests, args.gap, batch_backlog=True,
                                               batch_images=batch_images or None)  # fmt: skip
            row = {"scheduling": scheduling, "runner": runner.accelerator if args.stand_in else "tiny pipeline" if args.model_dir else "synthetic",
                   "batch_images": batch_images or spec.max_batch_size, "alone": alone,
                   "with_batch": with_batch, "p50_ratio": with_batch["p50_s"] / alone["p50_s"],
                   "mean_ratio": with_batch["mean_s"] / alone["mean_s"], "load_average": os.getloadavg()}  # fmt: skip
            rows.append(row)
            print(f"{scheduling}-level, {row['batch_images']} batch image(s) at once: interactive p50 "
                  f"{alone['p50_s'] * 1000:.0f} ms alone, {with_batch['p50_s'] * 1000:.0f} ms with a batch backlog "
                  f"(x{row['p50_ratio']:.2f}); mean x{row['mean_ratio']:.2f}; p95 {alone['p95_s'] * 1000:.0f} -> "
                  f"{with_batch['p95_s'] * 1000:.0f} ms; {with_batch['batch_lines_done']} batch lines done meanwhile; "
                  f"load average {row['load_average'][0]:.1f}", flush=True)  # fmt: skip
            if args.stand_in:
                row["longest_wait_s"] = longest_wait(scheduling, row["batch_images"])
                row["longest_extra_measured_s"] = with_batch["max_s"] - alone["p50_s"]
                print(f"  longest wait a running batch adds, by the rules: {row['longest_wait_s'] * 1000:.0f} ms; "
                      f"measured: max {with_batch['max_s'] * 1000:.0f} ms against a lone p50 of "
                      f"{alone['p50_s'] * 1000:.0f} ms (+{row['longest_extra_measured_s'] * 1000:.0f} ms)")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
