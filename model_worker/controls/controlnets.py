"""ControlNets per row of a shared UNet call: each control model runs once per step over the rows that use it,
its residuals scaled per row and added to those rows only.

diffusers' `StableDiffusionControlNetPipeline` runs one ControlNet (or a `MultiControlNetModel`, whose residuals it
sums) over the whole batch with one scale per call. Here the running set mixes requests: a row's ControlNets are its
request's, at its own scale, inside its own `start`/`end` window at its own step (diffusers' `controlnet_keep`). For
every ControlNet some row uses, the rows that use it are gathered (both classifier-free-guidance rows of an image,
each with the image's control image, as the pipeline doubles them), the model runs once over them at scale 1, each
row's residuals are multiplied by its scale times its window's keep (the pipeline's `conditioning_scale`, applied as
the model applies it: one multiplication), and added into zero residuals for the whole call, in the request's order
(the pipeline's sum for several). A row without control gets zeros added (x + 0 is x exactly); a call where no row
has one passes no residuals at all: the base model's call.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# ControlNets kept on the device per denoiser (least recently used moved back off).
DEVICE_CACHE = 4
# Added to an image's seed for the generator its SD 3.5 control images' latents are sampled from
# (sd3_controlnets.py): another stream than its noise's (the image's seed) and the next image's (seed + 1).
CONTROL_NOISE_SEED = 0x5D3_C0_17
# SDXL's `added_cond_kwargs`, which its ControlNets take as its UNet does.
ADDED_CONDITIONS = ("text_embeds", "time_ids")


@dataclass(frozen=True)
class RowControl:
    """One image's use of one ControlNet: the model (model_worker.controls.loader.ControlWeights), its control image
    as the pipeline prepares it (one row per model row of the image), its scale and window."""

    weights: Any
    image: Any
    scale: float
    start: float
    end: float
    mode: int | None = None  # a ControlNet Union's control mode

    def keep(self, step: int, steps: int) -> float:
        """diffusers' `controlnet_keep`: 1 inside the window at this step of the image's schedule, else 0."""
        return 1.0 - float(step / steps < self.start or (step + 1) / steps > self.end)


class ControlNetRows:
    """The ControlNet side of one UNet denoiser: control images prepared per image, residuals per shared call."""

    def __init__(self, pipeline, device_cache: int = DEVICE_CACHE) -> None:
        import torch
        from diffusers.image_processor import VaeImageProcessor

        self._torch = torch
        self._pipeline = pipeline
        # The ControlNet pipeline's own `control_image_processor`: RGB, resized, in [0, 1] (not normalised).
        self._processor = VaeImageProcessor(vae_scale_factor=pipeline.vae_scale_factor, do_convert_rgb=True,
                                            do_normalize=False)  # fmt: skip
        self._on_device: OrderedDict[tuple, Any] = OrderedDict()
        self._device_cache = device_cache

    def prepare(self, item, guided: bool, height: int, width: int, dtype) -> list[RowControl]:
        """An image's ControlNets with their control images as the pipeline's `prepare_image` makes them."""
        controls = getattr(item, "controls", None)
        if controls is None:
            return []
        rows = []
        device = self._pipeline._execution_device
        for weights, use, image in zip(controls.weights(), controls.refs, item.control_images, strict=True):
            if weights.kind != "controlnet":
                continue
            prepared = self._processor.preprocess(image, height=height, width=width).to(dtype=self._torch.float32)
            prepared = prepared.to(device=device, dtype=dtype)
            if guided:
                prepared = self._torch.cat([prepared] * 2)
            rows.append(RowControl(weights, prepared, use.scale, use.start, use.end, use.mode))
        return rows

    def residuals(self, running, inputs, sample, timestep, condition: dict) -> dict:
        """The UNet's `down_block_additional_residuals` and `mid_block_additional_residual` for the call's rows
        (`sample` may be padded past the running set's rows: those get zeros); {} when no row has a ControlNet.
        `condition`: the call's conditioning rows, the context and, for SDXL, the pooled embeddings and time ids the
        ControlNet takes as the UNet does (`added_cond_kwargs`)."""
        torch = self._torch
        uses: OrderedDict[tuple, list[tuple[int, int, Any, float]]] = OrderedDict()
        offset = 0
        for r, x in zip(running, inputs, strict=True):
            count = x.shape[0]
            steps = len(r.state["step_timesteps"])
            for control in r.state.get("controlnets", ()):
                scale = control.scale * control.keep(r.done, steps)
                # A Union runs once per mode: its call takes one control type for all its rows.
                uses.setdefault((control.weights.key, control.mode), []).append((offset, count, control, scale))
            offset += count
        if not uses:
            return {}
        down: list | None = None
        mid = None
        for rows in uses.values():
            model = self._model(rows[0][2].weights)
            index = torch.cat([torch.arange(start, start + count) for start, count, _, _ in rows]).to(sample.device)
            images = torch.cat([control.image for _, _, control, _ in rows])
            scales = torch.cat([torch.full((count,), scale, dtype=sample.dtype) for _, count, _, scale in rows])
            scales = scales.to(sample.device)
            added = {key: condition[key][index] for key in ADDED_CONDITIONS if key in condition}
            union = {}
            if is_union(model):  # as StableDiffusionXLControlNetUnionPipeline: the mode one-hot, one condition
                mode = rows[0][2].mode
                control_type = torch.zeros(len(index), model.config.num_control_type, device=sample.device,
                                           dtype=condition["context"].dtype)  # fmt: skip
                control_type[:, mode] = 1
                union = {"control_type": control_type, "control_type_idx": [mode]}
                images = [images]
            # An inpainting UNet's rows carry the mask and the masked image's latents after the latents; its
            # ControlNet takes the latents alone (the inpaint pipeline's `control_model_input`).
            down_rows, mid_rows = model(
                sample[index, : model.config.in_channels], timestep[index], encoder_hidden_states=condition["context"][index],
                controlnet_cond=images, conditioning_scale=1.0, return_dict=False,
                **({"added_cond_kwargs": added} if added else {}), **union,
            )  # fmt: skip
            if down is None:
                down = [torch.zeros_like(sample[:1]).new_zeros((sample.shape[0], *d.shape[1:])) for d in down_rows]
                mid = mid_rows.new_zeros((sample.shape[0], *mid_rows.shape[1:]))
            for total, part in zip(down, down_rows, strict=True):
                total.index_add_(0, index, part * scales.view(-1, 1, 1, 1))
            mid.index_add_(0, index, mid_rows * scales.view(-1, 1, 1, 1))
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}

    def _model(self, weights):
        """The ControlNet on the denoiser's device and dtype (moved there once, on this thread)."""
        key = weights.key
        if key in self._on_device:
            self._on_device.move_to_end(key)
            return self._on_device[key]
        pipe = self._pipeline
        denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
        model = weights.model.to(device=denoiser.device, dtype=denoiser.dtype)
        self._on_device[key] = model
        while len(self._on_device) > self._device_cache:
            _, dropped = self._on_device.popitem(last=False)
            dropped.to("cpu")
        return model


def pipeline_call(pipeline, items, kwargs: dict) -> list:
    """`scheduling: request`: diffusers' own pipelines for one batch, whose requests may use different ControlNets.
    diffusers takes one set of ControlNets, scales and windows per call, so the batch's images are grouped by what
    their requests use: the group without any runs the base pipeline, each other group
    `StableDiffusionControlNetPipeline` over the same components with its ControlNet (several: a
    `MultiControlNetModel`, the images per request; SDXL's and FLUX's take one image's control images per call, so
    there an image with several ControlNets is a call of its own; SD 3.5's samples its control latents from torch's
    global generator, so there each controlled image is a call of its own, that generator seeded as the image's
    steps seed theirs, sd3_controlnets.py). The images, in the items' order."""
    groups: OrderedDict[tuple, list[int]] = OrderedDict()
    one_by_one = type(pipeline).__name__ not in MULTI_CONTROLNET_BATCHES
    seeded = type(pipeline).__name__ in SEEDED_CONTROL_LATENTS
    for index, item in enumerate(items):
        key = _call_key(item)
        # SDXL's Union pipeline takes one image's control images per call too.
        union = any(is_union(weights.model) for weights, _, _ in _controlnets(item))
        alone = (index,) if (one_by_one and (len(key) > 1 or union)) or (seeded and key) else ()
        if image_prompts_key(item) and type(pipeline).__name__ == "FluxPipeline":  # FLUX.1: one image prompt a call
            alone = (index,)
        groups.setdefault((key, image_prompts_key(item), *alone), []).append(index)
    if len(groups) == 1 and ((), ()) in groups:
        ip_adapters(pipeline).load([])
        return list(pipeline(**kwargs).images)
    images: list = [None] * len(items)
    for (key, _prompts, *alone), indices in groups.items():
        call = {name: ([value[i] for i in indices] if isinstance(value, list) and len(value) == len(items) else value)
                for name, value in kwargs.items()}  # fmt: skip
        runner = pipeline
        if key:
            runner, control = _controlnet_pipeline(pipeline, items[indices[0]])
            call.update(control)
            images_of = _control_images(items, indices, len(key))
            # The ControlNet pipelines that take an `image` to start from (or none, FLUX.1's and the Union's) take
            # the control images as `control_image`.
            argument = "control_image" if "control_image" in inspect.signature(runner.__call__).parameters else "image"
            call[argument] = images_of[0] if alone else images_of
            if "image" in call and "height" not in call:  # image-to-image: control images made at the output's size
                call["height"], call["width"] = _output_size(pipeline, items[indices[0]].image)
        # diffusers' `load_ip_adapter` + `set_ip_adapter_scale`: the group's IP-Adapters in the UNet at their scales
        # (none: the base processors), their image embeddings made as the pipeline makes them.
        # FLUX.1's guidance is embedded: no negative image rows.
        guided = call.get("guidance_scale", 1.0) > 1 and hasattr(pipeline, "unet")
        call.update(ip_adapters(pipeline).pipeline_arguments(runner, [items[i] for i in indices], guided))
        with _seeded(pipeline, items[indices[0]].seed if seeded and key else None):
            outputs = runner(**call).images
        for index, image in zip(indices, outputs, strict=True):
            images[index] = image
    return images


@contextmanager
def _seeded(pipeline, seed: int | None):
    """torch's global generators (the CPU's and the pipeline's device's) seeded with an image's control seed for a
    call, then restored; nothing when `seed` is None."""
    if seed is None:
        yield
        return
    import torch

    device = pipeline._execution_device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(control_noise_seed(seed))
        yield


def control_noise_seed(seed: int) -> int:
    """The seed of the generator an image's SD 3.5 control latents are sampled from."""
    return (seed + CONTROL_NOISE_SEED) % 2**63


def _controlnets(item) -> list[tuple[Any, Any, Any]]:
    """The item's ControlNets: (weights, ref, control image) in its request's order."""
    controls = getattr(item, "controls", None)
    if controls is None:
        return []
    return [(weights, ref, image) for weights, ref, image in zip(controls.weights(), controls.refs,
            item.control_images, strict=True) if weights.kind == "controlnet"]  # fmt: skip


def _call_key(item) -> tuple:
    return tuple((weights.key, ref.scale, ref.start, ref.end, ref.mode) for weights, ref, _ in _controlnets(item))


def is_union(model) -> bool:
    """Whether a ControlNet is SDXL's ControlNet Union (`ControlNetUnionModel`: control types, one per mode)."""
    return type(model).__name__ == "ControlNetUnionModel"


def image_prompts_key(item) -> tuple:
    controls = getattr(item, "controls", None)
    if controls is None:
        return ()
    return tuple((weights.key, ref.scale) for weights, ref in zip(controls.weights(), controls.refs, strict=True)
                 if weights.kind == "ip_adapter")  # fmt: skip


def ip_adapters(pipeline):
    """The pipeline's IP-Adapter rows (model_worker/controls/ip_adapters.py), made once per pipeline."""
    from model_worker.controls.ip_adapters import IPAdapterRows

    rows = getattr(pipeline, "_maas_ip_adapters", None)
    if rows is None:
        rows = IPAdapterRows(pipeline)
        pipeline._maas_ip_adapters = rows
    return rows


def _output_size(pipeline, image) -> tuple[int, int]:
    """An image-to-image item's output height and width: its input image's (resized to the request's size at intake),
    or a flow's latents' times the VAE's scale."""
    if hasattr(image, "shape"):
        return image.shape[-2] * pipeline.vae_scale_factor, image.shape[-1] * pipeline.vae_scale_factor
    return image.height, image.width


def _control_images(items, indices: list[int], count: int) -> list:
    if count == 1:
        return [_controlnets(items[i])[0][2] for i in indices]
    return [[image for _, _, image in _controlnets(items[i])] for i in indices]  # per image, its ControlNets' images


# The ControlNet pipeline of each base pipeline, and the arguments it takes beyond the components.
CONTROLNET_PIPELINES = {
    "StableDiffusionPipeline": "StableDiffusionControlNetPipeline",
    "StableDiffusionImg2ImgPipeline": "StableDiffusionControlNetImg2ImgPipeline",
    "StableDiffusionInpaintPipeline": "StableDiffusionControlNetInpaintPipeline",
    "StableDiffusionXLPipeline": "StableDiffusionXLControlNetPipeline",
    "FluxPipeline": "FluxControlNetPipeline",
    "StableDiffusion3Pipeline": "StableDiffusion3ControlNetPipeline",
}

# The base pipelines whose ControlNet pipeline takes a batch of images with several ControlNets (SDXL's refuses "a
# single batch of multiple conditionings").
MULTI_CONTROLNET_BATCHES = ("StableDiffusionPipeline",)
# The base pipelines whose ControlNet pipeline samples the control images' latents from torch's global generator.
SEEDED_CONTROL_LATENTS = ("StableDiffusion3Pipeline",)


def _controlnet_pipeline(pipeline, item) -> tuple[Any, dict]:
    """The ControlNet pipeline over the base pipeline's components and the item's ControlNets, and its arguments."""
    import diffusers
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    uses = _controlnets(item)
    base = type(pipeline).__name__
    if base not in CONTROLNET_PIPELINES:
        raise ValueError(f"{base} serves no ControlNet in scheduling: request")
    denoiser = pipeline.unet if hasattr(pipeline, "unet") else pipeline.transformer
    models = [weights.model.to(device=denoiser.device, dtype=denoiser.dtype) for weights, _, _ in uses]
    single = len(models) == 1
    refs = [ref for _, ref, _ in uses]
    modes = [ref.mode for ref in refs]
    if any(is_union(model) for model in models):  # SDXL's Union: its own pipeline, one Union and one mode a call
        if not single:
            raise ValueError("a ControlNet Union beside other ControlNets runs in scheduling: step only")
        components = {name: value for name, value in pipeline.components.items() if name != "controlnet"}
        controlled = diffusers.StableDiffusionXLControlNetUnionPipeline(
            **components, controlnet=models[0], force_zeros_for_empty_prompt=pipeline.config.force_zeros_for_empty_prompt,
            add_watermarker=False,
        )  # fmt: skip
        controlled.set_progress_bar_config(disable=True)
        return controlled, {"controlnet_conditioning_scale": refs[0].scale, "control_guidance_start": refs[0].start,
                            "control_guidance_end": refs[0].end, "control_mode": modes}  # fmt: skip
    multi = {"FluxPipeline": diffusers.FluxMultiControlNetModel, "StableDiffusion3Pipeline":
             diffusers.SD3MultiControlNetModel}.get(base, MultiControlNetModel)  # fmt: skip
    controlnet = models[0] if single else multi(models)
    components = {name: value for name, value in pipeline.components.items() if name != "controlnet"}
    extra = {}
    if base == "StableDiffusionXLPipeline":  # the base's own settings (no watermark: the base pipeline adds none)
        extra = {"force_zeros_for_empty_prompt": pipeline.config.force_zeros_for_empty_prompt, "add_watermarker": False}
    controlled = getattr(diffusers, CONTROLNET_PIPELINES[base])(**components, controlnet=controlnet, **extra)
    controlled.set_progress_bar_config(disable=True)
    arguments = {
        "controlnet_conditioning_scale": refs[0].scale if single else [ref.scale for ref in refs],
        "control_guidance_start": refs[0].start if single else [ref.start for ref in refs],
        "control_guidance_end": refs[0].end if single else [ref.end for ref in refs],
    }
    if any(mode is not None for mode in modes):  # FLUX.1's Union: `control_mode` (-1: a ControlNet without modes)
        arguments["control_mode"] = modes[0] if single else [-1 if mode is None else mode for mode in modes]
    return controlled, arguments


def zero_residuals(unet, sample) -> dict:
    """Zero residuals of the shapes a ControlNet hands the UNet for `sample` (one per down residual: conv_in's, each
    layer's, each downsampler's; and the mid block's), derived from the UNet's config. A compiled UNet of a model
    that takes ControlNets is always called with residuals (these when no row has a ControlNet), so its warm-up
    traces the graph the ControlNets use and the first ControlNet compiles nothing; x + 0 is x, so a row without
    control is still exactly the base model's."""
    config = unet.config
    channels, per_block = list(config.block_out_channels), config.layers_per_block
    if not isinstance(per_block, int):
        return {}
    batch, _, height, width = sample.shape
    down = [sample.new_zeros((batch, channels[0], height, width))]
    for index, width_channels in enumerate(channels):
        down += [sample.new_zeros((batch, width_channels, height, width)) for _ in range(per_block)]
        if index < len(channels) - 1:
            height, width = (height + 1) // 2, (width + 1) // 2
            down.append(sample.new_zeros((batch, width_channels, height, width)))
    mid = sample.new_zeros((batch, channels[-1], height, width))
    return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
