"""The scheduler step of a step-level running set: operations dispatched and host time per step, vectorised
(`linear_steps`) against each image's own diffusers scheduler, for every scheduler a model may step per item.

Each non-view operation is one kernel launch on a GPU (a view is not), and at batch 1 a step of an SD-1.5-sized
UNet is launch-bound on an H100, so what matters is that a step's count does not grow with the running set: the
vectorised step launches the same few kernels for 1 image or 16, the per-image step its scheduler's for each.
SD-1.5-sized latents (4 x 64 x 64), fp32 on the CPU (fp16 on CUDA when present); the images joined two steps
apart, so the multistep schedulers' histories differ in length, as in a live set.

    .venv/bin/python -m bench.scheduler_steps [--images 1 8 16] [--steps 12]
"""

from __future__ import annotations

import argparse
import time

SCHEDULERS = (
    "PNDMScheduler", "DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler", "LCMScheduler",
)  # fmt: skip
# SD 1.5's scheduler configuration (what `from_config` of its PNDM gets), and FLUX's flow-matching one.
UNET_CONFIG = {
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "clip_sample": False,
}  # fmt: skip
FLOW_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}
LATENTS = (1, 4, 64, 64)


def running_set(name: str, images: int, steps: int, device: str, vectorised: bool) -> list:
    """`images` prepared images of scheduler `name`, as `Denoiser.prepared` leaves them; per image when not
    `vectorised` (their coefficient tables dropped: each steps its own diffusers scheduler)."""
    import diffusers
    import torch

    from model_worker.model.families.base import Denoiser
    from model_worker.model.runners import GenerationItem, RunningItem

    dtype = torch.float16 if device == "cuda" else torch.float32
    running = []
    for seed in range(images):
        scheduler = getattr(diffusers, name).from_config(FLOW_CONFIG if name.startswith("Flow") else UNET_CONFIG)
        scheduler.set_timesteps(steps)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        kwargs = {"generator": torch.Generator().manual_seed(seed)} if name in ("EulerAncestralDiscreteScheduler",
                                                                               "LCMScheduler") else {}  # fmt: skip
        latents = torch.randn(LATENTS, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)
        state = {"scheduler": scheduler, "timesteps": scheduler.timesteps.to(device), "latents": latents,
                 "step_kwargs": kwargs}  # fmt: skip
        total = len(scheduler.timesteps)
        running.append(RunningItem(GenerationItem(prompt="p", seed=seed), total=total, requested=total, state=state))
    Denoiser.__new__(Denoiser).prepared(running)  # prepared and step_items use no pipeline
    if not vectorised:
        for r in running:
            r.state["linear"] = r.state["noise"] = None
    return running


class Counted:
    """Counts the non-view ATen operations dispatched while active (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not func.is_view:
                    counter.operations += 1
                return func(*args, **(kwargs or {}))

        self.operations = 0
        self._mode = Mode()

    def __enter__(self) -> Counted:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def stepping(name: str, images: int, steps: int, device: str, vectorised: bool) -> tuple:
    """(a pipeline-less denoiser, the running set, each image's fixed model output) for `running_set`'s images."""
    import torch

    from model_worker.model.families.base import Denoiser

    running = running_set(name, images, steps, device, vectorised)
    return Denoiser.__new__(Denoiser), running, [torch.tanh(r.state["latents"]) for r in running]


def measure(name: str, images: int, steps: int, device: str, vectorised: bool) -> dict:
    """Operations and host milliseconds per step of the set, over its steps after the first two (the multistep
    schedulers' warm-up branches), each image's model output a fixed tensor of its own."""
    import torch

    worker, running, outputs = stepping(name, images, steps, device, vectorised)
    operations, seconds, counted = 0, 0.0, 0
    for step in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        with Counted() as count:
            began = time.perf_counter()
            worker.step_items(running, outputs)
            elapsed = time.perf_counter() - began
        if any(r.failure is not None for r in running):
            raise RuntimeError(f"{name}: {next(r.failure for r in running if r.failure is not None)}")
        if step >= 2:
            operations, seconds, counted = operations + count.operations, seconds + elapsed, counted + 1
    return {"operations": operations / counted, "host_ms": seconds / counted * 1000}


def host_ms(name: str, images: int, steps: int, device: str, vectorised: bool) -> float:
    """Host milliseconds per step without the counting mode (which costs more than the step)."""
    import torch

    worker, running, outputs = stepping(name, images, steps, device, vectorised)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        worker.step_items(running, outputs)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times[2:])[len(times[2:]) // 2] * 1000


def main() -> int:
    import os
    import warnings

    import diffusers
    import torch

    diffusers.utils.logging.set_verbosity_error()  # each scheduler's notes on the configuration it ignores
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1)
    print(f"scheduler step of a running set, {device}, latents {LATENTS}, median host ms of steps 3..{args.steps}; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    header = " | ".join(f"{n} img: ops / ms" for n in args.images)
    print(f"| scheduler | step | {header} |")
    print("|---|---|" + "---|" * len(args.images))
    for name in SCHEDULERS:
        for vectorised in (False, True):
            cells = []
            for images in args.images:
                ops = measure(name, images, args.steps, device, vectorised)["operations"]
                cells.append(f"{ops:.0f} / {host_ms(name, images, args.steps, device, vectorised):.2f}")
            print(f"| {name} | {'whole set' if vectorised else 'per image'} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
