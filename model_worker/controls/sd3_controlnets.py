"""SD 3.5 ControlNets per row of a shared transformer call: each `SD3ControlNetModel` runs once per step over the
rows that use it, its block residuals scaled per row and added to those rows only.

diffusers' `StableDiffusion3ControlNetPipeline` runs one ControlNet (or an `SD3MultiControlNetModel`, whose residuals
it sums) over the whole batch with one scale per call. Here, as for the UNet families (controlnets.py), each image
keeps its own ControlNets, scales and `start`/`end` windows. An image's control image is prepared as the pipeline
prepares it (resized and normalised, doubled for classifier-free guidance, encoded by the VAE, shifted and scaled;
InstantX's ControlNets, which force zero pooled projections, unshifted). The pipeline samples those latents from
torch's global generator; here each image samples them from a generator of its own, seeded from the image's seed
(`controlnets.control_noise_seed`), so an image is the same alone or in any batch, and request scheduling
seeds the global generator alike for each image's pipeline call. The ControlNet runs over the rows that use it at
scale 1 with the text and pooled projections the pipeline gives it, and each row's residuals are multiplied by its
scale times its window's keep and added into zeros for the whole call. The transformer adds the
`int(i / interval)`-th residual to its block i, so ControlNets of different depths in one call (or any on a compiled
transformer) are spread to one residual per block first. A row without control gets zeros (x + 0 is x); a call where
no row has one passes no residuals at all (a compiled transformer's warm-up traces the ControlNet call with
`zero_sd3_residuals`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from model_worker.controls.controlnets import ControlNetRows, RowControl, control_noise_seed


class SD3ControlNetRows(ControlNetRows):
    """The ControlNet side of one SD 3.5 denoiser: control latents prepared per image, residuals per shared call."""

    def prepare(self, item, guided: bool, height: int, width: int, dtype) -> list[RowControl]:
        """An image's ControlNets with their control latents as `StableDiffusion3ControlNetPipeline` makes them (one
        row per model row of the image), sampled from the image's own control generator, in the request's order."""
        controls = getattr(item, "controls", None)
        if controls is None:
            return []
        torch, pipe = self._torch, self._pipeline
        device, vae = pipe._execution_device, pipe.vae
        generator = torch.Generator(device=device).manual_seed(control_noise_seed(item.seed))
        rows = []
        for weights, use, image in zip(controls.weights(), controls.refs, item.control_images, strict=True):
            if weights.kind != "controlnet":
                continue
            prepared = pipe.image_processor.preprocess(image, height=height, width=width)
            prepared = prepared.to(device=device, dtype=pipe.transformer.dtype)
            if guided:
                prepared = torch.cat([prepared] * 2)
            latents = vae.encode(prepared).latent_dist.sample(generator=generator)
            shift = 0 if weights.model.config.force_zeros_for_pooled_projection else vae.config.shift_factor
            latents = (latents - shift) * vae.config.scaling_factor
            rows.append(RowControl(weights, latents.to(dtype=dtype), use.scale, use.start, use.end, use.mode))
        return rows

    def residuals(self, running, inputs, sample, timestep, condition: dict, every_block: bool = False) -> dict:
        """The transformer's `block_controlnet_hidden_states` for the call's rows (`sample` may be padded past the
        running set's rows: those get zeros); {} when no row has a ControlNet. `condition`: the call's context and
        pooled projections. `every_block` (a compiled transformer): always one residual per block."""
        torch = self._torch
        uses: OrderedDict[tuple, list[tuple[int, int, Any, float]]] = OrderedDict()
        offset = 0
        for r, x in zip(running, inputs, strict=True):
            count = x.shape[0]
            steps = len(r.state["step_timesteps"])
            for control in r.state.get("controlnets", ()):
                uses.setdefault(control.weights.key, []).append(
                    (offset, count, control, control.scale * control.keep(r.done, steps))
                )
            offset += count
        if not uses:
            return {}
        outputs = []
        for rows in uses.values():
            model = self._model(rows[0][2].weights)
            index = torch.cat([torch.arange(start, start + count) for start, count, _, _ in rows]).to(sample.device)
            pooled = condition["pooled"][index]
            # As the pipeline: InstantX's take zero pooled projections; Stability's SD 3.5 ones no text at all.
            samples = model(
                hidden_states=sample[index], controlnet_cond=torch.cat([control.image for _, _, control, _ in rows]),
                conditioning_scale=1.0, timestep=timestep[index],
                encoder_hidden_states=condition["context"][index] if model.config.joint_attention_dim else None,
                pooled_projections=torch.zeros_like(pooled) if model.config.force_zeros_for_pooled_projection
                else pooled, return_dict=False,
            )[0]  # fmt: skip
            scales = torch.cat([torch.full((count,), scale, dtype=sample.dtype) for _, count, _, scale in rows])
            outputs.append((index, scales.to(sample.device).view(-1, 1, 1), list(samples)))
        blocks = len(self._pipeline.transformer.transformer_blocks)
        if every_block or len({len(samples) for _, _, samples in outputs}) > 1:
            outputs = [(index, scales, per_block(samples, blocks)) for index, scales, samples in outputs]
        totals = []
        if every_block:
            totals = zero_sd3_residuals(self._pipeline.transformer, sample)["block_controlnet_hidden_states"]
        for index, scales, samples in outputs:
            if not totals:
                totals = [s.new_zeros((sample.shape[0], *s.shape[1:])) for s in samples]
            for total, part in zip(totals, samples, strict=True):
                total.index_add_(0, index, part * scales)
        return {"block_controlnet_hidden_states": totals}

    def _model(self, weights):
        """The ControlNet on the device; one without position embeddings of its own (Stability's SD 3.5 ones) gets
        the transformer's, as the pipeline gives it."""
        model = super()._model(weights)
        if model.pos_embed is None and model.config.use_pos_embed is False:
            transformer = getattr(self._pipeline.transformer, "_orig_mod", self._pipeline.transformer)
            model.pos_embed = model._get_pos_embed_from_transformer(transformer).to(model.device, model.dtype)
        return model


def per_block(samples: list, blocks: int) -> list:
    """A ControlNet's residuals as the SD 3.5 transformer adds them, one per block: the `int(i / interval)`-th."""
    interval = blocks / len(samples)
    return [samples[int(i / interval)] for i in range(blocks)]


def zero_sd3_residuals(transformer, sample) -> dict:
    """Zero residuals for every block of an SD 3.5 transformer over `sample` (its latents: one per 2x2 patch), in
    the transformer's dtype: what a compiled transformer of a model that takes ControlNets is called with in its
    warm-up, so the graph ControlNets use is traced before any arrives. x + 0 is x."""
    patch = transformer.config.patch_size
    tokens = (sample.shape[-2] // patch) * (sample.shape[-1] // patch)
    shape = (sample.shape[0], tokens, transformer.inner_dim)
    return {
        "block_controlnet_hidden_states": [
            sample.new_zeros(shape, dtype=transformer.dtype) for _ in transformer.transformer_blocks
        ]
    }
