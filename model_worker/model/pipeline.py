"""The diffusers runner: loads a model's pipeline once, warms it up, and runs batches of per-item prompts and seeds.

It runs either one pipeline call per batch (`scheduling: request`) or step by step (`scheduling: step`),
through the model family's denoiser (`model_worker/model/families`): each image gets its own scheduler instance,
generator and guidance, and any set of images of one latent size shares one model call per step with
per-sample timesteps, whatever their step counts, strengths and starting points; the same image as alone,
up to float rounding.

On CUDA it runs in the family's dtype (fp16 for the UNet families, bf16 for FLUX) with PyTorch's SDPA
attention. A model with a catalog `compile:` mode (or any, with `MAAS_TORCH_COMPILE=1`) has its denoising model
compiled in that mode and batches padded to fixed bucket sizes so shapes stay static (`compiled.py`). Adapters are diffusers' own LoRA layers (`lora.py`); a compiled
model's adapter slots, and its IP-Adapter slots (`controls/ip_adapters.py`), are made before it is compiled and traced
by the warm-up, so no request compiles.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from contract.messages import GenerationParameters
from contract.model_spec import ModelSpec
from contract.step_cache import running_step_cache
from contract.step_limits import steps_problem
from model_worker.adapters.lora import LoraSets, Slots
from model_worker.controls.controlnets import pipeline_call
from model_worker.model.attention import without_attention_introspection
from model_worker.model.compiled import (
    DEFAULT_COMPILE_MODE,
    CompileCache,
    batch_buckets,
    compile_cache_key,
    graphs_compiled,
    pad_to_bucket,
)
from model_worker.model.device_memory import check_device_memory
from model_worker.model.families import denoiser_class
from model_worker.model.quantization import check_device, pipeline_quantization
from model_worker.model.runners import GenerationItem, RunningItem, StepCallback

log = logging.getLogger(__name__)

__all__ = ["CompileCache", "DiffusionRunner", "batch_buckets", "compile_cache_key", "graphs_compiled", "pad_to_bucket"]


class DiffusionRunner:
    def __init__(
        self,
        spec: ModelSpec,
        weights_dir: Path,
        torch_threads: int = 0,
        compile_unet: bool = False,
        compile_cache: CompileCache | None = None,
        compile_backend: str | None = None,
        share: DiffusionRunner | None = None,
        compile_mode: str | None = None,
    ) -> None:
        """`compile_unet`: compile the denoiser, in `compile_mode` (torch.compile's; None: the catalog's `compile`,
        or `compiled.DEFAULT_COMPILE_MODE`). `compile_backend`: None compiles with inductor on CUDA only; a named
        torch.compile backend (the tests' `eager`, or `inductor` to compile on a CPU) compiles with it on any
        device. `share`: a runner loaded from the same weights (another pipeline class of the family) with the same
        `loaded_components`: this one is built from its components, not loaded again, and uses its adapter sets
        (the LoRA layers are in the shared components)."""
        import diffusers
        import torch

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.spec = spec
        self.weights_dir = weights_dir
        self._torch = torch
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        self.accelerator = torch.cuda.get_device_name(0) if self._device == "cuda" else "cpu"
        # `scheduling: request`: the steps the last call's step cache skipped, per image; None without one.
        self.steps_skipped: int | None = None
        dtype = getattr(torch, spec.family.gpu_dtype) if self._device == "cuda" else torch.float32
        if share is not None and share.spec.loaded_components != spec.loaded_components:
            raise ValueError(
                f"{spec.queue} cannot share {share.spec.queue}'s components: they differ in weights, family, "
                "quantization, `without:` or adapter layers"
            )
        check_device_memory(spec, torch, weights_dir, shared=share is not None)
        started = time.perf_counter()
        pipeline_class = getattr(diffusers, spec.pipeline)
        denoiser = denoiser_class(spec)
        if share is not None:
            shared = share._pipeline.components
            extra = {key: value for key, value in denoiser.load_kwargs(spec).items() if key not in shared}
            self._pipeline = pipeline_class(**shared, **extra)
        else:
            load_kwargs = denoiser.load_kwargs(spec)
            if spec.quantization is not None:  # quantized while loading; refused first where the device cannot run it
                check_device(spec.name, spec.quantization, self._device)
                load_kwargs["quantization_config"] = pipeline_quantization(
                    spec.name, spec.quantization, weights_dir, spec.without
                )
                # Quantized on the device it runs on (on a GPU, no full-precision copy in host memory).
                load_kwargs["device_map"] = self._device
            self._pipeline = pipeline_class.from_pretrained(
                weights_dir, torch_dtype=dtype, use_safetensors=True, **load_kwargs
            ).to(self._device)
        self._pipeline.set_progress_bar_config(disable=True)
        without_attention_introspection(self._pipeline)
        self._pipeline.scheduler = configured_scheduler(spec, self._pipeline.scheduler)
        self._denoiser = denoiser(spec, self._pipeline, self._device)
        self._denoiser.check_loaded()
        if self._device == "cuda":
            # One image per VAE call (diffusers' own slicing): a batch's decode would hold every image's full-size
            # feature maps at once, and the memory plan counts one (contract/memory_plan.py).
            self._pipeline.vae.enable_slicing()
        if spec.scheduling == "step":
            self._denoiser.check_steppable()
        # Compiled shapes must be static: batches are padded up to the next bucket.
        self._compiled = compile_unet and (self._device == "cuda" or compile_backend is not None)
        self._compile_cache = compile_cache
        self.compile_mode = (compile_mode or spec.compile or DEFAULT_COMPILE_MODE) if self._compiled else None
        if compile_unet and not self._compiled:
            log.warning("%s: compiling needs a CUDA device (none here): running eagerly", spec.name)
        # Adapters go through diffusers' LoRA layers; a compiled model's through hotswap slots, made before compiling.
        components = self._denoiser.lora_components()
        self._lora = share._lora if share is not None else None
        policy = spec.adapters
        if components and policy is not None and self._lora is None:
            slots = Slots(policy.max_adapters_per_request, policy.max_rank, self._denoiser.model_attribute)
            self._lora = LoraSets(self._pipeline, components, policy.device_cache, slots if self._compiled else None)
        if self._compiled:
            if self._compile_cache is not None:
                self._compile_cache.load()
            self._denoiser.compile_backend = compile_backend
            self._denoiser.compile_mode = self.compile_mode
            if share is not None:  # the shared model's IP-Adapter slots, made by the runner it was loaded by
                self._denoiser._ip_adapters = share._denoiser._ip_adapters
            self._denoiser.compile()
        log.info(
            "loaded %s (%s) from %s on %s in %.2fs",
            spec.pipeline,
            spec.family.name,
            weights_dir,
            self.accelerator,
            time.perf_counter() - started,
        )

    def _use_adapters(self, items: list[GenerationItem]) -> None:
        """Applies the call's adapter set (one per call: the batch key) before the text encoder or model runs."""
        adapters = items[0].adapters if items else None
        weights = adapters.weights() if adapters is not None else []
        if self._lora is None:
            if weights:
                raise ValueError(f"{self.spec.name}: adapters are not served for {self.spec.family.name} models")
            return
        self._lora.activate(weights)

    def warm_up(self) -> None:
        """Runs every batch size it will serve on a GPU (one small call on CPU), so no request pays for it; a compiled
        model every batch bucket at the default size, with its adapter slots (at scale 0): no request compiles."""
        from PIL import Image

        started = time.perf_counter()
        multiple = self.spec.family.size_multiple
        defaults = self.spec.defaults
        if self._compiled:
            sizes, width, height = batch_buckets(self.spec.max_batch_size), defaults.width, defaults.height
        elif self._device == "cuda":
            sizes, width, height = [1, self.spec.max_batch_size], defaults.width, defaults.height
        else:
            sizes, width, height = [1], 4 * multiple, 4 * multiple
        steps = 2
        image = Image.new("RGB", (width, height)) if self.spec.needs_image else None
        mask = Image.new("L", (width, height), 255) if self.spec.takes_mask else None
        params = GenerationParameters(
            seed=0, num_inference_steps=steps, guidance_scale=self.spec.defaults.guidance_scale, width=width,
            height=height, strength=1.0,
        )  # fmt: skip
        for size in sizes:
            items = [GenerationItem(prompt="warm-up", seed=i, image=image, mask=mask) for i in range(size)]
            if self.spec.scheduling == "step":
                running = self.start_items(items, params)
                while not all(r.finished for r in running):
                    self.denoise_step(running)
                self.decode(running)
            else:
                self.generate(items, params, lambda step, total: None)
        if self._compiled and self.spec.scheduling == "step" and self._denoiser.traces_control_calls():
            # The calls ControlNets make, traced at every bucket with zero residuals: the first ControlNet compiles
            # nothing, and calls without one keep their own graph (no residuals to hold).
            self._denoiser.tracing_controls = True
            try:
                for size in sizes:
                    items = [GenerationItem(prompt="warm-up", seed=i, image=image, mask=mask) for i in range(size)]
                    running = self.start_items(items, params)
                    self.denoise_step(running)
            finally:
                self._denoiser.tracing_controls = False
        if self._compiled and self._compile_cache is not None:
            self._compile_cache.save()
        log.info(
            "warm-up at batch sizes %s took %.2fs%s", sizes, time.perf_counter() - started,
            f" (compiled, {self.compile_mode}: {graphs_compiled()} graphs)" if self._compiled else "",
        )  # fmt: skip

    def generate(self, items: list[GenerationItem], params: GenerationParameters, on_step: StepCallback) -> list:
        """One pipeline call for all items; one generator per item, so each gets the image it would get alone.

        Returns float arrays (height x width x 3, in [0, 1]) as diffusers' `output_type="np"` gives them.
        """
        torch = self._torch
        count = len(items)
        if self._compiled:
            items = pad_to_bucket(items, self.spec.max_batch_size)
        self._use_adapters(items)
        kwargs = {
            "prompt": [item.prompt for item in items],
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "generator": [torch.Generator(device="cpu").manual_seed(item.seed) for item in items],
            "callback_on_step_end": _step_callback(on_step, self._denoiser.requested_steps(params)),
            # Arrays, not PIL images: the conversion and PNG encoding happen in the finisher, off this thread. A
            # flow's stage that hands its latents on gets them undecoded.
            "output_type": "latent" if items[0].latent_output else "np",
            **self._denoiser.call_kwargs(items, params),
        }
        # Batch lines never share a call with interactive requests (model_worker/serving/device.py): one threshold.
        step_cache = running_step_cache(self.spec.step_cache, params.step_cache, items[0].batch_line)
        with torch.inference_mode(), self._denoiser.call_step_cache(step_cache) as skipped:
            # Requests with other ControlNets (or none) in one batch: diffusers' pipelines, one per control set.
            images = pipeline_call(self._pipeline, items, kwargs)
        # Per image: the call decided once for all of them (the reply counts its images').
        self.steps_skipped = skipped() if step_cache is not None else None
        return images[:count]

    def start_items(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        """Prepares a request's images for stepping: the family's encoding, latents and per-image schedulers."""
        self._use_adapters(items)
        return self._denoiser.start(items, params)

    def denoise_step(self, running: list[RunningItem]) -> None:
        """One model call over every item (per-sample timesteps and guidance), then each item's own step."""
        self._use_adapters([r.item for r in running])
        self._denoiser.denoise(running)

    def decode(self, running: list[RunningItem]) -> list:
        """One VAE call for the finished items; float arrays as `output_type="np"` gives them."""
        return self._denoiser.decode(running)


def configured_scheduler(spec: ModelSpec, scheduler):
    """The pipeline's scheduler as the catalog configures it: its class (`scheduler`, from the saved config) and
    `scheduler_config`'s overrides (a distilled model's `timestep_spacing: trailing`); unchanged when it sets none.
    Refused when the catalog's step limit is more than it can run (contract/step_limits.py)."""
    import diffusers

    overrides = spec.scheduler_config.overrides()
    name = spec.scheduler or type(scheduler).__name__
    if name != type(scheduler).__name__ or overrides:
        scheduler = getattr(diffusers, name).from_config(scheduler.config, **overrides)
    # The catalog checked its limit against the family's published scheduler; these weights may have saved another.
    if (problem := steps_problem(spec.name, spec.limits.max_inference_steps, name, scheduler.config)) is not None:
        raise ValueError(problem)
    return scheduler


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
