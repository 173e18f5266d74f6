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

A compiled denoiser (`ModelSpec.image_prompt_slots`) is never given new processors: that would compile it again. Before
it is compiled, its IP-Adapter processors and image projection are made with `max_image_prompts_per_request` slots of
the catalog's shape (`controls.image_prompt_slots`), weights zero, and every call passes every slot's embeddings and
per-row scales (zeros on rows that do not use it), so the warm-up traces the graph every call then takes, with an image
prompt or without. An IP-Adapter is copied into a slot in place (the slot's tensors keep their identity) when a row
first needs it; one of another shape is refused with its request (`prepare`). When the running set's rows use more
IP-Adapters than there are slots, the call is repeated, each pass with the slots holding one group's IP-Adapters, each
row's output taken from its group's pass (the model's rows are independent): the same graph, no new one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from contract.control_files import slots_problem

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

    def __init__(self, pipeline, slots=None, count: int = 0, model: str = "") -> None:
        """`slots` (contract.model_spec.ImagePromptSlots): a compiled denoiser's slot shape, `count` slots made here
        (before it is compiled) for `model`; None: IP-Adapters swap the denoiser's processors (an eager model)."""
        import torch

        self._torch = torch
        self._pipeline = pipeline
        self._loaded: tuple = ()  # the keys of the IP-Adapters in the UNet now, in its order
        self._base_processors: dict | None = None
        self._encoders: OrderedDict[tuple, Any] = OrderedDict()
        self._model = model
        self.slots = slots
        self._slot_keys: list[tuple | None] = [None] * count  # slot -> the IP-Adapter it holds
        if slots is not None:
            self._make_slots(count)

    def prepare(self, item, guided: bool, dtype) -> list[RowImagePrompt]:
        """An image's IP-Adapters with its image prompts embedded (diffusers' `prepare_ip_adapter_image_embeds`);
        ValueError (its request fails alone) for one that does not fit a compiled denoiser's slots."""
        torch = self._torch
        controls = getattr(item, "controls", None)
        if controls is None:
            return []
        rows = []
        for weights, use, image in zip(controls.weights(), controls.refs, item.control_images, strict=True):
            if weights.kind != "ip_adapter":
                continue
            self._check_fits(weights)
            embeds = self._embed(weights, image)  # [1 image, 1 prompt image, dim]
            if guided:
                embeds = torch.cat([torch.zeros_like(embeds), embeds])
            rows.append(RowImagePrompt(weights, embeds.to(dtype=dtype), use.scale))
        if self.slots is not None and len({row.weights.key for row in rows}) > len(self._slot_keys):
            raise ValueError(f"{self._model} is compiled with {len(self._slot_keys)} IP-Adapter slots: at most that many "
                             "IP-Adapters a request (controls.max_image_prompts_per_request)")  # fmt: skip
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

    # --- a compiled denoiser's slots ---------------------------------------------------------------------------

    def _make_slots(self, count: int) -> None:
        """The IP-Adapter processors and image projection of `count` slots of the catalog's shape, weights zero (as
        diffusers' own `_load_ip_adapter_weights` makes them), in the denoiser before it is compiled."""
        torch, denoiser, slots = self._torch, self._denoiser, self.slots
        text = self._text_width()
        flux = not hasattr(self._pipeline, "unet")
        if not flux and slots.tokens != 4:
            raise ValueError(f"{self._model}: a UNet's plain IP-Adapters make 4 image tokens, not {slots.tokens} "
                             "(controls.image_prompt_slots.tokens)")  # fmt: skip
        projection = {"proj.weight": torch.zeros(slots.tokens * text, slots.embedding_width),
                      "proj.bias": torch.zeros(slots.tokens * text), "norm.weight": torch.ones(text),
                      "norm.bias": torch.zeros(text)}  # fmt: skip
        layers = {}
        self._attentions = self._cross_attentions()
        for index, attention in enumerate(self._attentions):
            number = index if flux else 2 * index + 1  # diffusers' numbering of the pairs
            shape = (denoiser.inner_dim, text) if flux else tuple(attention.to_k.weight.shape)
            for part in ("to_k_ip", "to_v_ip"):
                layers[f"{number}.{part}.weight"] = torch.zeros(shape)
                if flux:
                    layers[f"{number}.{part}.bias"] = torch.zeros(shape[0])
        denoiser._load_ip_adapter_weights([{"image_proj": projection, "ip_adapter": layers}] * count,
                                          low_cpu_mem_usage=False)  # fmt: skip
        if flux:  # `_load_ip_adapter_weights` moves a UNet to its dtype and device, not a transformer's projection
            denoiser.encoder_hid_proj.to(device=denoiser.device, dtype=denoiser.dtype)

    def _text_width(self) -> int:
        config = self._denoiser.config
        return config.get("cross_attention_dim") or config["joint_attention_dim"]

    def _cross_attentions(self) -> list:
        """The attention modules that take image prompts, in diffusers' order: a UNet's cross-attention (attn2)
        layers, FLUX.1's double blocks."""
        denoiser = self._denoiser
        names = [name.removesuffix(".processor") for name in denoiser.attn_processors]
        if hasattr(self._pipeline, "unet"):
            names = [name for name in names if not name.endswith("attn1") and "motion_modules" not in name]
        else:
            names = [name for name in names if not name.startswith("single_transformer_blocks")]
        return [denoiser.get_submodule(name) for name in names]

    def _check_fits(self, weights) -> None:
        if self.slots is None:
            return
        rows, width = weights.state_dict["image_proj"]["proj.weight"].shape
        problem = slots_problem(self._model, int(width), int(rows) // self._text_width(), self.slots.embedding_width,
                                self.slots.tokens)  # fmt: skip
        if problem is not None:
            raise ValueError(f"{weights.name}: {problem}")

    def _copy_into(self, slot: int, weights) -> None:
        """The IP-Adapter's weights copied into the slot's tensors, in place (the slot held nothing known meanwhile)."""
        self._slot_keys[slot] = None
        state = weights.state_dict
        denoiser = self._denoiser
        projection = denoiser.encoder_hid_proj.image_projection_layers[slot]
        projection.load_state_dict({key.replace("proj", "image_embeds"): value
                                    for key, value in state["image_proj"].items()})  # fmt: skip
        flux = not hasattr(self._pipeline, "unet")
        for index, attention in enumerate(self._attentions):
            number = index if flux else 2 * index + 1
            processor = attention.processor
            for part in ("to_k_ip", "to_v_ip"):
                layer = getattr(processor, part)[slot]
                layer.weight.copy_(state["ip_adapter"][f"{number}.{part}.weight"])
                if flux:
                    layer.bias.copy_(state["ip_adapter"][f"{number}.{part}.bias"])
        self._slot_keys[slot] = weights.key

    def _groups(self, running) -> list[tuple[list, list[int]]]:
        """The running set's IP-Adapters in groups that fit the slots, each with its images (indexes into
        `running`), first fit in the rows' order; one empty group when no row has an image prompt."""
        count = len(self._slot_keys)
        groups: list[tuple[OrderedDict, list[int]]] = []
        for index, r in enumerate(running):
            mine = OrderedDict((p.weights.key, p.weights) for p in r.state.get("image_prompts", ()))
            if not mine:
                continue
            for adapters, members in groups:
                if len(adapters.keys() | mine.keys()) <= count:
                    adapters.update(mine)
                    members.append(index)
                    break
            else:
                groups.append((mine, [index]))
        return [(list(adapters.values()), members) for adapters, members in groups] or [([], [])]

    def _fill(self, adapters: list) -> dict[tuple, int]:
        """The slots holding these IP-Adapters (those already in one stay; the others copied into the slots no
        IP-Adapter of the group holds): IP-Adapter key -> slot."""
        wanted = {weights.key for weights in adapters}
        free = [slot for slot, key in enumerate(self._slot_keys) if key not in wanted]
        for weights in adapters:
            if weights.key not in self._slot_keys:
                self._copy_into(free.pop(0), weights)
        return {key: slot for slot, key in enumerate(self._slot_keys) if key in wanted}

    def unet_passes(self, running, inputs, sample) -> Iterator[tuple[dict, list | None]]:
        """A compiled UNet's calls (`run_passes`): per pass, its `added_cond_kwargs` (every slot's image embeddings over
        all rows, zeros where a row does not use it) and `cross_attention_kwargs` (every slot's per-row scale mask),
        with the row spans it answers (None: all rows, the first pass)."""
        rows, height, width = sample.shape[0], sample.shape[2], sample.shape[3]
        spans, offset = [], 0
        for x in inputs:
            spans.append((offset, offset + x.shape[0]))
            offset += x.shape[0]
        for number, (adapters, members) in enumerate(self._groups(running)):
            slot_of = self._fill(adapters)
            embeds = [sample.new_zeros((rows, 1, self.slots.embedding_width)) for _ in self._slot_keys]
            masks = [sample.new_zeros((rows, 1, height, width)) for _ in self._slot_keys]
            for index in members:
                start, stop = spans[index]
                for prompt in running[index].state["image_prompts"]:
                    slot = slot_of[prompt.weights.key]
                    embeds[slot][start:stop] = prompt.embeds
                    masks[slot][start:stop] = prompt.scale
            kwargs = {"added_cond_kwargs": {"image_embeds": embeds},
                      "cross_attention_kwargs": {"ip_adapter_masks": masks}}  # fmt: skip
            yield kwargs, None if number == 0 else [spans[index] for index in members]

    def transformer_passes(self, running, rows: int, dtype) -> Iterator[tuple[dict, list | None]]:
        """A compiled FLUX.1 transformer's calls (`run_passes`): per pass, its `joint_attention_kwargs` (every slot's
        image embeddings over the call's `rows`, zeros where a row does not use it) with each slot's per-row scale
        set on the processors (zero on such a row), and the rows it answers (None: all, the first pass)."""
        torch = self._torch
        device = self._denoiser.device
        processors = [attention.processor for attention in self._attentions]
        for number, (adapters, members) in enumerate(self._groups(running)):
            slot_of = self._fill(adapters)
            embeds = [torch.zeros((rows, 1, self.slots.embedding_width), dtype=dtype, device=device)
                      for _ in self._slot_keys]  # fmt: skip
            scales = [torch.zeros(rows, dtype=dtype) for _ in self._slot_keys]  # set on the host, moved once
            for index in members:
                for prompt in running[index].state["image_prompts"]:
                    slot = slot_of[prompt.weights.key]
                    embeds[slot][index : index + 1] = prompt.embeds
                    scales[slot][index] = prompt.scale
            per_row = [scale.to(device).view(-1, 1, 1) for scale in scales]
            for processor in processors:
                processor.scale = per_row
            kwargs = {"joint_attention_kwargs": {"ip_adapter_image_embeds": embeds}}
            yield kwargs, None if number == 0 else [(index, index + 1) for index in members]

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


def run_passes(passes: Iterator[tuple[dict, list | None]], call: Callable[[dict], Any]):
    """The model's output over all rows from a compiled denoiser's passes (`IPAdapterRows.unet_passes`,
    `transformer_passes`): the first pass's, with each later pass's own rows copied over it."""
    output = None
    for kwargs, spans in passes:
        predicted = call(kwargs)
        if output is None:
            output = predicted
            continue
        for start, stop in spans:
            output[start:stop] = predicted[start:stop]
    return output
