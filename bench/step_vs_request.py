"""Step-level against request-level on a stand-in H100: single-image requests at batch 8, side by side.

The stand-in denoiser sleeps the H100's measured time for a guided SD-1.5-sized step of its rows (38 ms at 2 rows,
55 ms at 16, linear between; `time.sleep` holds no lock, as a GPU call waiting on its kernels would not), and
decodes to 512x512 float images (copies of noise images made once: the host's copy of a decoded image, not the
stand-in's own random drawing, is what the device thread pays), so the worker's own threads (pool, device loop,
finisher's PNG encode, store, publish) cost what they would beside a card. Prints, for each scheduling, img/s, the
stand-in device's busy share and the images a model call; then their ratio.

The schedulings run in rounds of request, step, step, request (`--rounds`), so a machine whose load drifts during
the run weighs on both alike; the ratio is of their summed rates.

    .venv/bin/python -m bench.step_vs_request [--images 40] [--steps 25] [--rounds 1] [--png-level N]
        [--finisher-nice N] [--lone REPEATS]

`--mixed MODEL_ROOT` (issue 51): inpainting and editing instead, on the stack's tiny models (the CPU, one torch
thread): one worker serving a text-to-image model and an inpaint (SD 1.5: sd15-txt2img + sd15-inpaint) or edit
model (FLUX.1: flux-schnell + flux-kontext), fed single-image requests alternating between the two, each inpaint
row with its own image and mask, each edit row with its own reference image; img/s and images a model call, step-level
against request-level, rounds interleaved as above. `--json` writes the figures; `--smoke` is the smallest run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from pathlib import Path

from bench.worker_harness import worker_images_per_second
from contract.messages import GenerationParameters, InferenceRequest, RequestInstance
from contract.settings import Settings
from emulators.stack import local_catalog
from model_worker.model.runners import GenerationItem, RunningItem

SIZE = 512
NOISE_IMAGES = 8  # distinct decoded images, reused: PNGs of noise cost what the heaviest real ones do


def step_seconds(rows: int) -> float:
    """The H100's time for one guided UNet call of `rows` rows (two per image)."""
    return 0.038 + (0.055 - 0.038) * (min(max(rows, 2), 16) - 2) / 14


class StandInRunner:
    """A runner whose model calls take the H100's time and whose images are full-size float arrays."""

    accelerator = "stand-in-h100"

    def __init__(self, spec) -> None:
        import numpy as np

        self.spec = spec
        self._device = threading.Lock()
        self._images = [np.random.default_rng(seed).random((SIZE, SIZE, 3), dtype=np.float32)
                        for seed in range(NOISE_IMAGES)]  # fmt: skip
        self.calls: list[tuple[float, float, int]] = []  # (start, seconds, images) of each model call

    def warm_up(self) -> None: ...

    def _image(self, seed: int):
        return self._images[seed % NOISE_IMAGES].copy()

    def _call(self, images: int) -> None:
        seconds = step_seconds(2 * images)
        self.calls.append((time.perf_counter(), seconds, images))
        time.sleep(seconds)

    def generate(self, items, params, on_step) -> list:
        steps = params.num_inference_steps
        with self._device:
            for step in range(1, steps + 1):
                self._call(len(items))
                on_step(step, steps)
        return [self._image(item.seed) for item in items]

    def start_items(self, items, params) -> list[RunningItem]:
        return [RunningItem(item, total=params.num_inference_steps) for item in items]

    def denoise_step(self, running: list[RunningItem]) -> None:
        with self._device:
            self._call(len(running))
        for r in running:
            r.done += 1

    def busy(self) -> tuple[float, float]:
        """(the device's busy share from its first call's start to its last's end, mean images a call)."""
        start, end = self.calls[0][0], self.calls[-1][0] + self.calls[-1][1]
        return sum(seconds for _, seconds, _ in self.calls) / (end - start), statistics.fmean(
            images for _, _, images in self.calls
        )

    def decode(self, running: list[RunningItem]) -> list:
        return [self._image(r.item.seed) for r in running]


def encode_at(level: int) -> None:
    """The finisher's PNGs at another zlib level (what the encode costs the device loop, level against level)."""
    import io

    from model_worker.serving import finisher

    def png_bytes(image) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=level)
        return buffer.getvalue()

    finisher._png_bytes = png_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--png-level", type=int, default=None, help="Pillow compress_level for the finisher's PNGs")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of request, step, step, request")
    parser.add_argument("--finisher-nice", type=int, default=Settings.finisher_nice,
                        help="the finisher threads' CPU priority below the device thread's (MAAS_FINISHER_NICE)")  # fmt: skip
    parser.add_argument("--lone", type=int, default=0, metavar="REPEATS",
                        help="instead: a lone 12- and 25-step request's latency in both schedulings (median of REPEATS)")  # fmt: skip
    parser.add_argument("--mixed", type=Path, metavar="MODEL_ROOT",
                        help="instead: inpainting and editing mixed with text-to-image on the stack's tiny models")  # fmt: skip
    parser.add_argument("--json", type=Path, help="--mixed: write its figures here")
    parser.add_argument("--smoke", action="store_true", help="--mixed: the smallest run (that it works, no figure)")
    args = parser.parse_args()
    if args.mixed:
        report = mixed(args.mixed, *((2, 1, 0) if args.smoke else (args.images, args.steps, args.rounds)))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return
    if args.png_level is not None:
        encode_at(args.png_level)
    base = local_catalog(test_fixtures=True).get("sd15-txt2img")
    if args.lone:
        lone_latencies(base.model_copy(update={"max_batch_size": args.batch}), args.lone)
        return
    params = GenerationParameters(seed=0, num_inference_steps=args.steps, guidance_scale=7.5, width=SIZE, height=SIZE)
    rates: dict[str, list[float]] = {"request": [], "step": []}
    for scheduling in ("request", "step", "step", "request") * args.rounds:
        spec = base.model_copy(update={"scheduling": scheduling, "max_batch_size": args.batch})
        runner = StandInRunner(spec)
        r = worker_images_per_second(runner, spec, params, args.batch, args.images, warmup_images=args.batch,
                                     finisher_nice=args.finisher_nice)  # fmt: skip
        rates[scheduling].append(r["images_per_s"])
        busy, per_call = runner.busy()
        print(f"{scheduling}-level: {r['images_per_s']:.2f} img/s ({r['images']} images; device busy {busy:.0%} of "
              f"its run, {len(runner.calls)} model calls, {per_call:.2f} images a call)", flush=True)  # fmt: skip
    ideal = args.batch / (args.steps * step_seconds(2 * args.batch))
    print(f"stand-in bound at batch {args.batch}: {ideal:.2f} img/s")
    print(f"step / request: {sum(rates['step']) / sum(rates['request']):.1%}")


# Each mix: a text-to-image model and the inpaint or edit model its worker group serves beside it.
MIXES = {"inpaint": ("sd15-txt2img", "sd15-inpaint"), "edit": ("flux-schnell", "flux-kontext")}
MIXED_SIZE, MIXED_BATCH = 64, 4


def mixed_request(spec, steps: int, seed: int):
    """A single-image request to `spec` at 64x64: an inpaint row with its own image and mask (a box that moves with
    the seed), an edit row with its own reference image, a text-to-image row with only its prompt."""
    from PIL import Image

    from model_worker.held.pool import HeldMessage, PendingRequest

    params = GenerationParameters(
        seed=seed, num_inference_steps=steps, guidance_scale=spec.defaults.guidance_scale, width=MIXED_SIZE,
        height=MIXED_SIZE, strength=1.0 if spec.task == "inpaint" else None,
    )  # fmt: skip
    item = GenerationItem(prompt=f"bench {seed}", seed=seed)
    if spec.task in ("inpaint", "edit"):
        image = Image.new("RGB", (MIXED_SIZE, MIXED_SIZE), (seed * 37 % 256, 90, 160))
        mask = None
        if spec.task == "inpaint":
            mask = Image.new("L", (MIXED_SIZE, MIXED_SIZE), 0)
            corner = seed * 8 % (MIXED_SIZE // 2)
            mask.paste(255, (corner, corner, corner + MIXED_SIZE // 2, corner + MIXED_SIZE // 2))
        item = GenerationItem(prompt=f"bench {seed}", seed=seed, image=image, mask=mask)
    request_id = uuid.uuid4().hex
    request = InferenceRequest(request_id=request_id, model=spec.name, model_version=spec.version,
                               instances=[RequestInstance(prompt=item.prompt)], parameters=params)  # fmt: skip
    message = HeldMessage(f"bench/{spec.name}", f"ack-{request_id}", {}, b"", 1, time.time())
    return PendingRequest(message, spec, request, [item], "normal", None)


def mixed(model_root: Path, images: int, steps: int, rounds: int) -> dict:
    """Each mix in both schedulings (rounds of request, step, step, request; none: each once, the smoke's run, with
    no warm-up): img/s and images a model call."""
    import torch

    from model_worker.model.pipeline import DiffusionRunner

    torch.set_num_threads(1)
    catalog = local_catalog(test_fixtures=True)
    report: dict = {"images": images, "steps": steps, "size": MIXED_SIZE, "batch": MIXED_BATCH, "mixes": {}}
    for mix, names in MIXES.items():
        specs = [catalog.get(name).model_copy(update={"max_batch_size": MIXED_BATCH}) for name in names]
        # One runner per model, built once: the scheduling is the request's spec's (the device loop reads it there).
        runners = {spec.queue: DiffusionRunner(spec, model_root / spec.name, torch_threads=1) for spec in specs}
        rates: dict[str, list[float]] = {"request": [], "step": []}
        calls: dict[str, list[float]] = {"request": [], "step": []}
        for scheduling in ("request", "step", "step", "request") * rounds or ("request", "step"):
            scheduled = [spec.model_copy(update={"scheduling": scheduling}) for spec in specs]

            def request(seed: int, scheduled=scheduled):
                return mixed_request(scheduled[seed % 2], steps, seed)  # text-to-image, then inpaint or edit, ...

            first = scheduled[0]
            warmup = 2 if rounds else 0
            r = worker_images_per_second(None, first, None, MIXED_BATCH, images, warmup_images=warmup, runners=runners,
                                         request=request)  # fmt: skip
            rates[scheduling].append(r["images_per_s"])
            # Request-level counts pipeline calls (each all of its steps), step-level denoising calls: images a call.
            per_call = (images + warmup) * (1 if scheduling == "request" else steps) / max(r["pipeline_calls"], 1)
            calls[scheduling].append(per_call)
        row = {scheduling: {"images_per_s": round(sum(rates[scheduling]) / len(rates[scheduling]), 3),
                            "images_per_call": round(statistics.fmean(calls[scheduling]), 2)}
               for scheduling in rates}  # fmt: skip
        row["step_over_request"] = round(sum(rates["step"]) / sum(rates["request"]), 3)
        report["mixes"][mix] = {"models": list(names), **row}
        print(f"{mix} mixed with text-to-image ({' + '.join(names)}, {MIXED_SIZE}x{MIXED_SIZE}, {steps} steps, "
              f"{images} images, batch {MIXED_BATCH}, CPU): request-level {row['request']['images_per_s']:.2f} img/s "
              f"({row['request']['images_per_call']:.1f} images a call), step-level {row['step']['images_per_s']:.2f} "
              f"img/s ({row['step']['images_per_call']:.1f} a call): step / request {row['step_over_request']:.1%}",
              flush=True)  # fmt: skip
    return report


def lone_latencies(spec, repeats: int) -> None:
    """A lone request through the worker's pool, device loop, running set and finisher (the two schedulings
    interleaved): what the worker's own machinery adds to a request alone, the stand-in's steps being equal."""
    from bench import open_loop

    backend = open_loop.InProcessBackend(StandInRunner(spec), spec, (12, 25), SIZE)
    try:
        lone = backend.lone(repeats)
    finally:
        backend.close()
    for steps in ("12", "25"):
        step, request = lone["step"][steps], lone["request"][steps]
        print(f"lone {steps}-step request: step-level {step:.0f} ms, request-level {request:.0f} ms "
              f"({step / request:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
