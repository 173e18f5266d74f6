"""The diffusers runner: loads a pipeline once, warms it up, and runs a batch of per-item prompts and seeds.

On CUDA it runs fp16 with PyTorch's SDPA attention (diffusers' default processor on torch 2). With
`MAAS_TORCH_COMPILE=1` the UNet is compiled (fused QKV, channels-last) and batches are padded to fixed
bucket sizes so shapes stay static; the compile artifacts (PyTorch's mega-cache) are saved to the model
bucket next to the weights and loaded by the next pod, so it does not pay minutes of compilation.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from contract.catalog import ModelSpec
from contract.messages import GenerationParameters
from model_worker.runners import GenerationItem, StepCallback

log = logging.getLogger(__name__)


def pad_to_bucket(items: list, max_batch_size: int) -> list:
    """Repeats the last item up to the next compiled batch size; the extra images are dropped after the call."""
    size = next(bucket for bucket in batch_buckets(max_batch_size) if bucket >= len(items))
    return items + [items[-1]] * (size - len(items))


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to the model's batch limit (and the limit itself): the compiled shapes."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch_size]


class DiffusionRunner:
    def __init__(
        self,
        spec: ModelSpec,
        weights_dir: Path,
        torch_threads: int = 0,
        compile_unet: bool = False,
        compile_cache: CompileCache | None = None,
    ) -> None:
        import diffusers
        import torch

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.spec = spec
        self._torch = torch
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        self.accelerator = torch.cuda.get_device_name(0) if self._device == "cuda" else "cpu"
        dtype = torch.float16 if self._device == "cuda" else torch.float32
        started = time.perf_counter()
        pipeline_class = getattr(diffusers, spec.pipeline)
        self._pipeline = pipeline_class.from_pretrained(
            weights_dir, torch_dtype=dtype, use_safetensors=True, safety_checker=None, requires_safety_checker=False
        ).to(self._device)
        self._pipeline.set_progress_bar_config(disable=True)
        # Compiled shapes must be static: batches are padded up to the next bucket.
        self._compiled = compile_unet and self._device == "cuda"
        self._compile_cache = compile_cache
        if compile_unet and not self._compiled:
            log.warning("MAAS_TORCH_COMPILE is set but there is no CUDA device: running eagerly")
        if self._compiled:
            self._compile()
        log.info(
            "loaded %s from %s on %s in %.2fs",
            spec.pipeline,
            weights_dir,
            self.accelerator,
            time.perf_counter() - started,
        )

    @property
    def needs_image(self) -> bool:
        return self.spec.task == "image-to-image"

    def _compile(self) -> None:
        if self._compile_cache is not None:
            self._compile_cache.load()
        self._pipeline.fuse_qkv_projections()
        self._pipeline.unet.to(memory_format=self._torch.channels_last)
        self._pipeline.unet = self._torch.compile(self._pipeline.unet, mode="max-autotune-no-cudagraphs", dynamic=False)

    def warm_up(self) -> None:
        """Runs every batch size it will serve on a GPU (one small call on CPU), so no request pays for it."""
        from PIL import Image

        started = time.perf_counter()
        if self._device == "cuda":
            defaults = self.spec.defaults
            sizes = batch_buckets(self.spec.max_batch_size) if self._compiled else [1, self.spec.max_batch_size]
            width, height, steps = defaults.width, defaults.height, 2
        else:
            sizes, width, height, steps = [1], 64, 64, 2
        image = Image.new("RGB", (width, height)) if self.needs_image else None
        params = GenerationParameters(
            seed=0, num_inference_steps=steps, guidance_scale=7.5, width=width, height=height, strength=1.0
        )
        for size in sizes:
            items = [GenerationItem(prompt="warm-up", seed=i, image=image) for i in range(size)]
            self.generate(items, params, lambda step, total: None)
        if self._compiled and self._compile_cache is not None:
            self._compile_cache.save()
        log.info("warm-up at batch sizes %s took %.2fs", sizes, time.perf_counter() - started)

    def generate(self, items: list[GenerationItem], params: GenerationParameters, on_step: StepCallback) -> list:
        """One pipeline call for all items; one generator per item, so each gets the image it would get alone.

        Returns float arrays (height x width x 3, in [0, 1]) as diffusers' `output_type="np"` gives them.
        """
        torch = self._torch
        count = len(items)
        if self._compiled:
            items = pad_to_bucket(items, self.spec.max_batch_size)
        kwargs = {
            "prompt": [item.prompt for item in items],
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "generator": [torch.Generator(device="cpu").manual_seed(item.seed) for item in items],
            "callback_on_step_end": _step_callback(on_step, requested_steps(params, self.needs_image)),
            # Arrays, not PIL images: the conversion and PNG encoding happen in the finisher, off this thread.
            "output_type": "np",
        }
        if any(item.negative_prompt for item in items):
            kwargs["negative_prompt"] = [item.negative_prompt or "" for item in items]
        if self.needs_image:
            kwargs["image"] = [item.image for item in items]  # decoded and resized off this thread, at intake
            kwargs["strength"] = params.strength
        else:
            kwargs["width"], kwargs["height"] = params.width, params.height
        with torch.inference_mode():
            output = self._pipeline(**kwargs)
        return list(output.images[:count])


def requested_steps(params: GenerationParameters, image_to_image: bool) -> int:
    """The denoising steps the client asked for: `num_inference_steps`, or its `strength` share for img2img
    (diffusers runs `int(steps x strength)` of them)."""
    steps = params.num_inference_steps
    if image_to_image and params.strength is not None:
        return max(1, min(int(steps * params.strength), steps))
    return steps


def _step_callback(on_step: StepCallback, requested: int) -> Callable:
    """Reports progress on the client's scale: `requested` steps, the last call reporting (requested, requested).

    A scheduler may run more steps than asked (PNDM adds one: 26 for 25); the pipeline's own count is known
    once its loop has started, and each of its steps is mapped onto the requested ones, rounding up, so
    the first reports 1 and the last reports `requested`."""

    def callback(pipeline, step: int, _timestep, callback_kwargs: dict) -> dict:
        actual = max(getattr(pipeline, "num_timesteps", None) or requested, step + 1)
        on_step(min(requested, math.ceil((step + 1) * requested / actual)), requested)
        return callback_kwargs

    return callback


class CompileCache:
    """PyTorch's saved compile artifacts, kept in the model bucket next to the weights they were built for."""

    def __init__(self, bucket, object_name: str) -> None:
        self._blob = bucket.blob(object_name)
        self._name = object_name

    def load(self) -> bool:
        import torch

        try:
            data = self._blob.download_as_bytes()
        except Exception as exc:  # noqa: BLE001 - a missing cache means compiling from scratch, not failing
            log.info("no compile cache at %s (%s): compiling from scratch", self._name, type(exc).__name__)
            return False
        torch.compiler.load_cache_artifacts(data)
        log.info("loaded %.1f MB of compile artifacts from %s", len(data) / 1e6, self._name)
        return True

    def save(self) -> None:
        import torch

        artifacts = torch.compiler.save_cache_artifacts()
        if not artifacts:
            return
        data, _info = artifacts
        try:
            self._blob.upload_from_string(data)
            log.info("saved %.1f MB of compile artifacts to %s", len(data) / 1e6, self._name)
        except Exception:  # noqa: BLE001 - the next pod compiles again; serving goes on
            log.warning("could not save compile artifacts to %s", self._name, exc_info=True)


def compile_cache_key(spec: ModelSpec) -> str:
    """Artifacts are only valid for the same torch build, GPU model and bucket shapes."""
    import torch

    device = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    buckets = "-".join(str(size) for size in batch_buckets(spec.max_batch_size))
    return f"torch-{torch.__version__}-{device}-{spec.defaults.width}x{spec.defaults.height}-b{buckets}"
