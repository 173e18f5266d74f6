"""Qwen-Image (`QwenImagePipeline`): a 20B MMDiT over 2x2-packed latents, a Qwen2.5-VL text encoder, flow matching,
and its own classifier-free guidance (`true_cfg_scale` with a negative prompt).

The pipeline keeps only the prompt's unmasked hidden states (its system template's tokens dropped), so prompts have
different lengths: a shared call pads every row's context to the longest with zeros and passes the mask, which the
transformer's joint attention honours (and drops when nothing is padded, as the pipeline does). The transformer takes
`timestep / 1000` per row and each row's latent grid (`img_shapes`). A guided image takes two rows, its prompt's and
its negative prompt's; its prediction is `neg + scale (pos - neg)` rescaled per token to the positive one's norm, as
the pipeline combines its two calls. A request's `guidance_scale` is the pipeline's `true_cfg_scale`; a guided image
without a negative prompt gets the model card's `" "` (the pipeline runs no guidance without one). Each image keeps its
own scheduler with the resolution's `mu`, stepped for the whole running set at once. Image-to-image
(`QwenImageImg2ImgPipeline`) starts each image at its strength's step of its own schedule from its noised input's
latents, as the pipeline does.
"""

from __future__ import annotations

from typing import Any

from contract.messages import GenerationParameters
from model_worker.model.families.base import Denoiser, pad_rows
from model_worker.model.runners import GenerationItem, RunningItem

# The pipeline's default prompt length (its `max_sequence_length`), in both schedulings.
QWEN_MAX_SEQUENCE_LENGTH = 512
# The negative prompt of a guided request that names none: Qwen-Image's model card's.
DEFAULT_NEGATIVE_PROMPT = " "


class QwenImageDenoiser(Denoiser):
    model_attribute = "transformer"

    def check_loaded(self) -> None:
        """Guidance-distilled weights (`guidance_embeds`) take the pipeline's `guidance_scale`, not the
        `true_cfg_scale` this family maps a request's guidance to: refused rather than served wrongly."""
        if self.pipeline.transformer.config.guidance_embeds:
            raise ValueError(
                f"{self.spec.name}: the transformer embeds guidance (guidance-distilled weights); the qwenimage family "
                "serves Qwen-Image's classifier-free guidance (true_cfg_scale) only"
            )

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "width": params.width, "height": params.height, "max_sequence_length": QWEN_MAX_SEQUENCE_LENGTH,
            "guidance_scale": None, "true_cfg_scale": params.guidance_scale,
        }  # fmt: skip
        if params.guidance_scale > 1:
            kwargs["negative_prompt"] = [item.negative_prompt or DEFAULT_NEGATIVE_PROMPT for item in items]
        if self.spec.needs_image:
            kwargs["image"], kwargs["strength"] = [item.image for item in items], params.strength
        return kwargs

    def _contexts(self, prompts: list[str], device) -> list:
        """Each prompt's hidden states without padding, (1, tokens, width)."""
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=device, num_images_per_prompt=1, max_sequence_length=QWEN_MAX_SEQUENCE_LENGTH
        )
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        return [embeds[i : i + 1, :length] for i, length in enumerate(lengths)]

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        torch, pipe = self._torch, self.pipeline
        device = pipe._execution_device
        steps = params.num_inference_steps
        requested = self.requested_steps(params)
        guided = params.guidance_scale > 1
        config = pipe.scheduler.config
        with torch.inference_mode():
            contexts = self._contexts([item.prompt for item in items], device)
            negatives = (
                self._contexts([item.negative_prompt or DEFAULT_NEGATIVE_PROMPT for item in items], device)
                if guided
                else [None] * len(items)
            )
            channels = pipe.transformer.config.in_channels // 4
            scale = pipe.vae_scale_factor
            grid = (1, params.height // scale // 2, params.width // scale // 2)
            running = []
            for item, context, negative in zip(items, contexts, negatives, strict=True):
                generator = torch.Generator(device="cpu").manual_seed(item.seed)
                mu = calculate_shift(
                    grid[1] * grid[2], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                    config.get("base_shift", 0.5), config.get("max_shift", 1.15),
                )  # fmt: skip
                scheduler = self.new_scheduler()
                sigmas = np.linspace(1.0, 1 / steps, steps)
                timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
                if self.spec.needs_image:  # the img2img pipeline's start: its strength's share of the schedule
                    timesteps, latents = self.image_to_image_start(
                        scheduler, item, params, steps, channels, context.dtype, generator
                    )
                else:
                    latents = pipe.prepare_latents(
                        1, channels, params.height, params.width, context.dtype, device, [generator]
                    )
                    scheduler.set_begin_index(0)
                state = {
                    "scheduler": scheduler,
                    "timesteps": timesteps,
                    "latents": latents,
                    "context": context,
                    "negative": negative,
                    "guidance": params.guidance_scale if guided else None,
                    "grid": grid,
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
            latents, timesteps, contexts = [], [], []
            for r in running:  # a guided image's rows: its prompt's, then its negative prompt's
                rows = [r.state["context"]] + ([r.state["negative"]] if r.state["guidance"] is not None else [])
                latents += [r.state["latents"]] * len(rows)
                timesteps += [r.state["timesteps"][r.done].expand(1)] * len(rows)
                contexts += rows
            latents, timestep = torch.cat(latents), torch.cat(timesteps).to(latents[0].dtype)
            context, mask = padded_contexts(contexts)
            rows = latents.shape[0]
            size = self.padded_rows(rows, rows_per_image=2)
            if size != rows:  # a compiled model's fixed batch: the last row repeated, its outputs dropped
                latents, timestep, context, mask = (pad_rows(t, size) for t in (latents, timestep, context, mask))
            predicted = model(
                hidden_states=latents, timestep=timestep / 1000, guidance=None, encoder_hidden_states_mask=mask,
                encoder_hidden_states=context, img_shapes=[[running[0].state["grid"]]] * latents.shape[0],
                return_dict=False,
            )[0][:rows]  # fmt: skip
            predictions, offset = [], 0
            for r in running:
                positive = predicted[offset : offset + 1]
                offset += 1
                if r.state["guidance"] is not None:
                    negative = predicted[offset : offset + 1]
                    offset += 1
                    combined = negative + r.state["guidance"] * (positive - negative)
                    norm = torch.norm(positive, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
                    positive = combined * norm
                predictions.append(positive)
            self.step_items(running, predictions)

    def decode_latents(self, latents, running: list[RunningItem]):
        """As the pipeline decodes: unpacked to the VAE's (B, C, 1, h, w), its latent statistics undone, the one frame."""
        torch, pipe = self._torch, self.pipeline
        vae = pipe.vae
        height, width = running[0].state["size"]
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]


def padded_contexts(contexts: list) -> tuple:
    """The rows' contexts padded with zeros to the longest, and their mask (None when none is padded, as the
    pipeline passes none then)."""
    import torch

    longest = max(context.shape[1] for context in contexts)
    if all(context.shape[1] == longest for context in contexts):
        return torch.cat(contexts), None
    padded = [torch.cat([c, c.new_zeros(1, longest - c.shape[1], c.shape[2])], dim=1) for c in contexts]
    mask = torch.zeros(len(contexts), longest, dtype=torch.long, device=contexts[0].device)
    for row, context in enumerate(contexts):
        mask[row, : context.shape[1]] = 1
    return torch.cat(padded), mask
