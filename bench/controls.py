"""ControlNets on the worker's step runner: the cost of one denoising call over 8 rows with 0, 1 and 2 ControlNets,
and of a call where half the rows use one (the rows without control must not pay for it: the ControlNet runs over
the rows that use it only).

The tiny SD 1.5 pipeline (built here, or the stack's with `--model-dir`) and two tiny ControlNets of its UNet
(`emulators/tiny_controls.py`), in this one process with the worker's thread count; the variants interleaved call by
call so a machine's changing load falls on all of them alike. Unguided images, so 8 images are 8 rows.

    .venv/bin/python -m bench.controls --calls 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from contract.generation import ControlRef
from contract.messages import GenerationParameters
from emulators.stack import local_catalog

SIZE, ROWS = 64, 8


def main() -> None:
    import torch
    from diffusers import ControlNetModel
    from PIL import Image

    from emulators.tiny_controls import build_controlnet
    from emulators.tiny_pipeline import build_pipeline
    from model_worker.controls.loader import ControlSet, ControlWeights
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a tiny SD 1.5 pipeline (default: built in a scratch folder)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("MAAS_TORCH_THREADS", "1")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = local_catalog().get("sd15-txt2img").model_copy(update={"scheduling": "step", "max_batch_size": ROWS})
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or build_pipeline(Path(scratch) / "sd15")
        weights = {name: ControlWeights(name, "controlnet", "1", name, 0, ControlNetModel.from_pretrained(
            build_controlnet(model_dir, Path(scratch) / name, seed))) for name, seed in (("edges", 1), ("depth", 2))}  # fmt: skip
        runner = DiffusionRunner(spec, model_dir, torch_threads=args.threads)
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))

    def items(names: tuple[str, ...], count: int = ROWS) -> list:
        controls = None
        if names:
            refs = tuple(ControlRef(name=n, kind="controlnet", version="1", sha256=n, scale=0.8) for n in names)
            controls = ControlSet(refs, loaded=[weights[n] for n in names])
            controls.done.set()
        return [GenerationItem(prompt="a lighthouse", seed=i, controls=controls, control_images=(image,) * len(names))
                for i in range(count)]  # fmt: skip

    params = GenerationParameters(seed=0, num_inference_steps=25, guidance_scale=1.0, width=SIZE, height=SIZE)
    variants = {
        "0 ControlNets": items(()),
        "1 ControlNet": items(("edges",)),
        "2 ControlNets": items(("edges", "depth")),
        "1 ControlNet on 4 of the 8 rows": items(("edges",), ROWS // 2) + items((), ROWS // 2),
    }
    running = {name: runner.start_items(group, params) for name, group in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.calls):
        for name in variants:
            if all(r.finished for r in running[name]):
                running[name] = runner.start_items(variants[name], params)
            started = time.perf_counter()
            runner.denoise_step(running[name])
            times[name].append((time.perf_counter() - started) * 1000)
    with open("/proc/loadavg") as file:
        load = " ".join(file.read().split()[:3])
    print(f"ControlNets per denoising call over {ROWS} rows ({SIZE}x{SIZE}, tiny SD 1.5, {args.threads} thread(s), "
          f"{args.calls} calls), median ms; load average {load}:")  # fmt: skip
    base = statistics.median(times["0 ControlNets"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<32} {median:8.1f} ms  ({median / base:.2f}x the base call)")


if __name__ == "__main__":
    main()
