"""The UNet families with classifier-free guidance: SD 1.5 (one CLIP) and SDXL (two CLIPs, pooled embeddings and
size conditioning through `added_cond_kwargs`, a VAE decoded in float32 when its config asks).

Guidance and the shared model call are `base.GuidedDenoiser`'s; latents, timesteps, image-to-image's start and
the scheduler step's extra arguments are the pipeline's own helpers, run on each image's own scheduler.
"""

from __future__ import annotations

from typing import Any

from contract.messages import GenerationParameters
from model_worker.controls.controlnets import ControlNetRows, zero_residuals
from model_worker.controls.ip_adapters import IPAdapterRows, run_passes
from model_worker.model.families.base import GuidedDenoiser, conditions
from model_worker.model.families.deep_cache import deep_cache_unet, unet_parts
from model_worker.model.runners import GenerationItem, RunningItem, is_latent
from model_worker.model.step_cache import row_cache


class UNetDenoiser(GuidedDenoiser):
    """SD 1.5: `unet(sample, t, encoder_hidden_states)`; its conditioning is the CLIP context alone."""

    model_attribute = "unet"

    extra_load_kwargs = {"safety_checker": None, "requires_safety_checker": False}

    def check_steppable(self) -> None:
        super().check_steppable()
        if self.pipeline.unet.config.time_cond_proj_dim is not None:
            raise ValueError(
                f"{self.spec.name}: scheduling: step does not support guidance-embedding UNets; use request"
            )

    def compile(self) -> None:
        """The UNet compiled, and its DeepCache parts too (a model with a step cache): the count of images running
        the deep path then changes which compiled bucket runs, never what is compiled."""
        self.pipeline.unet.to(memory_format=self._torch.channels_last)
        super().compile()
        if self.spec.step_cache is not None:
            self._deep_parts = unet_parts(self.model, (self.compile_mode, self.compile_backend))

    def deep_parts(self) -> tuple:
        """DeepCache's parts of the UNet (families/deep_cache.py), eager until compiled."""
        if getattr(self, "_deep_parts", None) is None:
            self._deep_parts = unet_parts(self.model)
        return self._deep_parts

    def padded_images_rows(self, rows: int) -> int:
        """The rows a compiled UNet runs for `rows` of images' rows (two an image, as the call's)."""
        return self.padded_rows(rows, rows_per_image=2)

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if any(item.negative_prompt for item in items):
            kwargs["negative_prompt"] = [item.negative_prompt or "" for item in items]
        first = items[0]
        if self.spec.needs_image:
            # Decoded and resized off this thread, at intake; a flow's latents stay one tensor on the device.
            images = [item.image for item in items]
            kwargs["image"] = self._torch.cat(images) if is_latent(first.image) else images
            kwargs["strength"] = params.strength
        else:
            kwargs["width"], kwargs["height"] = params.width, params.height
        if first.denoising_start is not None:
            kwargs["denoising_start"] = float(first.denoising_start)
        if first.denoising_end is not None:
            kwargs["denoising_end"] = float(first.denoising_end)
        return kwargs

    # --- the family's conditioning (SDXL overrides) --------------------------------------------------------

    def encode(self, items: list[GenerationItem], guided: bool, params: GenerationParameters) -> list[dict]:
        """Each image's conditioning tensors, rows in UNet order (negative first when guided)."""
        prompt_embeds, negative_embeds = self.pipeline.encode_prompt(
            [item.prompt for item in items], self.pipeline._execution_device, 1, guided,
            [item.negative_prompt or "" for item in items],
        )  # fmt: skip
        return conditions({"context": prompt_embeds}, {"context": negative_embeds} if guided else None)

    def call_model(self, sample, timestep, condition: dict, **controls):
        passes = controls.pop("image_prompt_passes", None)
        if passes is None:
            return self.unet_call(sample, timestep, condition, **controls)
        return run_passes(passes, lambda prompts: self.unet_call(sample, timestep, condition, **controls, **prompts))

    def unet_call(self, sample, timestep, condition: dict, **controls):
        """One UNet call over the rows (`controls`: ControlNet residuals, image prompts)."""
        return self.pipeline.unet(
            sample, timestep, encoder_hidden_states=condition["context"], return_dict=False, **controls
        )[0]

    def cached_call(self, running: list[RunningItem], rows_per_image: list[int], sample, timestep, condition: dict):
        return deep_cache_unet(self.deep_parts(), running, rows_per_image, self.forced_skips, self.tail_calls, sample,
                               timestep, condition["context"], padded=self.padded_images_rows)  # fmt: skip

    def control_residuals(self, running: list[RunningItem], inputs: list, sample, timestep, condition: dict) -> dict:
        # IP-Adapters first: their processors are in the UNet (or restored) before the call either way. A compiled
        # UNet's slots take every call's image prompts, zeros when it has none (the warm-up's graph).
        if self._ip_adapters is not None and self._ip_adapters.slots is not None:
            prompts = {"image_prompt_passes": self._ip_adapters.unet_passes(running, inputs, sample)}
        elif self._ip_adapters or any(r.state.get("image_prompts") for r in running):
            prompts = self.ip_adapters.call_kwargs(running, inputs, sample)
        else:
            prompts = {}
        if not any(r.state.get("controlnets") for r in running):
            # A compiled model is always called with residuals (zeros here): the graph ControlNets use, so the first
            # one compiles nothing. Not with a step cache, whose calls go without residuals (step_cache.py).
            if self._compiled_buckets is not None and self.spec.controls is not None and self.spec.step_cache is None:
                return {**zero_residuals(self.pipeline.unet, sample), **prompts}
            return prompts
        return {**self.controlnets.residuals(running, inputs, sample, timestep, condition), **prompts}

    def control_state(self, item: GenerationItem, guided: bool, params: GenerationParameters, dtype) -> dict:
        """An image's ControlNets (control images at the output's size) and image prompts, for its running state."""
        if item.controls is None:
            return {"controlnets": [], "image_prompts": []}
        return {
            "controlnets": self.controlnets.prepare(item, guided, params.height, params.width, dtype),
            "image_prompts": self.ip_adapters.prepare(item, guided, dtype),
        }

    @property
    def ip_adapters(self) -> IPAdapterRows:
        """Made on first use, as `controlnets` is."""
        if self._ip_adapters is None:
            self._ip_adapters = IPAdapterRows(self.pipeline)
        return self._ip_adapters

    @property
    def controlnets(self) -> ControlNetRows:
        """Made on first use: a model whose requests name no ControlNet never builds it."""
        if getattr(self, "_controlnets", None) is None:
            self._controlnets = ControlNetRows(self.pipeline)
        return self._controlnets

    def model_input(self, scheduler, sample, timestep):
        return scheduler.scale_model_input(sample, timestep)

    def decode_latents(self, latents, running: list[RunningItem]):
        return self.pipeline.vae.decode(latents / self.pipeline.vae.config.scaling_factor, return_dict=False)[0]

    # --- stepping ------------------------------------------------------------------------------------------

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        guided = params.guidance_scale > 1
        requested = self.requested_steps(params)
        running = []
        with torch.inference_mode():
            for item, condition in zip(items, self.encode(items, guided, params), strict=True):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                scheduler = self.new_scheduler()
                scheduler.set_timesteps(params.num_inference_steps, device=device)
                timesteps, dtype = scheduler.timesteps, condition["context"].dtype
                with self.using(scheduler):  # the pipeline's own helpers, on this image's scheduler
                    if self.spec.needs_image:
                        # A flow's refiner starts at `denoising_start` from the base's latents, adding no noise.
                        start = {} if item.denoising_start is None else {"denoising_start": item.denoising_start}
                        timesteps, _ = pipe.get_timesteps(params.num_inference_steps, params.strength, device, **start)
                        image = pipe.image_processor.preprocess(item.image)  # a flow's latents pass through
                        latents = pipe.prepare_latents(image, timesteps[:1].repeat(1), 1, 1, dtype, device, [generator],
                                                       **({"add_noise": False} if start else {}))  # fmt: skip
                    else:
                        if hasattr(scheduler, "set_begin_index"):
                            scheduler.set_begin_index(0)
                        latents = pipe.prepare_latents(
                            1, pipe.unet.config.in_channels, params.height, params.width, dtype, device, [generator]
                        )
                    step_kwargs = pipe.prepare_extra_step_kwargs([generator], 0.0)
                if item.denoising_end is not None:  # the base stops where the refiner starts (diffusers' cut)
                    cut = self.schedule_cut(scheduler, item.denoising_end)
                    timesteps = timesteps[: int((timesteps >= cut).sum())]
                handoff = item.denoising_start is not None or item.denoising_end is not None
                state = {
                    **self.control_state(item, guided, params, dtype),
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "condition": condition,
                    "guidance": params.guidance_scale if guided else None,
                    "step_kwargs": step_kwargs,
                    "step_cache": row_cache(self.spec.step_cache, params.step_cache, item.batch_line),
                }
                steps = len(timesteps) if handoff else requested
                running.append(RunningItem(item, total=len(timesteps), requested=steps, state=state))
        return self.prepared(running)


class SDXLDenoiser(UNetDenoiser):
    """SDXL: the context is both encoders' hidden states side by side; `added_cond_kwargs` carry the second
    encoder's pooled embedding and the size conditioning (original size, crop, target size; image-to-image's
    with the aesthetic score when the weights ask for it)."""

    extra_load_kwargs: dict[str, Any] = {}

    def encode(self, items: list[GenerationItem], guided: bool, params: GenerationParameters) -> list[dict]:
        pipe = self.pipeline
        negatives = [item.negative_prompt or "" for item in items]
        prompt_embeds, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
            prompt=[item.prompt for item in items], device=pipe._execution_device, num_images_per_prompt=1,
            do_classifier_free_guidance=guided, negative_prompt=negatives,
        )  # fmt: skip
        if guided and pipe.config.force_zeros_for_empty_prompt:
            # The pipeline zeroes the negative embeddings when no negative prompt is given (not the embedding of
            # ""): an image without one gets zeros, as it would alone.
            for index, item in enumerate(items):
                if item.negative_prompt is None:
                    negative_embeds[index].zero_()
                    negative_pooled[index].zero_()
        projection = (
            pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None else int(pooled.shape[-1])
        )
        size, dtype = (params.height, params.width), prompt_embeds.dtype
        if self.spec.needs_image:  # the img2img pipeline's time ids: with aesthetic scores (its defaults) when asked
            time_ids, negative_time_ids = pipe._get_add_time_ids(
                size, (0, 0), size, 6.0, 2.5, size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=projection
            )
        else:
            time_ids = negative_time_ids = pipe._get_add_time_ids(
                size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=projection
            )
        count, device = len(items), prompt_embeds.device
        positive = {"context": prompt_embeds, "text_embeds": pooled, "time_ids": time_ids.to(device).repeat(count, 1)}
        negative = {"context": negative_embeds, "text_embeds": negative_pooled,
                    "time_ids": negative_time_ids.to(device).repeat(count, 1)}  # fmt: skip
        return conditions(positive, negative if guided else None)

    def cached_call(self, running: list[RunningItem], rows_per_image: list[int], sample, timestep, condition: dict):
        added = {"text_embeds": condition["text_embeds"], "time_ids": condition["time_ids"]}
        return deep_cache_unet(self.deep_parts(), running, rows_per_image, self.forced_skips, self.tail_calls, sample,
                               timestep, condition["context"], added, self.padded_images_rows)  # fmt: skip

    def unet_call(self, sample, timestep, condition: dict, **controls):
        # An IP-Adapter's image embeddings ride in `added_cond_kwargs` beside the pooled embeddings and time ids.
        added = {"text_embeds": condition["text_embeds"], "time_ids": condition["time_ids"],
                 **controls.pop("added_cond_kwargs", {})}  # fmt: skip
        return self.pipeline.unet(
            sample, timestep, encoder_hidden_states=condition["context"], added_cond_kwargs=added, return_dict=False,
            **controls,
        )[0]  # fmt: skip

    def decode_latents(self, latents, running: list[RunningItem]):
        """As the pipeline decodes: in float32 when the VAE is half precision and its config says it overflows."""
        torch, vae = self._torch, self.pipeline.vae
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast
        if upcast:
            vae.to(dtype=torch.float32)
            latents = latents.to(torch.float32)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        try:
            return vae.decode(latents, return_dict=False)[0]
        finally:
            if upcast:
                vae.to(dtype=torch.float16)


class SD15InpaintDenoiser(UNetDenoiser):
    """SD 1.5 inpainting (`StableDiffusionInpaintPipeline` over a 9-channel UNet): each image's rows of the shared
    call carry its own mask and masked-image latents beside its latents, so images with other inputs, masks and
    step counts share a call. Latents, mask and masked image are made by the pipeline's own helpers, on each image's
    own generator, in the pipeline's order (its image's latents when strength < 1, the noise, then the masked image's
    latents), so each image is the one the pipeline makes for it alone."""

    def check_loaded(self) -> None:
        super().check_loaded()
        channels = self.pipeline.unet.config.in_channels
        if channels != 9:
            raise ValueError(
                f"{self.spec.name}: an inpaint model needs an inpainting UNet (9 input channels), not {channels}"
            )

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs = super().call_kwargs(items, params)
        kwargs["mask_image"] = [item.mask for item in items]
        kwargs["width"], kwargs["height"] = params.width, params.height
        return kwargs

    def conditioned_input(self, r: RunningItem, rows):
        torch = self._torch
        count = rows.shape[0]
        mask, masked = r.state["mask"], r.state["masked_image_latents"]
        return torch.cat([rows, mask.expand(count, -1, -1, -1), masked.expand(count, -1, -1, -1)], dim=1)

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        guided = params.guidance_scale > 1
        strength = 1.0 if params.strength is None else params.strength
        height, width = params.height, params.width
        requested = self.requested_steps(params)
        running = []
        with torch.inference_mode():
            for item, condition in zip(items, self.encode(items, guided, params), strict=True):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                scheduler = self.new_scheduler()
                scheduler.set_timesteps(params.num_inference_steps, device=device)
                dtype = condition["context"].dtype
                with self.using(scheduler):  # the pipeline's own helpers, on this image's scheduler
                    timesteps, _ = pipe.get_timesteps(params.num_inference_steps, strength, device)
                    image = pipe.image_processor.preprocess(item.image, height=height, width=width)
                    image = image.to(dtype=torch.float32)
                    latents, _ = pipe.prepare_latents(
                        1, pipe.vae.config.latent_channels, height, width, dtype, device, [generator], None,
                        image=image, timestep=timesteps[:1].repeat(1), is_strength_max=strength == 1.0,
                        return_noise=True,
                    )  # fmt: skip
                    mask_condition = pipe.mask_processor.preprocess(item.mask, height=height, width=width)
                    mask, masked_image_latents = pipe.prepare_mask_latents(
                        mask_condition, image * (mask_condition < 0.5), 1, height, width, dtype, device, [generator],
                        False,
                    )  # fmt: skip
                    step_kwargs = pipe.prepare_extra_step_kwargs([generator], 0.0)
                state = {
                    **self.control_state(item, guided, params, dtype),
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "mask": mask,
                    "masked_image_latents": masked_image_latents,
                    "condition": condition,
                    "guidance": params.guidance_scale if guided else None,
                    "step_kwargs": step_kwargs,
                }
                running.append(RunningItem(item, total=len(timesteps), requested=requested, state=state))
        return self.prepared(running)


class SDXLInpaintDenoiser(SD15InpaintDenoiser, SDXLDenoiser):
    """SDXL inpainting (`StableDiffusionXLInpaintPipeline` over a 9-channel UNet): SD 1.5 inpainting's per-image
    start and 9-channel rows, with SDXL's conditioning (both encoders, the pooled embedding and the time ids the
    image-taking pipelines use, with the aesthetic score when the weights ask for it), call and decode."""
