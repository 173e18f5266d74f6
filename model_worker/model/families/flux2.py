"""FLUX.2 [klein] (`Flux2KleinPipeline`): a flow-matching MMDiT over 2x2-patchified latents, a Qwen3 text encoder.

The pipeline patchifies the VAE's latents 2x2 and packs them into tokens with explicit 4-D position ids (T, H, W, L)
that carry a batch axis, as the text ids do; the transformer takes `timestep / 1000` per row and no guidance (the
step-distilled [klein] ignores it). Each image keeps its own `FlowMatchEulerDiscreteScheduler` with FLUX.2's
`linspace(1, 1/steps)` sigmas shifted by its own `mu` (`compute_empirical_mu`: from the token count and the step
count, so images of one size with different step counts have different schedules), stepped for the whole running
set at once. The prompt is padded to 512 tokens in both schedulings, so every row's context has one shape. Decoding
unpacks the tokens by their ids, undoes the VAE's latent batch norm and the 2x2 patches, as the pipeline does.
"""

from __future__ import annotations

from typing import Any

from contract.messages import GenerationParameters
from model_worker.model.families.base import Denoiser, pad_rows
from model_worker.model.runners import GenerationItem, RunningItem

# The pipeline's prompt length (Qwen3 tokens, chat template included), in both schedulings.
KLEIN_MAX_SEQUENCE_LENGTH = 512


class Flux2KleinDenoiser(Denoiser):
    model_attribute = "transformer"

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        return {"width": params.width, "height": params.height, "max_sequence_length": KLEIN_MAX_SEQUENCE_LENGTH}

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        import numpy as np
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        steps = params.num_inference_steps
        with torch.inference_mode():
            prompt_embeds, text_ids = pipe.encode_prompt(
                prompt=[item.prompt for item in items], device=device, num_images_per_prompt=1,
                max_sequence_length=KLEIN_MAX_SEQUENCE_LENGTH,
            )  # fmt: skip
            channels = pipe.transformer.config.in_channels // 4
            flow_sigmas = pipe.scheduler.config.get("use_flow_sigmas", False)
            running = []
            for index, item in enumerate(items):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                latents, latent_ids = pipe.prepare_latents(
                    1, channels, params.height, params.width, prompt_embeds.dtype, device, [generator]
                )
                mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=steps)
                sigmas = None if flow_sigmas else np.linspace(1.0, 1 / steps, steps)
                scheduler = self.new_scheduler()
                timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
                scheduler.set_begin_index(0)
                state = {
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "latent_ids": latent_ids,
                    "context": prompt_embeds[index : index + 1],
                    "text_ids": text_ids[index : index + 1],
                    "size": (params.height, params.width),
                    "mu": mu,
                    "step_kwargs": {},
                }
                running.append(RunningItem(item, total=len(timesteps), requested=steps, state=state))
        return self.prepared(running)

    def denoise(self, running: list[RunningItem]) -> None:
        torch = self._torch
        self.one_size(running)
        model = self.pipeline.transformer
        with torch.inference_mode():
            latents = torch.cat([r.state["latents"] for r in running])
            timestep = torch.cat([r.state["timesteps"][r.done].expand(1) for r in running]).to(latents.dtype)
            context = torch.cat([r.state["context"] for r in running])
            text_ids = torch.cat([r.state["text_ids"] for r in running])
            latent_ids = torch.cat([r.state["latent_ids"] for r in running])
            rows = latents.shape[0]
            size = self.padded_rows(rows)
            if size != rows:  # a compiled model's fixed batch: the last row repeated, its outputs dropped
                latents, timestep, context, text_ids, latent_ids = (
                    pad_rows(tensor, size) for tensor in (latents, timestep, context, text_ids, latent_ids)
                )
            predicted = model(
                hidden_states=latents.to(model.dtype), timestep=timestep / 1000, guidance=None,
                encoder_hidden_states=context, txt_ids=text_ids, img_ids=latent_ids, return_dict=False,
            )[0][:rows, : latents.shape[1]]  # fmt: skip
            self.step_items(running, [predicted[i : i + 1] for i in range(rows)])

    def decode_latents(self, latents, running: list[RunningItem]):
        """As the pipeline decodes: tokens back to the patchified grid by their ids, the VAE's latent batch norm
        undone, the 2x2 patches unfolded."""
        torch, pipe = self._torch, self.pipeline
        height, width = running[0].state["size"]
        latent_ids = torch.cat([r.state["latent_ids"] for r in running])
        grid_height = 2 * (int(height) // (pipe.vae_scale_factor * 2)) // 2
        grid_width = 2 * (int(width) // (pipe.vae_scale_factor * 2)) // 2
        latents = pipe._unpack_latents_with_ids(latents, latent_ids, grid_height, grid_width)
        vae = pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        latents = pipe._unpatchify_latents(latents * std + mean)
        return vae.decode(latents.to(vae.device), return_dict=False)[0]
