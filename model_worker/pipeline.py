"""The diffusers runner: loads a pipeline once, warms it up, and runs a batch of per-item prompts and seeds.

It runs either one pipeline call per batch (`scheduling: request`) or step by step (`scheduling: step`):
each image gets its own scheduler instance, generator and guidance scale, and any set of images of one
latent size shares one UNet call per step with a per-sample timestep tensor, whatever their step counts,
strengths and starting points; the same image as alone, up to float rounding.

On CUDA it runs fp16 with PyTorch's SDPA attention (diffusers' default processor on torch 2). With
`MAAS_TORCH_COMPILE=1` the UNet is compiled (fused QKV, channels-last) and batches are padded to fixed
bucket sizes so shapes stay static; the compile artifacts (PyTorch's mega-cache) are saved to the model
bucket next to the weights and loaded by the next pod, so it does not pay minutes of compilation.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from contract.catalog import STEPPABLE_SCHEDULERS, ModelSpec, steppable_error
from contract.messages import GenerationParameters
from model_worker.lora import LoraHooks
from model_worker.runners import GenerationItem, RunningItem, StepCallback

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
        self.weights_dir = weights_dir
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
        if spec.scheduler and type(self._pipeline.scheduler).__name__ != spec.scheduler:
            scheduler_class = getattr(diffusers, spec.scheduler)
            self._pipeline.scheduler = scheduler_class.from_config(self._pipeline.scheduler.config)
        if spec.scheduling == "step":
            _check_steppable(spec, self._pipeline)
        # Compiled shapes must be static: batches are padded up to the next bucket.
        self._compiled = compile_unet and self._device == "cuda"
        self._compile_cache = compile_cache
        if compile_unet and not self._compiled:
            log.warning("MAAS_TORCH_COMPILE is set but there is no CUDA device: running eagerly")
        if self._compiled:
            self._compile()
        components = {"unet": self._pipeline.unet, "text_encoder": self._pipeline.text_encoder}
        self._lora = LoraHooks(components, self._device, dtype, spec.adapters.device_cache if spec.adapters else 1)
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

    def _use_adapters(self, items: list[GenerationItem]) -> None:
        """Applies the call's adapter set (one per call: the batch key) before the text encoder or UNet runs."""
        adapters = items[0].adapters if items else None
        weights = adapters.weights() if adapters is not None else []
        if weights and self._compiled:
            raise ValueError("adapters are not served with MAAS_TORCH_COMPILE (their hooks would recompile the UNet)")
        self._lora.activate(weights)

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
            if self.spec.scheduling == "step":
                running = self.start_items(items, params)
                while not all(r.finished for r in running):
                    self.denoise_step(running)
                self.decode(running)
            else:
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
        self._use_adapters(items)
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

    def start_items(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        """Encodes the prompts (one text-encoder call) and makes each image's latents with its own generator and
        scheduler instance, exactly as the pipeline does for one image; img2img starts at its own timestep."""
        torch, pipe = self._torch, self._pipeline
        device = pipe._execution_device
        guided = params.guidance_scale > 1
        self._use_adapters(items)
        with torch.inference_mode():
            prompt_embeds, negative_embeds = pipe.encode_prompt(
                [item.prompt for item in items], device, 1, guided, [item.negative_prompt or "" for item in items]
            )
            running = []
            for index, item in enumerate(items):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
                scheduler.set_timesteps(params.num_inference_steps, device=device)
                timesteps = scheduler.timesteps
                dtype = prompt_embeds.dtype
                if self.needs_image:
                    timesteps, latents = self._image_latents(scheduler, item, params, generator, device, dtype)
                else:
                    shape = (
                        1,
                        pipe.unet.config.in_channels,
                        params.height // pipe.vae_scale_factor,
                        params.width // pipe.vae_scale_factor,
                    )
                    latents = _randn(shape, generator, device, dtype) * scheduler.init_noise_sigma
                embeddings = prompt_embeds[index : index + 1]
                if guided:
                    embeddings = torch.cat([negative_embeds[index : index + 1], embeddings])
                state = {
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "embeddings": embeddings,
                    "guidance": params.guidance_scale if guided else None,
                    "step_kwargs": _step_kwargs(scheduler, generator),
                }
                running.append(RunningItem(item, total=len(timesteps), state=state))
        return running

    def _image_latents(self, scheduler, item: GenerationItem, params: GenerationParameters, generator, device, dtype):
        """img2img's `get_timesteps` and `prepare_latents` for one image, on its own scheduler instance."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents

        pipe, steps = self._pipeline, params.num_inference_steps
        start = max(steps - min(int(steps * params.strength), steps), 0)
        timesteps = scheduler.timesteps[start * scheduler.order :]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start * scheduler.order)
        image = pipe.image_processor.preprocess(item.image).to(device=device, dtype=dtype)
        init = retrieve_latents(pipe.vae.encode(image), generator=generator) * pipe.vae.config.scaling_factor
        noise = _randn(init.shape, generator, device, dtype)
        return timesteps, scheduler.add_noise(init, noise, timesteps[:1].repeat(1))

    def denoise_step(self, running: list[RunningItem]) -> None:
        """One UNet call over every item (per-sample timesteps, per-sample guidance), then each item's own step."""
        torch, unet = self._torch, self._pipeline.unet
        inputs, timesteps, embeddings = [], [], []
        self._use_adapters([r.item for r in running])
        with torch.inference_mode():
            for r in running:
                t = r.state["timesteps"][r.done]
                latents = r.state["latents"]
                x = torch.cat([latents] * 2) if r.state["guidance"] is not None else latents
                inputs.append(r.state["scheduler"].scale_model_input(x, t))
                timesteps.append(t.reshape(1).to(torch.float32).repeat(x.shape[0]))
                embeddings.append(r.state["embeddings"])
            sample, timestep, context = (
                torch.cat(inputs),
                torch.cat(timesteps).to(inputs[0].device),
                torch.cat(embeddings),
            )
            rows = sample.shape[0]
            if self._compiled:  # static shapes: pad the rows up to a compiled bucket, drop the extra outputs
                size = 2 * next(b for b in batch_buckets(self.spec.max_batch_size) if 2 * b >= rows)
                sample, timestep, context = (_pad_rows(tensor, size) for tensor in (sample, timestep, context))
            predicted = unet(sample, timestep, encoder_hidden_states=context, return_dict=False)[0][:rows]
            offset = 0
            for r, x in zip(running, inputs, strict=True):
                noise = predicted[offset : offset + x.shape[0]]
                offset += x.shape[0]
                if r.state["guidance"] is not None:
                    uncond, text = noise.chunk(2)
                    noise = uncond + r.state["guidance"] * (text - uncond)
                try:
                    t = r.state["timesteps"][r.done]
                    step = r.state["scheduler"].step(
                        noise, t, r.state["latents"], **r.state["step_kwargs"], return_dict=False
                    )
                    r.state["latents"] = step[0]
                    r.done += 1
                except Exception as exc:  # noqa: BLE001 - this item fails alone; the others have stepped
                    r.failure = exc

    def decode(self, running: list[RunningItem]) -> list:
        """One VAE call for the finished items; float arrays as `output_type="np"` gives them."""
        torch, pipe = self._torch, self._pipeline
        with torch.inference_mode():
            latents = torch.cat([r.state["latents"] for r in running])
            images = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
            arrays = pipe.image_processor.postprocess(images, output_type="np", do_denormalize=[True] * len(running))
        for r in running:
            r.state.clear()  # the latents and scheduler are done with: free them now, not when the reply is sent
        return list(arrays)


def _randn(shape, generator, device, dtype):
    """diffusers' noise for one image from its own generator (a one-element list, as the pipeline gets it)."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=[generator], device=device, dtype=dtype)


def _step_kwargs(scheduler, generator) -> dict:
    """What the pipeline passes to `scheduler.step` besides the tensors (eta 0 for DDIM, the generator)."""
    accepted = inspect.signature(scheduler.step).parameters
    kwargs: dict = {}
    if "eta" in accepted:
        kwargs["eta"] = 0.0
    if "generator" in accepted:
        kwargs["generator"] = [generator]
    return kwargs


def _pad_rows(tensor, rows: int):
    """Repeats the last row up to `rows` (a compiled UNet's fixed batch)."""
    import torch

    if tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])])


def _check_steppable(spec: ModelSpec, pipeline) -> None:
    """Refuses `scheduling: step` for a pipeline whose scheduler or UNet cannot be stepped per item."""
    name = type(pipeline.scheduler).__name__
    if name not in STEPPABLE_SCHEDULERS:
        raise ValueError(steppable_error(spec.name, name))
    if pipeline.unet.config.time_cond_proj_dim is not None:
        raise ValueError(f"{spec.name}: scheduling: step does not support guidance-embedding UNets; use request")


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
