"""The runner interface: one pipeline call for a batch of images, each with its own prompt, seed and input.

A runner also steps: `start_items` prepares images to denoise, `denoise_step` advances a set of them by one
model call, `decode` turns finished ones into images; the step scheduler (`stepping.py`) uses these for
models with `scheduling: step`. The diffusers runner lives in `pipeline.py`; the synthetic `noop` and
`sleep` runners here go through exactly the same worker path, so benchmarks and tests measure the
orchestration, not a stub of it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from contract.generation import PER_CALL_PARAMETERS
from contract.messages import GenerationParameters
from contract.model_spec import ModelSpec

# Called after each denoising step with (step, total); raising from it stops the pipeline call.
StepCallback = Callable[[int, int], None]
# A prompt that makes the synthetic runners fail every time: a poison request for fault tests.
POISON_PROMPT_PREFIX = "!crash"


@dataclass(frozen=True)
class GenerationItem:
    """One image to generate; image i of a request gets `seed + i` so a seed reproduces it alone or batched."""

    prompt: str
    seed: int
    negative_prompt: str | None = None
    image: Any = None  # a PIL image for image-to-image, or a flow's previous stage's latents (1, C, h, w)
    # An inpaint request's mask (a PIL image the image's size: white repaints, black keeps).
    mask: Any = None
    # The request's LoRA adapters (model_worker.adapters.loader.AdapterSet, one per request), None for the base model.
    adapters: Any = None
    # The request's control models (model_worker.controls.loader.ControlSet: its refs carry each one's scale and
    # window), None without; and their control images (PIL), one per ref, in its order.
    controls: Any = None
    control_images: tuple = ()
    # A flow's stage (model_worker/flows/stages.py), as diffusers' base + refiner handoff: start at `denoising_start` of
    # the schedule from the latents in `image` (no noise added), stop at `denoising_end`; `latent_output`: hand
    # the latents on (as `output_type="latent"`) instead of decoding them.
    denoising_start: float | None = None
    denoising_end: float | None = None
    latent_output: bool = False
    # A batch line's image (priority `batch`): its step cache decides by the catalog's `batch_threshold`.
    batch_line: bool = False

    @property
    def call_shape(self) -> tuple:
        """What items of one pipeline call share besides the parameters: where the schedule starts and ends, what
        comes in (latents or an image) and what goes out."""
        return (self.denoising_start, self.denoising_end, self.latent_output, is_latent(self.image))


def is_latent(image: Any) -> bool:
    """A flow's latents (a tensor) rather than a decoded input image."""
    return image is not None and hasattr(image, "ndim")


@dataclass(eq=False)
class RunningItem:
    """One image being denoised by the step scheduler: where it is in its own schedule of model calls."""

    item: GenerationItem
    total: int  # model calls this image needs (its scheduler's timesteps, after img2img's strength)
    # The steps its progress counts to (`progress.total`): those the client asked for, img2img's strength share
    # of them as its pipeline counts it; 0 for `num_inference_steps`.
    requested: int = 0
    done: int = 0
    failure: Exception | None = None  # its own scheduler step failed: it fails alone
    skipped: int = 0  # steps whose expensive part its step cache skipped (model_worker/model/step_cache.py)
    state: dict = field(default_factory=dict)  # the runner's own per-image state (latents, scheduler, ...)

    @property
    def finished(self) -> bool:
        return self.done >= self.total


class Runner(Protocol):
    spec: ModelSpec
    accelerator: str

    def warm_up(self) -> None: ...

    def generate(self, items: list[GenerationItem], params: GenerationParameters, on_step: StepCallback) -> list:
        """One image per item, in order: float arrays (height x width x 3, in [0, 1]) from the diffusers runner,
        PIL images from the synthetic ones; the finisher encodes either as PNG. `params.seed` and
        `params.negative_prompt` are ignored: each item carries its own."""

    def start_items(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        """Prepares one request's images for stepping (prompt encoding, initial latents, own scheduler)."""

    def denoise_step(self, running: list[RunningItem]) -> None:
        """Advances each item by one model call, all in one call. Raises only before any item changed; a failure
        in one item's own scheduler step is kept on that item (`failure`)."""

    def decode(self, running: list[RunningItem]) -> list:
        """Images of finished items, one per item, in order, in one decoder call."""


def batch_key(params: GenerationParameters) -> tuple:
    """What every runner needs equal across the items of one pipeline call: the parameters it takes once per
    call (contract/generation.py), and whether negative prompts are given (for all items, or for none)."""
    return (*(getattr(params, name) for name in PER_CALL_PARAMETERS), bool(params.negative_prompt))


class BatchAbandonedError(Exception):
    """Raised from the step callback when nobody waits for any image of the batch any more."""


class BatchPreemptedError(Exception):
    """Raised from the step callback when a call of batch lines only gives way to a waiting interactive request."""


class ModelFailedError(Exception):
    """The model failed this request for good: not its input's fault (that is a ValueError, `bad_input`) and not
    worth a retry (any other exception is handed back to Pub/Sub). Answered at once as a worker error."""


class SyntheticRunner:
    """Answers with a tiny PNG-able image per item, colored by its seed; `call_seconds` makes it a stand-in GPU."""

    accelerator = "synthetic"

    def __init__(self, spec: ModelSpec, call_seconds: float = 0.0, ticks: int = 10) -> None:
        self.spec = spec
        self._call_seconds = call_seconds
        self._ticks = ticks
        # A device runs one call at a time, whatever the number of threads calling it.
        self._device = threading.Lock()

    def warm_up(self) -> None:
        from PIL import Image  # noqa: F401 - import cost paid at start-up, not on the first request

    def generate(self, items: list[GenerationItem], params: GenerationParameters, on_step: StepCallback) -> list:
        from PIL import Image

        if len(items) > self.spec.max_batch_size:
            raise ValueError(f"batch of {len(items)} exceeds max_batch_size {self.spec.max_batch_size}")
        self._refuse_if_configured_to_fail()
        if any(item.prompt.startswith(POISON_PROMPT_PREFIX) for item in items):
            raise RuntimeError("synthetic pipeline crash (poison prompt)")
        steps = params.num_inference_steps  # progress on the client's scale, whatever the number of ticks
        with self._device:
            if self._call_seconds > 0:
                for tick in range(1, self._ticks + 1):
                    time.sleep(self._call_seconds / self._ticks)
                    on_step(math.ceil(tick * steps / self._ticks), steps)
            else:
                on_step(steps, steps)
        return [Image.new("RGB", (8, 8), _seed_color(item.seed)) for item in items]

    def _refuse_if_configured_to_fail(self) -> None:
        """A catalog version with `fails: true` (a broken canary, for the rollback tests) answers every request
        with a worker error at once, where a poison prompt is retried until dead-lettered."""
        if self.spec.fails:
            raise ModelFailedError(f"{self.spec.name} version {self.spec.version} is configured to fail every request")

    def start_items(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        return [RunningItem(item, total=params.num_inference_steps) for item in items]

    def denoise_step(self, running: list[RunningItem]) -> None:
        """One tick of the stand-in GPU (a tenth of a call, whatever the number of items) for every item."""
        if len(running) > self.spec.max_batch_size:
            raise ValueError(f"step of {len(running)} items exceeds max_batch_size {self.spec.max_batch_size}")
        self._refuse_if_configured_to_fail()
        if any(r.item.prompt.startswith(POISON_PROMPT_PREFIX) for r in running):
            raise RuntimeError("synthetic pipeline crash (poison prompt)")
        with self._device:
            if self._call_seconds > 0:
                time.sleep(self._call_seconds / self._ticks)
        for r in running:
            r.done += 1

    def decode(self, running: list[RunningItem]) -> list:
        from PIL import Image

        return [Image.new("RGB", (8, 8), _seed_color(r.item.seed)) for r in running]


def _seed_color(seed: int) -> tuple[int, int, int]:
    return (seed * 37) % 256, (seed * 101) % 256, (seed * 199) % 256


SLEEP_CALL_SECONDS = 0.2


def build_runner(spec: ModelSpec, load_diffusers: Callable[[ModelSpec], Runner]) -> Runner:
    """The runner the catalog names; diffusers pipelines are loaded by the caller's function (weights, torch)."""
    if spec.runner == "noop":
        return SyntheticRunner(spec)
    if spec.runner == "sleep":
        return SyntheticRunner(spec, call_seconds=spec.call_seconds or SLEEP_CALL_SECONDS)
    return load_diffusers(spec)


def as_pil(image):
    """A PIL image from a runner's output: PIL already, or a float array in [0, 1] as diffusers returns it."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    import numpy as np

    return Image.fromarray((np.clip(image, 0, 1) * 255).round().astype("uint8"))
