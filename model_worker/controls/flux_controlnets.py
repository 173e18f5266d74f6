"""FLUX.1 ControlNets per row of a shared transformer call: each `FluxControlNetModel` runs once per step over the
rows that use it, its block and single-block residuals scaled per row and added to those rows only.

diffusers' `FluxControlNetPipeline` runs one ControlNet (or a `FluxMultiControlNetModel`, whose residuals it sums)
over the whole batch with one scale per call. Here, as for the UNet families (controlnets.py), each image keeps its
own ControlNets, scales and `start`/`end` windows: an image's control image is encoded as the pipeline encodes it
(resized, the VAE's latents sampled from the image's own generator before its noise is drawn, shifted, scaled and
packed 2x2 into tokens; an XLabs-style ControlNet with its own `input_hint_block` takes the pixels), the ControlNet
runs over the rows that use it at scale 1 (the guidance it embeds when its config says so, as the pipeline gives
it), and each row's residuals are multiplied by its scale times its window's keep and added into zeros for the
whole call. The transformer adds the i-th residual to each block `i // interval` (or `i % n` with
`controlnet_blocks_repeat`), so ControlNets of different depths in one call are spread to one residual per block
first. A row without control gets zeros (x + 0 is x); a call where no row has one passes no residuals at all. A
compiled transformer gets one residual per block whatever ControlNets run, always the same graph's inputs, which its
warm-up traces with zeros (`zero_flux_residuals`), so the first ControlNet compiles nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from model_worker.controls.controlnets import ControlNetRows, RowControl


class FluxControlNetRows(ControlNetRows):
    """The ControlNet side of one FLUX.1 denoiser: control tokens prepared per image, residuals per shared call."""

    def prepare(self, item, generator, height: int, width: int, dtype) -> list[RowControl]:
        """An image's ControlNets with their control inputs as `FluxControlNetPipeline` makes them, drawing from the
        image's generator in the pipeline's order (each ControlNet's image, then the latents)."""
        from diffusers.pipelines.flux.pipeline_flux_controlnet import retrieve_latents

        controls = getattr(item, "controls", None)
        if controls is None:
            return []
        pipe = self._pipeline
        device, vae = pipe._execution_device, pipe.vae
        rows = []
        for weights, use, image in zip(controls.weights(), controls.refs, item.control_images, strict=True):
            if weights.kind != "controlnet":
                continue
            prepared = pipe.image_processor.preprocess(image, height=height, width=width)
            prepared = prepared.to(device=device, dtype=vae.dtype)
            if weights.model.input_hint_block is None:  # InstantX's: the VAE's packed latents
                latents = retrieve_latents(vae.encode(prepared), generator=[generator])
                latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
                prepared = pipe._pack_latents(latents, 1, latents.shape[1], latents.shape[2], latents.shape[3])
            rows.append(RowControl(weights, prepared.to(dtype=dtype), use.scale, use.start, use.end, use.mode))
        return rows

    def flux_residuals(self, running, inputs: dict, guidance, every_block: bool = False) -> dict:
        """The transformer's `controlnet_block_samples`, `controlnet_single_block_samples` and
        `controlnet_blocks_repeat` for the call's `inputs` (its hidden states may be padded past the running set's
        rows: those get zeros); {} when no row has a ControlNet. `guidance`: each running row's guidance scale (a
        float32 tensor on the device), which a ControlNet that embeds guidance takes as the pipeline gives it.
        `every_block` (a compiled transformer): always one residual per block and per single block, never
        repeated, the shapes `zero_flux_residuals` gives whatever ControlNets run."""
        torch = self._torch
        uses: OrderedDict[tuple, list[tuple[int, Any, float]]] = OrderedDict()
        for offset, r in enumerate(running):
            steps = len(r.state["step_timesteps"])
            for control in r.state.get("controlnets", ()):
                scale = control.scale * control.keep(r.done, steps)
                uses.setdefault(control.weights.key, []).append((offset, control, scale))
        if not uses:
            return {}
        hidden = inputs["hidden_states"]
        outputs = []
        for rows in uses.values():
            model = self._model(rows[0][1].weights)
            index = torch.tensor([offset for offset, _, _ in rows], device=hidden.device)
            embedded = guidance[index.to(guidance.device)] if model.config.guidance_embeds else None
            # A Union's mode is a token before the text, per row: rows in other modes share its call.
            mode = (
                torch.tensor([[control.mode] for _, control, _ in rows], device=hidden.device) if model.union else None
            )
            blocks, singles = model(
                hidden_states=hidden[index], controlnet_cond=torch.cat([control.image for _, control, _ in rows]),
                controlnet_mode=mode, conditioning_scale=1.0, timestep=inputs["timestep"][index], guidance=embedded,
                pooled_projections=inputs["pooled_projections"][index],
                encoder_hidden_states=inputs["encoder_hidden_states"][index], txt_ids=inputs["txt_ids"],
                img_ids=inputs["img_ids"], return_dict=False,
            )  # fmt: skip
            scales = torch.tensor([scale for _, _, scale in rows], dtype=hidden.dtype, device=hidden.device)
            outputs.append((index, scales.view(-1, 1, 1), list(blocks or ()), list(singles or ()),
                            model.input_hint_block is not None))  # fmt: skip
        layouts = {(len(blocks), len(singles), repeat) for _, _, blocks, singles, repeat in outputs}
        transformer = self._pipeline.transformer
        spread = every_block or len(layouts) > 1
        if spread:  # one residual per block of the transformer, as it would pick each ControlNet's
            depth = (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))
            outputs = [(index, scales, per_block(blocks, depth[0], repeat), per_block(singles, depth[1], False), False)
                       for index, scales, blocks, singles, repeat in outputs]  # fmt: skip
        totals: tuple[list, list] = ([], [])
        if every_block:
            zeros = zero_flux_residuals(transformer, hidden)
            totals = (zeros["controlnet_block_samples"], zeros["controlnet_single_block_samples"])
        for index, scales, blocks, singles, _ in outputs:
            for total, samples in zip(totals, (blocks, singles), strict=True):
                if not total:
                    total += [hidden.new_zeros((hidden.shape[0], *s.shape[1:]), dtype=s.dtype) for s in samples]
                for summed, sample in zip(total, samples, strict=False):  # none: a ControlNet without single blocks
                    summed.index_add_(0, index, sample * scales)
        return {
            "controlnet_block_samples": totals[0] or None,
            "controlnet_single_block_samples": totals[1] or None,
            "controlnet_blocks_repeat": False if spread else outputs[0][4],
        }


def per_block(samples: list, blocks: int, repeat: bool) -> list:
    """A ControlNet's residuals as the transformer adds them, one per block: the `i // interval`-th (`i % n` when
    repeated, XLabs' ControlNets); none when it has none."""
    if not samples:
        return []
    interval = math.ceil(blocks / len(samples))
    return [samples[i % len(samples)] if repeat else samples[i // interval] for i in range(blocks)]


def zero_flux_residuals(transformer, hidden) -> dict:
    """Zero residuals for every block and single block of a FLUX.1 transformer over `hidden` (its packed latents),
    in the transformer's dtype: what a compiled transformer of a model that takes ControlNets is called with in its
    warm-up, so the graph ControlNets use is traced before any arrives (its calls without one pass none: these would
    hold as much memory as the residuals, 57 blocks' of FLUX.1's hidden states). x + 0 is x."""
    shape = (hidden.shape[0], hidden.shape[1], transformer.inner_dim)
    dtype = transformer.dtype
    return {
        "controlnet_block_samples": [hidden.new_zeros(shape, dtype=dtype) for _ in transformer.transformer_blocks],
        "controlnet_single_block_samples": [
            hidden.new_zeros(shape, dtype=dtype) for _ in transformer.single_transformer_blocks
        ],
        "controlnet_blocks_repeat": False,
    }
