"""The flow-matching transformer families: FLUX.1 [dev] and [schnell] (`FluxTransformer2DModel`), FLUX.1 Kontext's
edits (its input image's tokens beside the generated ones), and SD 3.5 (`SD3Transformer2DModel`, an MMDiT with
classifier-free guidance).

FLUX: latents are packed 2x2 into tokens; the schedule's shift `mu` depends on the token count, so each image gets
its own `FlowMatchEulerDiscreteScheduler` with its own sigmas, and images of different sizes never share a
call (the pool's batch key has the size). One transformer call takes `timestep / 1000` and, for [dev], the
embedded guidance as per-sample [B] tensors; the text and image position ids have no batch axis and are the
same for every image of one size, so they are shared. Image-to-image starts each image at its own step of its
own schedule (the pipeline's `get_timesteps` on the image's scheduler) from the noised input's latents.

SD 3.5: unpacked latents, `timestep` as the scheduler gives it, classifier-free guidance and the shared call as
the UNet families have them (`base.GuidedDenoiser`), and the T5 encoder optional (`without: [text_encoder_3]`).
Both decode their latents alike (`from_flow_latents`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from contract.messages import GenerationParameters
from contract.step_cache import StepCache
from model_worker.model.families.base import Denoiser, GuidedDenoiser, conditions, pad_rows
from model_worker.model.families.first_block import (
    diffusers_first_block,
    diffusers_first_block_sd3,
    first_block_flux,
    first_block_sd3,
    flux_parts,
    sd3_parts,
)
from model_worker.model.families.linear_steps import host_values
from model_worker.model.families.taylorseer import diffusers_taylorseer, taylorseer_rows
from model_worker.model.runners import GenerationItem, RunningItem
from model_worker.model.step_cache import caching, forget, row_cache

# The T5 prompt length, in both schedulings: FLUX.1 [dev]'s 512 (its pipeline's default); [schnell] was distilled
# with 256, the length its reference code and model card use (512 would double the text tokens of every step);
# SD 3.5's pipeline default of 256.
FLUX_DEV_MAX_SEQUENCE_LENGTH = 512
FLUX_SCHNELL_MAX_SEQUENCE_LENGTH = 256
SD3_MAX_SEQUENCE_LENGTH = 256


class FluxDenoiser(Denoiser):
    model_attribute = "transformer"

    @property
    def guidance_embedded(self) -> bool:
        return bool(self.pipeline.transformer.config.guidance_embeds)

    @property
    def max_sequence_length(self) -> int:
        return FLUX_DEV_MAX_SEQUENCE_LENGTH if self.guidance_embedded else FLUX_SCHNELL_MAX_SEQUENCE_LENGTH

    def check_loaded(self) -> None:
        """The catalog's guidance mode must be the model's: [dev] embeds guidance, [schnell] takes none."""
        mode = self.spec.guidance_mode
        if (mode == "embedded") != self.guidance_embedded:
            actual = "embedded" if self.guidance_embedded else "none"
            raise ValueError(
                f"{self.spec.name}: the catalog says guidance {mode!r} but the transformer's is {actual!r} "
                f"(set `guidance: {actual}` in the catalog entry)"
            )

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs = {"width": params.width, "height": params.height, "max_sequence_length": self.max_sequence_length}
        if self.spec.needs_image:
            kwargs["image"], kwargs["strength"] = [item.image for item in items], params.strength
        return kwargs

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        with torch.inference_mode():
            prompt_embeds, pooled, text_ids = pipe.encode_prompt(
                prompt=[item.prompt for item in items], prompt_2=None, device=device, num_images_per_prompt=1,
                max_sequence_length=self.max_sequence_length,
            )  # fmt: skip
            channels = pipe.transformer.config.in_channels // 4
            steps = params.num_inference_steps
            requested = self.requested_steps(params)
            config = pipe.scheduler.config
            running = []
            for index, item in enumerate(items):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                tokens = (params.height // pipe.vae_scale_factor // 2) * (params.width // pipe.vae_scale_factor // 2)
                sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
                mu = calculate_shift(
                    tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                    config.get("base_shift", 0.5), config.get("max_shift", 1.15),
                )  # fmt: skip
                scheduler = self.new_scheduler()
                timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
                if self.spec.needs_image:
                    if item.controls:  # FluxControlNetImg2ImgPipeline draws in another order: not served yet
                        raise ValueError(f"{self.spec.name}: FLUX.1 image-to-image takes no ControlNets yet")
                    with self.using(scheduler):
                        timesteps, _ = pipe.get_timesteps(steps, params.strength, device)
                        image = pipe.image_processor.preprocess(item.image, height=params.height, width=params.width)
                        latents, image_ids = pipe.prepare_latents(
                            image.to(torch.float32), timesteps[:1].repeat(1), 1, channels, params.height,
                            params.width, prompt_embeds.dtype, device, [generator],
                        )  # fmt: skip
                    controlnets, image_prompts = [], []
                else:
                    # FluxControlNetPipeline's order: each ControlNet's image drawn from the generator, then the noise.
                    controlnets = self.controlnets.prepare(item, generator, params.height, params.width,
                                                           prompt_embeds.dtype) if item.controls else []  # fmt: skip
                    latents, image_ids = pipe.prepare_latents(
                        1, channels, params.height, params.width, prompt_embeds.dtype, device, [generator]
                    )
                    scheduler.set_begin_index(0)
                    # Its IP-Adapters' image embeddings (FluxPipeline's `encode_image`; no negative rows).
                    image_prompts = self.ip_adapters.prepare(item, False, prompt_embeds.dtype) if item.controls else []
                state = self.row_state(
                    scheduler, timesteps, latents, image_ids, text_ids, prompt_embeds, pooled, index, params,
                    (params.height, params.width), controlnets=controlnets, image_prompts=image_prompts,
                    mu=mu, step_cache=row_cache(self.spec.step_cache, params.step_cache, item.batch_line),
                )  # fmt: skip
                running.append(RunningItem(item, total=len(timesteps), requested=requested, state=state))
        return self.prepared(running)

    @staticmethod
    def row_state(scheduler, timesteps, latents, image_ids, text_ids, prompt_embeds, pooled, index: int, params,
                  size: tuple[int, int], **extra) -> dict:  # fmt: skip
        """One image's row of a FLUX call: its scheduler, latents, position ids, prompt, guidance and size; `extra`:
        what a member of the family adds (Kontext's reference tokens, Fill's mask, the step cache)."""
        return {
            "scheduler": scheduler,
            "timesteps": timesteps,
            "latents": latents,
            "image_ids": image_ids,
            "text_ids": text_ids,
            "context": prompt_embeds[index : index + 1],
            "pooled": pooled[index : index + 1],
            "guidance": params.guidance_scale,
            "size": size,
            "step_kwargs": {},  # the pipeline passes nothing else to the flow-matching step
            **extra,
        }

    def denoise(self, running: list[RunningItem]) -> None:
        torch = self._torch
        self.one_size(running)
        with torch.inference_mode():
            latents = torch.cat([self.model_tokens(r) for r in running])
            timestep = torch.cat(
                [r.state["timesteps"][r.done].expand(1).to(latents.dtype) for r in running]
            )  # fmt: skip
            context = torch.cat([r.state["context"] for r in running])
            pooled = torch.cat([r.state["pooled"] for r in running])
            guidance = None
            if self.guidance_embedded:
                guidance = host_values([r.state["guidance"] for r in running], latents.device)
            rows = latents.shape[0]
            size = self.padded_rows(rows)
            if size != rows:
                latents, timestep, context, pooled, guidance = (
                    pad_rows(tensor, size) for tensor in (latents, timestep, context, pooled, guidance)
                )
            first = running[0].state
            inputs = {
                "hidden_states": latents, "timestep": timestep / 1000, "guidance": guidance,
                "pooled_projections": pooled, "encoder_hidden_states": context, "txt_ids": first["text_ids"],
                "img_ids": first["image_ids"],
            }  # fmt: skip
            controls = self.control_residuals(running, inputs)
            slotted = self._ip_adapters is not None and self._ip_adapters.slots is not None
            if not slotted and (self._ip_adapters is not None or any(r.state.get("image_prompts") for r in running)):
                # Image prompts (model_worker/controls/ip_adapters.py); none: the base processors back.
                controls.update(self.ip_adapters.transformer_kwargs(running, latents.shape[0], latents.dtype))
            if slotted:  # a compiled transformer's IP-Adapter slots take every call's image prompts, zeros when none
                from model_worker.controls.ip_adapters import run_passes

                passes = self._ip_adapters.transformer_passes(running, latents.shape[0], latents.dtype)
                output = run_passes(passes, lambda prompts: self.pipeline.transformer(**inputs, **controls, **prompts,
                                                                                      return_dict=False)[0])  # fmt: skip
            elif controls:  # a call with control runs in full; no image's step cache reuses what predates it
                forget(running)
                output = self.pipeline.transformer(**inputs, **controls, return_dict=False)[0]
            elif caching(running) and self.spec.step_cache.kind == "taylorseer":  # each image runs or predicts
                output = taylorseer_rows(running, self.gathered_call(inputs), self.forced_skips, self.tail_calls)
            elif caching(running):  # each image's first-block cache decides whether it runs the remaining blocks
                output = first_block_flux(self.cached_parts(), running, self.forced_skips, self.tail_calls,
                                          self.padded_rows, **inputs)  # fmt: skip
            else:
                output = self.pipeline.transformer(**inputs, return_dict=False)[0]
            predicted = output[:rows, : first["latents"].shape[1]]
            self.step_items(running, [predicted[i : i + 1] for i in range(rows)])

    def traces_control_calls(self) -> bool:
        return self.spec.controls is not None and self.spec.step_cache is None

    def control_residuals(self, running: list[RunningItem], inputs: dict) -> dict:
        """The ControlNets' residuals for the call's rows (model_worker/controls/flux_controlnets.py); {} (the base
        model's call) when no row has one. A compiled model that takes ControlNets gets one residual per block,
        always the same graph's inputs, which its warm-up traces with zeros (`tracing_controls`), so the first
        ControlNet compiles nothing. Not with a step cache, whose calls go without residuals."""
        compiled = self._compiled_buckets is not None and self.traces_control_calls()
        if not any(r.state.get("controlnets") for r in running):
            if compiled and self.tracing_controls:
                from model_worker.controls.flux_controlnets import zero_flux_residuals

                return zero_flux_residuals(self.pipeline.transformer, inputs["hidden_states"])
            return {}
        guidance = host_values([r.state["guidance"] for r in running], inputs["hidden_states"].device)
        return self.controlnets.flux_residuals(running, inputs, guidance, every_block=compiled)

    def gathered_call(self, inputs: dict) -> Callable:
        """The transformer over some rows of a call's `inputs` (TaylorSeer's full rows), gathered and padded to a
        compiled bucket; over all of them as they are (None)."""
        shared = ("txt_ids", "img_ids")  # position ids: no batch axis

        def call(index: list[int] | None):
            if index is None:
                return self.pipeline.transformer(**inputs, return_dict=False)[0]
            size, rows = self.padded_rows(len(index)), self._torch.tensor(index)
            gathered = {key: value if key in shared or value is None else pad_rows(value[rows.to(value.device)], size)
                        for key, value in inputs.items()}  # fmt: skip
            return self.pipeline.transformer(**gathered, return_dict=False)[0][: len(index)]

        return call

    @property
    def ip_adapters(self):
        """Made on first use, as `controlnets` is."""
        if self._ip_adapters is None:
            from model_worker.controls.ip_adapters import IPAdapterRows

            self._ip_adapters = IPAdapterRows(self.pipeline)
        return self._ip_adapters

    @property
    def controlnets(self):
        """Made on first use: a model whose requests name no ControlNet never builds it."""
        if getattr(self, "_controlnets", None) is None:
            from model_worker.controls.flux_controlnets import FluxControlNetRows

            self._controlnets = FluxControlNetRows(self.pipeline)
        return self._controlnets

    def model_tokens(self, r: RunningItem):
        """An image's row of the transformer's input: its packed latents, and after them the tokens its family adds
        per image (Kontext's reference image); the prediction is read for the latents' tokens only."""
        return r.state["latents"]

    def compile(self) -> None:
        """The model compiled, and its first-block cache's parts too (a model with one): the full rows' count then
        changes which compiled bucket runs, never what is compiled."""
        super().compile()
        if self.spec.step_cache is not None and self.spec.step_cache.kind == "first_block":
            self._cached_parts = flux_parts(self.model, (self.compile_mode, self.compile_backend))

    def cached_parts(self) -> tuple:
        """The first-block cache's parts of the transformer (families/first_block.py), eager until compiled."""
        if getattr(self, "_cached_parts", None) is None:
            self._cached_parts = flux_parts(self.model)
        return self._cached_parts

    @contextmanager
    def call_step_cache(self, settings: StepCache | None) -> Iterator[Callable[[], int]]:
        """diffusers' First-Block-Cache or TaylorSeer hook, fresh for this call (families/first_block.py,
        families/taylorseer.py)."""
        if settings is None:
            yield lambda: 0
            return
        if settings.kind == "taylorseer":
            hook = diffusers_taylorseer(self.model, settings.interval, settings.warmup_steps, settings.max_order or 1)
        else:
            hook = diffusers_first_block(self.model, settings.threshold)
        with hook as counts:
            yield lambda: counts.skipped

    def decode_latents(self, latents, running: list[RunningItem]):
        pipe = self.pipeline
        height, width = running[0].state["size"]
        return from_flow_latents(pipe.vae, pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor))


class FluxKontextDenoiser(FluxDenoiser):
    """FLUX.1 Kontext (`FluxKontextPipeline`, task `edit`): the instruction is the prompt, and the input image's packed
    latents join the sequence after the generated ones, as tokens with their own position ids (first axis 1), so
    each row of a shared call carries its own image. The image comes resized to the request's size (at intake), so
    its tokens are as many as the output's (the sequence doubles: the memory plan counts it) and every image of one
    size has the same position ids; the pipeline is called with `max_area` the request's area and no auto-resize,
    so its output and its reference are that size too."""

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        return {
            "width": params.width, "height": params.height, "max_area": params.width * params.height,
            "max_sequence_length": self.max_sequence_length, "image": [item.image for item in items],
            "_auto_resize": False,
        }  # fmt: skip

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux_kontext import calculate_shift, retrieve_timesteps

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        height, width, steps = params.height, params.width, params.num_inference_steps
        with torch.inference_mode():
            prompt_embeds, pooled, text_ids = pipe.encode_prompt(
                prompt=[item.prompt for item in items], prompt_2=None, device=device, num_images_per_prompt=1,
                max_sequence_length=self.max_sequence_length,
            )  # fmt: skip
            channels = pipe.transformer.config.in_channels // 4
            config = pipe.scheduler.config
            running = []
            for index, item in enumerate(items):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                # As the pipeline prepares its image without auto-resize: resized (a no-op at the request's size),
                # then normalised; its latents are the VAE's mode, so the generator draws only the noise.
                image = pipe.image_processor.resize(item.image, height, width)
                image = pipe.image_processor.preprocess(image, height, width)
                latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
                    image, 1, channels, height, width, prompt_embeds.dtype, device, [generator]
                )  # fmt: skip
                mu = calculate_shift(
                    latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                    config.get("base_shift", 0.5), config.get("max_shift", 1.15),
                )  # fmt: skip
                scheduler = self.new_scheduler()
                sigmas = np.linspace(1.0, 1 / steps, steps)
                timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
                scheduler.set_begin_index(0)
                state = self.row_state(
                    scheduler, timesteps, latents, torch.cat([latent_ids, image_ids], dim=0), text_ids, prompt_embeds,
                    pooled, index, params, (height, width), reference=image_latents,
                    step_cache=row_cache(self.spec.step_cache, params.step_cache, item.batch_line),
                )  # fmt: skip
                running.append(RunningItem(item, total=len(timesteps), requested=steps, state=state))
        return self.prepared(running)

    def model_tokens(self, r: RunningItem):
        return self._torch.cat([r.state["latents"], r.state["reference"]], dim=1)


class FluxFillDenoiser(FluxDenoiser):
    """FLUX.1 Fill (`FluxFillPipeline`, task `inpaint`): each image's tokens carry, beside its packed latents as
    channels, its masked image's packed latents and its mask (8x8 pixels a latent pixel, packed 2x2), so inpaint
    requests with other images, masks and step counts share a transformer call. Latents, masked-image latents and
    mask are made by the pipeline's own helpers on each image's own generator, in the pipeline's order (the image's
    latents, the noise, then the masked image's latents), at its strength's step of its own schedule."""

    def check_loaded(self) -> None:
        super().check_loaded()
        config = self.pipeline.transformer.config
        if config.in_channels == (config.out_channels or config.in_channels):
            raise ValueError(
                f"{self.spec.name}: an inpaint FLUX.1 model needs FLUX.1 Fill's transformer (its input channels take the "
                f"masked image and the mask beside the latents), not one of {config.in_channels} in and out"
            )

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        return {
            "width": params.width, "height": params.height, "max_sequence_length": self.max_sequence_length,
            "image": [item.image for item in items], "mask_image": [item.mask for item in items],
            "strength": 1.0 if params.strength is None else params.strength,
        }  # fmt: skip

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux_fill import calculate_shift, retrieve_timesteps

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        height, width, steps = params.height, params.width, params.num_inference_steps
        strength = 1.0 if params.strength is None else params.strength
        requested = self.requested_steps(params)
        with torch.inference_mode():
            prompt_embeds, pooled, text_ids = pipe.encode_prompt(
                prompt=[item.prompt for item in items], prompt_2=None, device=device, num_images_per_prompt=1,
                max_sequence_length=self.max_sequence_length,
            )  # fmt: skip
            channels, dtype = pipe.vae.config.latent_channels, prompt_embeds.dtype
            config = pipe.scheduler.config
            tokens = (height // pipe.vae_scale_factor // 2) * (width // pipe.vae_scale_factor // 2)
            mu = calculate_shift(
                tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.15),
            )  # fmt: skip
            running = []
            for index, item in enumerate(items):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                scheduler = self.new_scheduler()
                retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
                with self.using(scheduler):  # the pipeline's own helpers, on this image's scheduler
                    timesteps, _ = pipe.get_timesteps(steps, strength, device)
                    image = pipe.image_processor.preprocess(item.image, height=height, width=width)
                    image = image.to(dtype=torch.float32)
                    latents, image_ids = pipe.prepare_latents(
                        image, timesteps[:1].repeat(1), 1, channels, height, width, dtype, device, [generator]
                    )
                    mask = pipe.mask_processor.preprocess(item.mask, height=height, width=width)
                    masked_image = (image * (1 - mask)).to(device=device, dtype=dtype)
                    mask, masked_latents = pipe.prepare_mask_latents(
                        mask, masked_image, 1, channels, 1, height, width, dtype, device, [generator]
                    )
                state = self.row_state(
                    scheduler, timesteps, latents, image_ids, text_ids, prompt_embeds, pooled, index, params,
                    (height, width), fill=torch.cat((masked_latents, mask), dim=-1),
                    step_cache=row_cache(self.spec.step_cache, params.step_cache, item.batch_line),
                )  # fmt: skip
                running.append(RunningItem(item, total=len(timesteps), requested=requested, state=state))
        return self.prepared(running)

    def model_tokens(self, r: RunningItem):
        return self._torch.cat((r.state["latents"], r.state["fill"]), dim=2)


class SD3Denoiser(GuidedDenoiser):
    """SD 3.5: two CLIPs and T5 (or zeros in its place), classifier-free guidance with negative prompts."""

    model_attribute = "transformer"

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "width": params.width, "height": params.height, "max_sequence_length": SD3_MAX_SEQUENCE_LENGTH,
        }  # fmt: skip
        if any(item.negative_prompt for item in items):
            kwargs["negative_prompt"] = [item.negative_prompt or "" for item in items]
        return kwargs

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        guided = params.guidance_scale > 1
        requested = self.requested_steps(params)
        config = pipe.scheduler.config
        with torch.inference_mode():
            prompt_embeds, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
                prompt=[item.prompt for item in items], prompt_2=None, prompt_3=None, device=device,
                num_images_per_prompt=1, do_classifier_free_guidance=guided,
                negative_prompt=[item.negative_prompt or "" for item in items],
                max_sequence_length=SD3_MAX_SEQUENCE_LENGTH,
            )  # fmt: skip
            positive = {"context": prompt_embeds, "pooled": pooled}
            negative = {"context": negative_embeds, "pooled": negative_pooled} if guided else None
            running = []
            for item, condition in zip(items, conditions(positive, negative), strict=True):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                latents = pipe.prepare_latents(
                    1, pipe.transformer.config.in_channels, params.height, params.width, prompt_embeds.dtype, device,
                    [generator],
                )  # fmt: skip
                kwargs = {}
                if config.get("use_dynamic_shifting", None):
                    patch = pipe.transformer.config.patch_size
                    tokens = (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
                    kwargs["mu"] = calculate_shift(
                        tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                        config.get("base_shift", 0.5), config.get("max_shift", 1.16),
                    )  # fmt: skip
                scheduler = self.new_scheduler()
                timesteps, _ = retrieve_timesteps(scheduler, params.num_inference_steps, device, **kwargs)
                # Its control images' latents, after its noise as the pipeline prepares them (from a generator of
                # their own: sd3_controlnets.py).
                controlnets = self.controlnets.prepare(item, guided, params.height, params.width,
                                                       prompt_embeds.dtype) if item.controls else []  # fmt: skip
                state = {
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "condition": condition,
                    "controlnets": controlnets,
                    "guidance": params.guidance_scale if guided else None,
                    "size": (params.height, params.width),
                    "step_kwargs": {},
                    "step_cache": row_cache(self.spec.step_cache, params.step_cache, item.batch_line),
                }
                running.append(RunningItem(item, total=len(timesteps), requested=requested, state=state))
        return self.prepared(running)

    def call_model(self, sample, timestep, condition: dict, **controls):
        return self.pipeline.transformer(
            hidden_states=sample, timestep=timestep, encoder_hidden_states=condition["context"],
            pooled_projections=condition["pooled"], return_dict=False, **controls,
        )[0]  # fmt: skip

    def traces_control_calls(self) -> bool:
        return self.spec.controls is not None and self.spec.step_cache is None

    def control_residuals(self, running: list[RunningItem], inputs: list, sample, timestep, condition: dict) -> dict:
        """The ControlNets' residuals for the call's rows (model_worker/controls/sd3_controlnets.py); {} (the base
        model's call) when no row has one. A compiled model that takes ControlNets gets one residual per block, which
        its warm-up traces with zeros, as FLUX.1's does."""
        compiled = self._compiled_buckets is not None and self.traces_control_calls()
        if not any(r.state.get("controlnets") for r in running):
            if compiled and self.tracing_controls:
                from model_worker.controls.sd3_controlnets import zero_sd3_residuals

                return zero_sd3_residuals(self.pipeline.transformer, sample)
            return {}
        return self.controlnets.residuals(running, inputs, sample, timestep, condition, every_block=compiled)

    @property
    def controlnets(self):
        """Made on first use: a model whose requests name no ControlNet never builds it."""
        if getattr(self, "_controlnets", None) is None:
            from model_worker.controls.sd3_controlnets import SD3ControlNetRows

            self._controlnets = SD3ControlNetRows(self.pipeline)
        return self._controlnets

    def compile(self) -> None:
        """The model compiled, and its first-block cache's parts too (a model with one), as FLUX.1's: the full rows'
        count then changes which compiled bucket runs, never what is compiled."""
        super().compile()
        if self.spec.step_cache is not None:
            self._cached_parts = sd3_parts(self.model, (self.compile_mode, self.compile_backend))

    def cached_call(self, running: list[RunningItem], rows_per_image: list[int], sample, timestep, condition: dict):
        """First-Block-Cache per image (families/first_block.py), its parts eager until compiled; the full rows
        padded to a compiled bucket (two rows an image, as the call's)."""
        if getattr(self, "_cached_parts", None) is None:
            self._cached_parts = sd3_parts(self.model)
        return first_block_sd3(self._cached_parts, running, rows_per_image, self.forced_skips, self.tail_calls,
                               lambda rows: self.padded_rows(rows, rows_per_image=2), sample=sample,
                               timestep=timestep, context=condition["context"], pooled=condition["pooled"])  # fmt: skip

    @contextmanager
    def call_step_cache(self, settings: StepCache | None) -> Iterator[Callable[[], int]]:
        """diffusers' First-Block-Cache hooks, fresh for this call (families/first_block.py)."""
        if settings is None:
            yield lambda: 0
            return
        with diffusers_first_block_sd3(self.model, settings.threshold) as counts:
            yield lambda: counts.skipped

    def decode_latents(self, latents, running: list[RunningItem]):
        return from_flow_latents(self.pipeline.vae, latents)


def from_flow_latents(vae, latents):
    """The flow-matching families' VAE decode: latents unscaled and shifted back, as FLUX's and SD 3's pipelines do."""
    return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
