"""Z-Image (`ZImagePipeline`, Z-Image-Turbo): a single-stream DiT over 2x2 patches, a Qwen3 text encoder, flow matching.

The transformer takes its images, timesteps and captions as lists, one entry per row: each image's latents
(C, 1, h, w), its caption's unpadded hidden states (the pipeline keeps only the prompt's unmasked tokens, so captions
of different lengths share a call) and its timestep as `(1000 - t) / 1000`. Its output is the negated velocity, in
float32, which the pipeline's `FlowMatchEulerDiscreteScheduler` steps in float32 latents. Each image keeps its own
scheduler with Z-Image's sigmas (`linspace(1, 1/steps)`), shifted by the resolution's `mu` when the scheduler's
config shifts dynamically (Turbo's shifts statically by 3), so a running set of any step counts shares one call.
Image-to-image (`ZImageImg2ImgPipeline`) starts each image at its strength's step of its own schedule from its noised
input's latents, as the pipeline does. Turbo is distilled to a few steps without classifier-free guidance (the pipeline runs none at guidance 0); the
family takes no guidance (contract/families.py).
"""

from __future__ import annotations

from typing import Any

from contract.messages import GenerationParameters
from model_worker.model.families.base import Denoiser
from model_worker.model.families.flow import from_flow_latents
from model_worker.model.runners import GenerationItem, RunningItem

# The pipeline's default caption length (Qwen3 tokens, chat template included), in both schedulings.
ZIMAGE_MAX_SEQUENCE_LENGTH = 512


class ZImageDenoiser(Denoiser):
    model_attribute = "transformer"

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs = {"width": params.width, "height": params.height, "max_sequence_length": ZIMAGE_MAX_SEQUENCE_LENGTH}
        if self.spec.needs_image:
            kwargs["image"], kwargs["strength"] = [item.image for item in items], params.strength
        return kwargs

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
            retrieve_timesteps,
        )

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        steps = params.num_inference_steps
        requested = self.requested_steps(params)
        config = pipe.scheduler.config
        with torch.inference_mode():
            captions, _ = pipe.encode_prompt(
                prompt=[item.prompt for item in items], device=device, do_classifier_free_guidance=False,
                max_sequence_length=ZIMAGE_MAX_SEQUENCE_LENGTH,
            )  # fmt: skip
            running = []
            for item, caption in zip(items, captions, strict=True):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                channels = pipe.transformer.in_channels
                patch = pipe.vae_scale_factor * 2  # the image's pixels per 2x2 latent patch, along each side
                tokens = (params.height // patch) * (params.width // patch)
                mu = calculate_shift(
                    tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                    config.get("base_shift", 0.5), config.get("max_shift", 1.15),
                )  # fmt: skip
                scheduler = self.new_scheduler()
                timesteps, _ = retrieve_timesteps(
                    scheduler, steps, device, sigmas=get_default_z_image_sigmas(steps), mu=mu
                )
                if self.spec.needs_image:  # the img2img pipeline's start: its strength's share of the schedule
                    timesteps, latents = self.image_to_image_start(
                        scheduler, item, params, steps, channels, caption.dtype, generator
                    )
                else:
                    latents = pipe.prepare_latents(
                        1, channels, params.height, params.width, torch.float32, device, [generator]
                    )
                    scheduler.set_begin_index(0)
                state = {
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "caption": caption,
                    "size": (params.height, params.width),
                    "mu": mu,
                    "step_kwargs": {},
                }
                running.append(RunningItem(item, total=len(timesteps), requested=requested, state=state))
        return self.prepared(running)

    def denoise(self, running: list[RunningItem]) -> None:
        torch = self._torch
        self.one_size(running)
        model = self.pipeline.transformer
        with torch.inference_mode():
            latents = [r.state["latents"].to(model.dtype).unsqueeze(2)[0] for r in running]
            timestep = torch.cat([r.state["timesteps"][r.done].expand(1) for r in running])
            captions = [r.state["caption"] for r in running]
            rows = len(running)
            size = self.padded_rows(rows)
            if size != rows:  # a compiled model's fixed batch: the last row repeated, its outputs dropped
                latents += [latents[-1]] * (size - rows)
                captions += [captions[-1]] * (size - rows)
                timestep = torch.cat([timestep, timestep[-1:].expand(size - rows)])
            outputs = model(latents, (1000 - timestep) / 1000, captions, return_dict=False)[0][:rows]
            self.step_items(running, [-output.float().squeeze(1).unsqueeze(0) for output in outputs])

    def decode_latents(self, latents, running: list[RunningItem]):
        vae = self.pipeline.vae
        return from_flow_latents(vae, latents.to(vae.dtype))
