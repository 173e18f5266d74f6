"""What one model call costs on a device, by batch size and step count, from a file of measured points.

A profile holds, per batch size measured, the worker's two ways of spending the device (model_worker/):

- request-level: one pipeline call for a batch, `call_fixed_s + model_calls x call_step_s` (a fit of whole
  calls timed at two step counts, or, for the GPUs, derived as each profile's `source` says);
- step-level: `start_s` per request joining a running set (prompt encoding, latents; image-to-image adds
  the VAE encode), `denoise_s` per shared denoising call, `decode_s` per VAE call of the images finishing.

Between measured batch sizes a cost is interpolated linearly; beyond the largest, extrapolated along the last
segment. `reply_s` is spent per image off the device (PNG encoding in the finisher): it adds to latency only.
`python -m bench.capacity measure` times the CPU tiny pipeline through the worker's own runner and writes its
points into `profiles.json`; `bench/gpu_pipeline.py`'s JSON (`direct` images/s at 25 steps) can be turned into a
profile the same way as the H100 one below (`from_direct_rates`).
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILES_PATH = Path(__file__).with_name("profiles.json")
# PNDM (the catalog's scheduler for both models) runs one model call more than the steps asked for.
PNDM_EXTRA_CALLS = 1
# The SD-1.5-sized VAE's encoder does 0.436x its decoder's arithmetic (torch's FlopCounterMode, both at 64x64
# and 128x128 px; the decoder comes to 2.48 TFLOP at 512x512, DESIGN.md's 2.5): img2img's encode, by that ratio.
VAE_ENCODE_SHARE_OF_DECODE = 0.436
# DESIGN.md, GPU facts: dense fp16 matmul, H100 measured 756 TFLOP/s; L4 121 TFLOP/s (NVIDIA's data sheet).
H100_MATMUL_TFLOPS = 756.0
L4_MATMUL_TFLOPS = 121.0


def model_calls(steps: int, strength: float | None, extra_calls: int = PNDM_EXTRA_CALLS) -> int:
    """Denoising calls a request needs: diffusers' img2img starts `steps - int(steps x strength)` into the
    schedule (SD 1.5's img2img `get_timesteps`, which the worker borrows), and PNDM's schedule is `steps + 1` long."""
    start = 0 if strength is None else max(steps - min(int(steps * strength), steps), 0)
    return steps + extra_calls - start


@dataclass(frozen=True)
class CostProfile:
    name: str
    source: str
    # Per batch size (images): seconds.
    call_fixed_s: dict[int, float]
    call_step_s: dict[int, float]
    start_s: dict[int, float]
    denoise_s: dict[int, float]
    decode_s: dict[int, float]
    reply_s: float = 0.0
    # Image-to-image's VAE encode, per image, on top of `start_s`/`call_fixed_s` (0: text-to-image only measured).
    image_encode_s: float = 0.0
    extra_calls: int = PNDM_EXTRA_CALLS
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, name: str, raw: dict) -> CostProfile:
        tables = ("call_fixed_s", "call_step_s", "start_s", "denoise_s", "decode_s")
        values = {key: {int(b): float(v) for b, v in raw[key].items()} for key in tables}
        rest = {k: raw[k] for k in ("reply_s", "image_encode_s", "extra_calls", "meta") if k in raw}
        return cls(name=name, source=raw["source"], **values, **rest)

    def to_json(self) -> dict:
        raw = asdict(self)
        raw.pop("name")
        return raw

    def calls(self, steps: int, strength: float | None) -> int:
        return model_calls(steps, strength, self.extra_calls)

    def pipeline_call(self, images: int, calls: int, image_input: bool = False) -> float:
        """A request-level batch: one pipeline call of `images` images and `calls` denoising calls."""
        encode = self.image_encode_s * images if image_input else 0.0
        return interpolate(self.call_fixed_s, images) + calls * interpolate(self.call_step_s, images) + encode

    def batching_gain(self, batch: int, calls: int, image_input: bool = False) -> float:
        """Images per second in a request-level batch of `batch` over images per second alone: what the catalog's
        `batching_gain` says of a model on its hardware, at its `max_batch_size`."""
        return batch * self.pipeline_call(1, calls, image_input) / self.pipeline_call(batch, calls, image_input)

    def start(self, images: int, image_input: bool = False) -> float:
        return interpolate(self.start_s, images) + (self.image_encode_s * images if image_input else 0.0)

    def denoise(self, images: int) -> float:
        return interpolate(self.denoise_s, images)

    def decode(self, images: int) -> float:
        return interpolate(self.decode_s, images)


def interpolate(table: dict[int, float], batch: int) -> float:
    """Linear between measured batch sizes, along the last segment beyond them, the smallest's below it."""
    sizes = sorted(table)
    if batch in table:
        return table[batch]
    if batch <= sizes[0] or len(sizes) == 1:
        return table[sizes[0]] * (batch / sizes[0] if batch > sizes[0] else 1.0)
    index = min(bisect.bisect_left(sizes, batch), len(sizes) - 1)
    low, high = sizes[index - 1], sizes[index]
    share = (batch - low) / (high - low)
    return max(0.0, table[low] + share * (table[high] - table[low]))


def load_profiles(path: Path = PROFILES_PATH) -> dict[str, CostProfile]:
    raw = json.loads(path.read_text())
    return {name: CostProfile.from_json(name, entry) for name, entry in raw["profiles"].items()}


def save_profile(profile: CostProfile, path: Path = PROFILES_PATH) -> None:
    """Adds or replaces one profile in the file, keeping the others."""
    raw = json.loads(path.read_text()) if path.exists() else {"profiles": {}}
    raw["profiles"][profile.name] = profile.to_json()
    path.write_text(json.dumps(raw, indent=2) + "\n")


def from_direct_rates(
    name: str, source: str, images_per_s: dict[int, float], steps: int, unet_step_s: tuple[int, float], reply_s: float
) -> CostProfile:
    """A profile from whole pipeline calls at one step count (images/s by batch) and one timed denoising call.

    A roofline with floors: each part of a call (the denoising calls; the rest: text encoding, VAE decode,
    post-processing) costs the more of a floor (launch- and latency-bound) and a per-image cost. The per-image
    costs are the timed batch's (the largest: compute-bound); the two floors are solved from the two smallest
    batches, taking the smallest as on both floors and the next as on the denoising floor only (checked). The
    rest is split between the text encoder and the decoder by their arithmetic (CLIP-L on 77 tokens twice, for
    guidance: ~1.5% of the decoder's 2.5 TFLOP). `meta` keeps each measured call's error under the fit."""
    calls = steps + PNDM_EXTRA_CALLS
    timed_batch, timed_step = unet_step_s
    whole = {b: b / rate for b, rate in sorted(images_per_s.items())}
    step_per_image = timed_step / timed_batch
    rest_per_image = (whole[timed_batch] - calls * timed_step) / timed_batch
    smallest, second = sorted(whole)[:2]
    step_floor = (whole[second] - second * rest_per_image) / calls
    rest_floor = whole[smallest] - calls * step_floor
    if not (
        smallest * rest_per_image <= rest_floor <= second * rest_per_image and step_floor >= second * step_per_image
    ):
        raise ValueError(f"{name}: the measured calls do not fit a roofline with floors")
    step = {b: max(step_floor, b * step_per_image) for b in whole}
    fixed = {b: max(rest_floor, b * rest_per_image) for b in whole}
    start = {b: 0.015 * f for b, f in fixed.items()}
    decode = {b: f - start[b] for b, f in fixed.items()}
    encode = VAE_ENCODE_SHARE_OF_DECODE * decode[timed_batch] / timed_batch
    errors = {b: round((fixed[b] + calls * step[b]) / t - 1, 3) for b, t in whole.items()}
    meta = {"steps": steps, "denoise_floor_s": round(step_floor, 4), "rest_floor_s": round(rest_floor, 4),
            "fit_error_by_batch": errors}  # fmt: skip
    return CostProfile(name, source, fixed, step, start, dict(step), decode, reply_s, encode, meta=meta)


def scaled_by_matmul_rate(base: CostProfile, name: str, ratio: float, source: str) -> CostProfile:
    """Another card from `base`: the compute-bound cost (`base`'s per-image cost at its largest batch) scaled by
    the ratio of matmul rates, and never faster than `base` at the same batch (launch and latency floors)."""

    def scaled(table: dict[int, float]) -> dict[int, float]:
        largest = max(table)
        per_image = table[largest] / largest * ratio
        return {b: max(t, b * per_image) for b, t in table.items()}

    return CostProfile(
        name, source, scaled(base.call_fixed_s), scaled(base.call_step_s), scaled(base.start_s),
        scaled(base.denoise_s), scaled(base.decode_s), base.reply_s, base.image_encode_s * ratio, base.extra_calls,
        meta={"derived_from": base.name, "ratio": round(ratio, 3)},
    )  # fmt: skip


def gpu_profiles() -> list[CostProfile]:
    """The H100 profile from DESIGN.md's numbers and the L4 one derived from it, both stated as derived."""
    h100 = from_direct_rates(
        "h100-sd15",
        "DESIGN.md, GPU facts (H100, SD-1.5-sized random weights, 512x512, 25 steps, fp16, diffusers eager): "
        "direct pipeline 1.23/4.42/5.16/5.41 img/s at batch 1/4/8/16, UNet step 56.6 ms at batch 16, fitted "
        "with a roofline with floors (from_direct_rates); PNG encode 54 ms per image (reply_s). Derived, not "
        "measured by this tool.",
        {1: 1.23, 4: 4.42, 8: 5.16, 16: 5.41},
        steps=25,
        unet_step_s=(16, 0.0566),
        reply_s=0.054,
    )
    ratio = H100_MATMUL_TFLOPS / L4_MATMUL_TFLOPS
    l4 = scaled_by_matmul_rate(
        h100,
        "l4-sd15",
        ratio,
        f"Derived from h100-sd15 by dense fp16 matmul rates (H100 756 TFLOP/s measured, L4 121 published: "
        f"x{ratio:.2f}) on the compute-bound per-image cost, never faster than the H100 at the same batch. "
        "Not measured: no L4 here. It ignores the L4's lower memory bandwidth (300 GB/s), so the VAE's share "
        "is if anything optimistic.",
    )
    return [h100, l4]


def measure_cpu_tiny(model_dir: Path, batches: tuple[int, ...] = (1, 2, 4, 8), repeats: int = 5,
                     size: int = 64, steps: tuple[int, int] = (4, 12), threads: int = 1) -> CostProfile:  # fmt: skip
    """Times the tiny pipeline through the worker's own runner (`DiffusionRunner`): whole pipeline calls at two
    step counts (request-level), and start, one denoising call and decode (step-level), per batch size; medians."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from contract.messages import GenerationParameters
    from emulators.stack import local_catalog
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    spec = local_catalog().get("sd15-txt2img").model_copy(update={"scheduling": "step"})
    runner = DiffusionRunner(spec, model_dir, torch_threads=threads)
    runner.warm_up()

    def params(count: int) -> GenerationParameters:
        return GenerationParameters(seed=0, num_inference_steps=count, guidance_scale=spec.defaults.guidance_scale,
                                    width=size, height=size)  # fmt: skip

    def timed(call) -> float:
        began = time.perf_counter()
        call()
        return time.perf_counter() - began

    def items(batch: int) -> list[GenerationItem]:
        return [GenerationItem(prompt=f"capacity {i}", seed=i) for i in range(batch)]

    low, high = steps
    fixed, per_step, start, denoise, decode = {}, {}, {}, {}, {}
    for batch in batches:
        whole = {}
        for count in steps:
            call = (items(batch), params(count))
            whole[count] = statistics.median(
                timed(lambda call=call: runner.generate(*call, lambda s, t: None)) for _ in range(repeats)
            )
        calls_low, calls_high = model_calls(low, None), model_calls(high, None)
        per_step[batch] = (whole[high] - whole[low]) / (calls_high - calls_low)
        fixed[batch] = whole[low] - calls_low * per_step[batch]
        # The step scheduler starts each request alone (one image each here) and steps them together.
        starts, steppings, decodes = [], [], []
        for _ in range(repeats):
            running: list = []
            began = time.perf_counter()
            for one in items(batch):
                running += runner.start_items([one], params(low))
            starts.append(time.perf_counter() - began)
            steppings.append(timed(lambda running=running: runner.denoise_step(running)))
            for item in running:
                item.done = item.total
            decodes.append(timed(lambda running=running: runner.decode(running)))
        start[batch] = statistics.median(starts)
        denoise[batch] = statistics.median(steppings)
        decode[batch] = statistics.median(decodes)
    reply = statistics.median(timed(lambda: _encode_png(size)) for _ in range(repeats))
    return CostProfile(
        "cpu-tiny",
        f"Measured by `python -m bench.capacity measure` on this machine: the tiny random-weight SD 1.5 pipeline "
        f"through DiffusionRunner, {size}x{size}, {threads} torch thread(s), medians of {repeats}.",
        fixed, per_step, start, denoise, decode, reply,
        meta={"measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": _load()},
    )  # fmt: skip


def _encode_png(size: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _load() -> list[float]:
    import os

    return [round(v, 2) for v in os.getloadavg()]
