"""Step-level against request-level on a stand-in H100: single-image requests at batch 8, side by side.

The stand-in denoiser sleeps the H100's measured time for a guided SD-1.5-sized step of its rows (38 ms at 2 rows,
55 ms at 16, linear between; `time.sleep` holds no lock, as a GPU call waiting on its kernels would not), and
decodes to a 512x512 float image, so the worker's own threads (pool, device loop, finisher's PNG encode, store,
publish) cost what they would beside a card. Prints img/s of each scheduling and their ratio.

    .venv/bin/python -m bench.step_vs_request [--images 40] [--steps 25]
"""

from __future__ import annotations

import argparse
import threading
import time

from bench.worker_harness import worker_images_per_second
from contract.messages import GenerationParameters
from emulators.stack import local_catalog
from model_worker.model.runners import RunningItem

SIZE = 512


def step_seconds(rows: int) -> float:
    """The H100's time for one guided UNet call of `rows` rows (two per image)."""
    return 0.038 + (0.055 - 0.038) * (min(max(rows, 2), 16) - 2) / 14


class StandInRunner:
    """A runner whose model calls take the H100's time and whose images are full-size float arrays."""

    accelerator = "stand-in-h100"

    def __init__(self, spec) -> None:
        self.spec = spec
        self._device = threading.Lock()

    def warm_up(self) -> None: ...

    def _image(self, seed: int):
        import numpy as np

        return np.random.default_rng(seed).random((SIZE, SIZE, 3), dtype=np.float32)

    def generate(self, items, params, on_step) -> list:
        steps = params.num_inference_steps
        with self._device:
            for step in range(1, steps + 1):
                time.sleep(step_seconds(2 * len(items)))
                on_step(step, steps)
        return [self._image(item.seed) for item in items]

    def start_items(self, items, params) -> list[RunningItem]:
        return [RunningItem(item, total=params.num_inference_steps) for item in items]

    def denoise_step(self, running: list[RunningItem]) -> None:
        with self._device:
            time.sleep(step_seconds(2 * len(running)))
        for r in running:
            r.done += 1

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
    args = parser.parse_args()
    if args.png_level is not None:
        encode_at(args.png_level)
    base = local_catalog(test_fixtures=True).get("sd15-txt2img")
    params = GenerationParameters(seed=0, num_inference_steps=args.steps, guidance_scale=7.5, width=SIZE, height=SIZE)
    results = {}
    for scheduling in ("request", "step"):
        spec = base.model_copy(update={"scheduling": scheduling, "max_batch_size": args.batch})
        results[scheduling] = worker_images_per_second(
            StandInRunner(spec), spec, params, args.batch, args.images, warmup_images=args.batch
        )
        r = results[scheduling]
        print(f"{scheduling}-level: {r['images_per_s']:.2f} img/s ({r['images']} images, {r['pipeline_calls']} calls)")
    ideal = args.batch / (args.steps * step_seconds(2 * args.batch))
    print(f"stand-in bound at batch {args.batch}: {ideal:.2f} img/s")
    print(f"step / request: {results['step']['images_per_s'] / results['request']['images_per_s']:.1%}")


if __name__ == "__main__":
    main()
