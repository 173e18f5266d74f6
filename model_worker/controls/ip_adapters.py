"""IP-Adapters (image prompts) per row of a shared UNet call: each row's image embeddings and its own scale.

diffusers' `load_ip_adapter` + `set_ip_adapter_scale` put one scale per call into the UNet's IP-Adapter attention
processors (`IPAdapterAttnProcessor2_0`), and once an IP-Adapter is loaded a call without image embeddings is
refused. Here the running set mixes requests: the IP-Adapters some row uses are loaded into the UNet together (in
the order rows first name them; restored to the base processors when no row uses one), every call passes one
embedding tensor per loaded IP-Adapter over all rows (a row's own image's embeddings, made by the IP-Adapter's image
encoder as the pipeline's `encode_image` makes them, zeros for the classifier-free-guidance negative row as the
pipeline's; zeros for a row that does not use it), and the per-row scale rides as the processors' `ip_adapter_masks`:
a mask per IP-Adapter filled, on each row, with the row's scale (the processors' own scale stays 1.0), zero on a row
that does not use it, whose image-prompt attention is then multiplied by zero: its hidden states are exactly the
base attention's.

FLUX.1's transformer (`FluxTransformer2DLoadersMixin`, XLabs' IP-Adapters) takes the image embeddings as the call's
`joint_attention_kwargs["ip_adapter_image_embeds"]` and its IP-Adapter processors (`FluxIPAdapterAttnProcessor`, one
per double block) take no masks: there the per-row scale is the processors' own scale, set for each call to a tensor
with one value per row (`scale * attention` broadcasts over the row's tokens), zero on a row that does not use the
IP-Adapter, whose block output then gains exactly zero.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Image encoders kept on the device per denoiser, as many as ControlNets (`controlnets.DEVICE_CACHE`).
ENCODER_DEVICE_CACHE = 4


@dataclass(frozen=True)
class RowImagePrompt:
    """One image's use of one IP-Adapter: its weights (model_worker.controls.loader.ControlWeights), the image
    embeddings of its model rows (`[rows, 1, dim]`: negative zeros then the image's when guided) and its scale."""

    weights: Any
    embeds: Any
    scale: float


class IPAdapterRows:
    """The IP-Adapter side of one UNet denoiser (its device thread only)."""

    def __init__(self, pipeline) -> None:
        import torch

        self._torch = torch
        self._pipeline = pipeline
        self._loaded: tuple = ()  # the keys of the IP-Adapters in the UNet now, in its order
        self._base_processors: dict | None = None
        self._encoders: OrderedDict[tuple, Any] = OrderedDict()

    def prepare(self, item, guided: bool, dtype) -> list[RowImagePrompt]:
        """An image's IP-Adapters with its image prompts embedded (diffusers' `prepare_ip_adapter_image_embeds`)."""
        torch = self._torch
        controls = getattr(item, "controls", None)
        if controls is None:
            return []
        rows = []
        for weights, use, image in zip(controls.weights(), controls.refs, item.control_images, strict=True):
            if weights.kind != "ip_adapter":
                continue
            embeds = self._embed(weights, image)  # [1 image, 1 prompt image, dim]
            if guided:
                embeds = torch.cat([torch.zeros_like(embeds), embeds])
            rows.append(RowImagePrompt(weights, embeds.to(dtype=dtype), use.scale))
        return rows

    @property
    def _denoiser(self):
        """The UNet, or FLUX.1's transformer."""
        pipeline = self._pipeline
        return pipeline.unet if hasattr(pipeline, "unet") else pipeline.transformer

    def transformer_kwargs(self, running, rows: int, dtype) -> dict:
        """FLUX.1: the transformer call's `joint_attention_kwargs` (per loaded IP-Adapter, one embedding tensor over
        the call's `rows`, padding rows zeros) with each row's scale set on the IP-Adapter processors; {} with the base
        processors back when no row uses an IP-Adapter. One row per running image (no guidance rows)."""
        torch = self._torch
        uses = self._load_used(running)
        if not uses:
            return {}
        order = {key: index for index, key in enumerate(uses)}
        embeds = [None] * len(uses)
        scales = [torch.zeros(rows, dtype=dtype) for _ in uses]  # set on the host, moved once
        for row, r in enumerate(running):
            for prompt in r.state.get("image_prompts", ()):
                index = order[prompt.weights.key]
                if embeds[index] is None:
                    embeds[index] = prompt.embeds.new_zeros((rows, *prompt.embeds.shape[1:]))
                embeds[index][row : row + 1] = prompt.embeds
                scales[index][row] = prompt.scale
        device = self._denoiser.device
        per_row = [scale.to(device).view(-1, 1, 1) for scale in scales]
        for processor in self._denoiser.attn_processors.values():
            if hasattr(processor, "to_k_ip"):
                processor.scale = per_row
        return {"joint_attention_kwargs": {"ip_adapter_image_embeds": embeds}}

    def _load_used(self, running) -> OrderedDict[tuple, Any]:
        """The IP-Adapters the rows' image prompts name, in the order first named, loaded (the base processors back
        when none is)."""
        uses: OrderedDict[tuple, Any] = OrderedDict()
        for r in running:
            for prompt in r.state.get("image_prompts", ()):
                uses.setdefault(prompt.weights.key, prompt.weights)
        self.load(list(uses.values()))
        return uses

    def call_kwargs(self, running, inputs, sample) -> dict:
        """The UNet call's `added_cond_kwargs` (image embeddings per loaded IP-Adapter, over all rows) and
        `cross_attention_kwargs` (the per-row scales as masks); {} with the base processors back when no row uses
        an IP-Adapter."""
        uses = self._load_used(running)
        if not uses:
            return {}
        order = {key: index for index, key in enumerate(uses)}
        rows, height, width = sample.shape[0], sample.shape[2], sample.shape[3]
        embeds = [None] * len(uses)
        masks = [sample.new_zeros((rows, 1, height, width)) for _ in uses]
        offset = 0
        for r, x in zip(running, inputs, strict=True):
            count = x.shape[0]
            for prompt in r.state.get("image_prompts", ()):
                index = order[prompt.weights.key]
                if embeds[index] is None:
                    embeds[index] = prompt.embeds.new_zeros((rows, *prompt.embeds.shape[1:]))
                embeds[index][offset : offset + count] = prompt.embeds
                masks[index][offset : offset + count] = prompt.scale
            offset += count
        return {"added_cond_kwargs": {"image_embeds": embeds}, "cross_attention_kwargs": {"ip_adapter_masks": masks}}

    def pipeline_arguments(self, runner, items: list, guided: bool) -> dict:
        """`scheduling: request`: one pipeline call over items whose requests use the same IP-Adapters at the same
        scales: loads them (none: the base processors), sets their scales (`set_ip_adapter_scale`) and hands their
        image embeddings over as `ip_adapter_image_embeds` (negative rows first when guided, as the pipeline's;
        FLUX.1's pipelines take one image's a call, without negative rows)."""
        torch = self._torch
        uses = [[(weights, ref.scale, image) for weights, ref, image in zip(item.controls.weights(), item.controls.refs,
                 item.control_images, strict=True) if weights.kind == "ip_adapter"] if item.controls else []
                for item in items]  # fmt: skip
        self.load([weights for weights, _, _ in uses[0]])
        if not uses[0]:
            return {}
        runner.set_ip_adapter_scale([scale for _, scale, _ in uses[0]])
        dtype = self._denoiser.dtype
        embeds = []
        for index in range(len(uses[0])):
            positive = torch.cat([self._embed(use[index][0], use[index][2]) for use in uses]).to(dtype=dtype)
            embeds.append(torch.cat([torch.zeros_like(positive), positive]) if guided else positive)
        if not hasattr(self._pipeline, "unet"):
            # FLUX.1's pipelines encode a black image as the negative image prompt unless given one; it serves true
            # classifier-free guidance only (not served here), so zeros stand in for it.
            return {"ip_adapter_image_embeds": embeds,
                    "negative_ip_adapter_image_embeds": [torch.zeros_like(e) for e in embeds]}  # fmt: skip
        return {"ip_adapter_image_embeds": embeds}

    def _embed(self, weights, image):
        """`encode_image`'s embeddings of one image prompt: `[1, 1, dim]`."""
        encoder, features = self._encoder(weights)
        pixels = features(image, return_tensors="pt").pixel_values
        pixels = pixels.to(device=self._pipeline._execution_device, dtype=next(encoder.parameters()).dtype)
        return encoder(pixels).image_embeds[None, :]

    def load(self, adapters: list) -> None:
        """The UNet's processors for exactly these IP-Adapters (none: the base processors), changed only when the
        set changes."""
        keys = tuple(weights.key for weights in adapters)
        if keys == self._loaded:
            return
        denoiser = self._denoiser
        if self._base_processors is None:
            self._base_processors = dict(denoiser.attn_processors)
        if adapters:
            denoiser._load_ip_adapter_weights([weights.state_dict for weights in adapters], low_cpu_mem_usage=False)
        else:
            denoiser.set_attn_processor(dict(self._base_processors))
            denoiser.encoder_hid_proj = None
            denoiser.config.encoder_hid_dim_type = None
        self._loaded = keys

    def _encoder(self, weights) -> tuple[Any, Any]:
        """The IP-Adapter's image encoder on the denoiser's device, and the image processor the pipeline uses (its
        `feature_extractor`, or the one `load_ip_adapter` makes for the encoder's image size)."""
        key = weights.key
        if key in self._encoders:
            self._encoders.move_to_end(key)
        else:
            from transformers import CLIPImageProcessor

            denoiser = self._denoiser
            encoder = weights.model.to(device=denoiser.device, dtype=denoiser.dtype)
            features = getattr(self._pipeline, "feature_extractor", None)
            if features is None:
                size = encoder.config.image_size
                features = CLIPImageProcessor(size=size, crop_size=size)
            self._encoders[key] = (encoder, features)
            while (
                len(self._encoders) > ENCODER_DEVICE_CACHE
            ):  # the least recently used encoder moved back off the device
                _, (dropped, _) = self._encoders.popitem(last=False)
                dropped.to("cpu")
        return self._encoders[key]
