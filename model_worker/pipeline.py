"""Loads a diffusers pipeline once, warms it up, and turns a resolved request into PNG bytes."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

from contract.catalog import ModelSpec
from contract.messages import GenerationParameters

log = logging.getLogger(__name__)


class DiffusionRunner:
    def __init__(self, spec: ModelSpec, weights_dir: Path, torch_threads: int = 0) -> None:
        import diffusers
        import torch

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.spec = spec
        self._torch = torch
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.float16 if self._device == "cuda" else torch.float32
        started = time.perf_counter()
        pipeline_class = getattr(diffusers, spec.pipeline)
        self._pipeline = pipeline_class.from_pretrained(
            weights_dir, torch_dtype=dtype, use_safetensors=True, safety_checker=None, requires_safety_checker=False
        ).to(self._device)
        self._pipeline.set_progress_bar_config(disable=True)
        log.info(
            "loaded %s from %s on %s in %.2fs", spec.pipeline, weights_dir, self._device, time.perf_counter() - started
        )

    @property
    def needs_image(self) -> bool:
        return self.spec.task == "image-to-image"

    def warm_up(self) -> None:
        """One small generation, so the first real request does not pay for lazy initialisation."""
        from PIL import Image

        started = time.perf_counter()
        params = GenerationParameters(
            seed=0, num_inference_steps=2, guidance_scale=7.5, width=64, height=64, strength=1.0
        )
        image = Image.new("RGB", (64, 64)) if self.needs_image else None
        self.generate(["warm-up"], params, [image] if image else None)
        log.info("warm-up took %.2fs", time.perf_counter() - started)

    def generate(self, prompts: list[str], params: GenerationParameters, images: list | None = None) -> list[bytes]:
        """One forward pass for all prompts; image i uses seed `params.seed + i`, so a seed reproduces an image."""
        generators = [self._torch.Generator(device="cpu").manual_seed(params.seed + i) for i in range(len(prompts))]
        kwargs = {
            "prompt": prompts,
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "generator": generators,
        }
        if params.negative_prompt:
            kwargs["negative_prompt"] = [params.negative_prompt] * len(prompts)
        if self.needs_image:
            kwargs["image"] = [image.convert("RGB").resize((params.width, params.height)) for image in images or []]
            kwargs["strength"] = params.strength
        else:
            kwargs["width"], kwargs["height"] = params.width, params.height
        with self._torch.inference_mode():
            output = self._pipeline(**kwargs)
        return [_png_bytes(image) for image in output.images]


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
