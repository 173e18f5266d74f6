"""The UNet families with classifier-free guidance: SD 1.5 (one CLIP) and SDXL (two CLIPs, pooled embeddings and
size conditioning through `added_cond_kwargs`, a VAE decoded in float32 when its config asks).

A guided image takes two rows of the shared UNet call (negative, then positive); an unguided one (guidance
scale 1 or less) takes one, so images with and without guidance share a call. Each row gets its own timestep.
"""

from __future__ import annotations

from typing import Any

from contract.messages import GenerationParameters
from model_worker.families.base import Denoiser, guided_predictions, pad_rows, randn, step_kwargs
from model_worker.runners import GenerationItem, RunningItem


class UNetDenoiser(Denoiser):
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
        self.pipeline.unet.to(memory_format=self._torch.channels_last)
        super().compile()

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if any(item.negative_prompt for item in items):
            kwargs["negative_prompt"] = [item.negative_prompt or "" for item in items]
        if self.needs_image:
            kwargs["image"] = [item.image for item in items]  # decoded and resized off this thread, at intake
            kwargs["strength"] = params.strength
        else:
            kwargs["width"], kwargs["height"] = params.width, params.height
        return kwargs

    # --- the family's conditioning (SDXL overrides) --------------------------------------------------------

    def encode(self, items: list[GenerationItem], guided: bool, params: GenerationParameters) -> list[dict]:
        """Each image's conditioning tensors, rows in UNet order (negative first when guided)."""
        torch = self._torch
        prompt_embeds, negative_embeds = self.pipeline.encode_prompt(
            [item.prompt for item in items], self.pipeline._execution_device, 1, guided,
            [item.negative_prompt or "" for item in items],
        )  # fmt: skip
        conditions = []
        for index in range(len(items)):
            context = prompt_embeds[index : index + 1]
            if guided:
                context = torch.cat([negative_embeds[index : index + 1], context])
            conditions.append({"context": context})
        return conditions

    def call_model(self, sample, timestep, condition: dict):
        return self.pipeline.unet(sample, timestep, encoder_hidden_states=condition["context"], return_dict=False)[0]

    def latents_for_vae(self, latents):
        return latents / self.pipeline.vae.config.scaling_factor

    # --- stepping ------------------------------------------------------------------------------------------

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        guided = params.guidance_scale > 1
        requested = self.requested_steps(params)
        running = []
        with torch.inference_mode():
            conditions = self.encode(items, guided, params)
            for item, condition in zip(items, conditions, strict=True):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                scheduler = self.new_scheduler()
                scheduler.set_timesteps(params.num_inference_steps, device=device)
                timesteps = scheduler.timesteps
                dtype = condition["context"].dtype
                if self.needs_image:
                    timesteps, latents = self._image_latents(scheduler, item, params, generator, device, dtype)
                else:
                    if hasattr(scheduler, "set_begin_index"):
                        scheduler.set_begin_index(0)
                    shape = (
                        1,
                        pipe.unet.config.in_channels,
                        params.height // pipe.vae_scale_factor,
                        params.width // pipe.vae_scale_factor,
                    )
                    latents = randn(shape, generator, device, dtype) * scheduler.init_noise_sigma
                state = {
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "condition": condition,
                    "guidance": params.guidance_scale if guided else None,
                    "step_kwargs": step_kwargs(scheduler, generator),
                }
                running.append(RunningItem(item, total=len(timesteps), requested=requested, state=state))
        return running

    def _image_latents(self, scheduler, item: GenerationItem, params: GenerationParameters, generator, device, dtype):
        """img2img's `get_timesteps` and `prepare_latents` for one image, on its own scheduler instance."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents

        pipe, steps = self.pipeline, params.num_inference_steps
        start = max(steps - min(int(steps * params.strength), steps), 0)
        timesteps = scheduler.timesteps[start * scheduler.order :]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start * scheduler.order)
        image = pipe.image_processor.preprocess(item.image).to(device=device, dtype=dtype)
        init = retrieve_latents(pipe.vae.encode(image), generator=generator) * pipe.vae.config.scaling_factor
        noise = randn(init.shape, generator, device, dtype)
        return timesteps, scheduler.add_noise(init, noise, timesteps[:1].repeat(1))

    def denoise(self, running: list[RunningItem]) -> None:
        torch = self._torch
        inputs, timesteps = [], []
        with torch.inference_mode():
            for r in running:
                t = r.state["timesteps"][r.done]
                latents = r.state["latents"]
                x = torch.cat([latents] * 2) if r.state["guidance"] is not None else latents
                inputs.append(r.state["scheduler"].scale_model_input(x, t))
                timesteps.append(t.reshape(1).to(torch.float32).repeat(x.shape[0]))
            sample, timestep = torch.cat(inputs), torch.cat(timesteps).to(inputs[0].device)
            condition = {key: torch.cat([r.state["condition"][key] for r in running])
                         for key in running[0].state["condition"]}  # fmt: skip
            rows = sample.shape[0]
            size = self.padded_rows(rows, rows_per_image=2)  # static shapes when compiled: padded, then dropped
            if size != rows:
                sample, timestep = pad_rows(sample, size), pad_rows(timestep, size)
                condition = {key: pad_rows(value, size) for key, value in condition.items()}
            predicted = self.call_model(sample, timestep, condition)[:rows]
            self.step_items(running, guided_predictions(running, inputs, predicted))

    def decode(self, running: list[RunningItem]) -> list:
        torch, pipe = self._torch, self.pipeline
        with torch.inference_mode():
            latents = torch.cat([r.state["latents"] for r in running])
            images = self.decode_latents(latents)
            arrays = pipe.image_processor.postprocess(images, output_type="np", do_denormalize=[True] * len(running))
        self.finished(running)
        return list(arrays)

    def decode_latents(self, latents):
        return self.pipeline.vae.decode(self.latents_for_vae(latents), return_dict=False)[0]


class SDXLDenoiser(UNetDenoiser):
    """SDXL: the context is both encoders' hidden states side by side; `added_cond_kwargs` carry the second
    encoder's pooled embedding and the size conditioning (original size, crop, target size; image-to-image's
    with the aesthetic score when the weights ask for it)."""

    extra_load_kwargs: dict[str, Any] = {}

    def encode(self, items: list[GenerationItem], guided: bool, params: GenerationParameters) -> list[dict]:
        torch, pipe = self._torch, self.pipeline
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
        if self.needs_image:  # the img2img pipeline's time ids: with aesthetic scores (its defaults) when configured
            time_ids, negative_time_ids = pipe._get_add_time_ids(
                size, (0, 0), size, 6.0, 2.5, size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=projection
            )
        else:
            time_ids = negative_time_ids = pipe._get_add_time_ids(
                size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=projection
            )
        time_ids, negative_time_ids = time_ids.to(prompt_embeds.device), negative_time_ids.to(prompt_embeds.device)
        conditions = []
        for index in range(len(items)):
            context, text_embeds, ids = prompt_embeds[index : index + 1], pooled[index : index + 1], time_ids
            if guided:
                context = torch.cat([negative_embeds[index : index + 1], context])
                text_embeds = torch.cat([negative_pooled[index : index + 1], text_embeds])
                ids = torch.cat([negative_time_ids, time_ids])
            conditions.append({"context": context, "text_embeds": text_embeds, "time_ids": ids})
        return conditions

    def _image_latents(self, scheduler, item: GenerationItem, params: GenerationParameters, generator, device, dtype):
        """The img2img pipeline's own `get_timesteps` and `prepare_latents` (VAE upcast, latent mean and std) for
        one image, on its own scheduler."""
        pipe = self.pipeline
        with self.using(scheduler):
            timesteps, _ = pipe.get_timesteps(params.num_inference_steps, params.strength, device)
            image = pipe.image_processor.preprocess(item.image)
            latents = pipe.prepare_latents(image, timesteps[:1].repeat(1), 1, 1, dtype, device, [generator])
        return timesteps, latents

    def call_model(self, sample, timestep, condition: dict):
        added = {"text_embeds": condition["text_embeds"], "time_ids": condition["time_ids"]}
        return self.pipeline.unet(
            sample, timestep, encoder_hidden_states=condition["context"], added_cond_kwargs=added, return_dict=False
        )[0]

    def decode_latents(self, latents):
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
