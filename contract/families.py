"""Model families: what the catalog's pipeline class says about a model's requests, for the API and the worker.

A family is the set of diffusers pipelines that share a denoiser and its conditioning: SD 1.5 and SDXL (a UNet
with classifier-free guidance), FLUX.1 (a flow-matching transformer over 2x2-packed latents, guidance embedded
in the model for [dev] and absent for [schnell]) and SD 3.5 (a flow-matching MMDiT with classifier-free
guidance, its T5 encoder optional); and 2026's open models, Z-Image-Turbo and FLUX.2 [klein] (flow-matching
transformers with Qwen3 text encoders, distilled to a few steps without guidance) and Qwen-Image (a 20B MMDiT with
a Qwen2.5-VL encoder and its own classifier-free guidance, `true_cfg_scale`). The API enforces each family's rules from this table (sizes,
which guidance a request may ask for, negative prompts, the components adapters change); the worker picks its denoiser by the same
pipeline class (`model_worker/model/families`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How a model uses `guidance_scale`. `cfg`: classifier-free guidance (two rows per image, the negative prompt
# in one); `embedded`: a conditioning input of the model (FLUX.1 [dev]), no negative prompt; `none`: the model
# takes no guidance at all (FLUX.1 [schnell]), so a request that sets it is refused.
Guidance = Literal["cfg", "embedded", "none"]


@dataclass(frozen=True)
class Family:
    name: str
    # Pipeline class -> the task it serves.
    pipelines: dict[str, str]
    # Width and height must be multiples of this (the VAE's 8x, times FLUX's 2x2 packing).
    size_multiple: int
    # The catalog defaults an entry of this family gets for what it leaves out.
    defaults: dict[str, float | int]
    guidance: Guidance
    # The dtype the worker loads on a GPU (the CPU always runs float32).
    gpu_dtype: Literal["float16", "bfloat16"]
    # Whether the worker serves LoRA adapters for this family (diffusers' own LoRA loading).
    adapters: bool
    # The pipeline components an adapter file may change (diffusers' LoRA-loadable ones the family serves); the
    # registration check reads these components' base weights.
    lora_components: tuple[str, ...] = ()
    # The control-model kinds (contract/control_files.py) the worker serves for this family; empty: none.
    controls: tuple[str, ...] = ()
    # The LoRA file layouts its adapters are taken in (contract/lora_files.py): diffusers/PEFT's `peft`, kohya's
    # `kohya` (where the file checks know the family's kohya names).
    lora_layouts: tuple[str, ...] = ("peft", "kohya")
    # Pipeline components a catalog entry may leave out (`without:`), e.g. SD 3.5's T5 encoder (a large saving).
    optional_components: tuple[str, ...] = ()
    # The VAE latent space its denoiser works in (channels, scaling): a flow hands a latent on only between
    # families of the same space (contract/flows.py); empty: its latents are not handed on (FLUX packs them 2x2
    # into tokens and SD 3.5's pipelines take no latents as their image).
    latent_space: str = ""
    # Whether its pipelines take diffusers' `denoising_end` (text-to-image) and `denoising_start`
    # (image-to-image): the base + refiner handoff of a partly denoised latent.
    denoising_handoff: bool = False
    # The scheduler saved with the family's published weights (class, and the config keys that bound its step
    # count: contract/step_limits.py): what a catalog entry that names none runs, checked when the catalog loads.
    scheduler: str = "FlowMatchEulerDiscreteScheduler"
    scheduler_config: tuple[tuple[str, object], ...] = (("num_train_timesteps", 1000),)
    # The step caches (contract/step_cache.py) its worker implements: a catalog `step_cache.kind` must be one.
    step_caches: tuple[str, ...] = ()


# runwayml/stable-diffusion-v1-5's PNDM and stable-diffusion-xl-base-1.0's Euler both save these.
SAVED_UNET_SCHEDULER = (("num_train_timesteps", 1000), ("timestep_spacing", "leading"), ("steps_offset", 1))

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "sd15",
            {
                "StableDiffusionPipeline": "text-to-image",
                "StableDiffusionImg2ImgPipeline": "image-to-image",
                # over an inpainting UNet: 9 input channels (latents, the mask, the masked image's latents)
                "StableDiffusionInpaintPipeline": "inpaint",
            },  # fmt: skip
            size_multiple=8,
            defaults={"num_inference_steps": 25, "guidance_scale": 7.5, "width": 512, "height": 512},
            guidance="cfg",
            gpu_dtype="float16",
            adapters=True,
            lora_components=("unet", "text_encoder"),
            controls=("controlnet", "ip_adapter"),
            latent_space="sd15-vae: 4 channels, scaling 0.18215",
            step_caches=("deepcache",),
            scheduler="PNDMScheduler",
            scheduler_config=SAVED_UNET_SCHEDULER,
        ),
        Family(
            "sdxl",
            {
                "StableDiffusionXLPipeline": "text-to-image",
                "StableDiffusionXLImg2ImgPipeline": "image-to-image",
                # over an inpainting UNet (stable-diffusion-xl-1.0-inpainting-0.1): 9 input channels, as SD 1.5's
                "StableDiffusionXLInpaintPipeline": "inpaint",
            },  # fmt: skip
            size_multiple=8,
            defaults={"num_inference_steps": 30, "guidance_scale": 5.0, "width": 1024, "height": 1024},
            guidance="cfg",
            gpu_dtype="float16",  # the VAE is upcast to float32 for the decode when its config says so
            adapters=True,
            lora_components=("unet", "text_encoder", "text_encoder_2"),
            controls=("controlnet", "ip_adapter"),
            # The refiner's configuration (stable-diffusion-xl-refiner-1.0): `text_encoder_2` only.
            optional_components=("text_encoder",),
            latent_space="sdxl-vae: 4 channels, scaling 0.13025",
            denoising_handoff=True,
            scheduler="EulerDiscreteScheduler",
            step_caches=("deepcache",),
            scheduler_config=SAVED_UNET_SCHEDULER,
        ),
        Family(
            "flux",
            {
                "FluxPipeline": "text-to-image",
                "FluxImg2ImgPipeline": "image-to-image",
                # FLUX.1 Kontext [dev]: an instruction and an image, whose latents join the sequence as tokens
                "FluxKontextPipeline": "edit",
                # FLUX.1 Fill [dev]: the masked image's latents and the mask packed beside the latents as channels
                "FluxFillPipeline": "inpaint",
            },  # fmt: skip
            size_multiple=16,
            defaults={"num_inference_steps": 28, "guidance_scale": 3.5, "width": 1024, "height": 1024},
            guidance="embedded",
            gpu_dtype="bfloat16",
            adapters=True,
            lora_components=("transformer", "text_encoder"),  # diffusers loads no LoRA into FLUX's T5
            controls=("controlnet", "ip_adapter"),  # FluxControlNetModel, XLabs' IP-Adapters (text-to-image)
            step_caches=("first_block", "taylorseer"),
        ),
        Family(
            "sd3",
            {"StableDiffusion3Pipeline": "text-to-image"},
            size_multiple=16,  # the VAE's 8x times the transformer's 2x2 patches
            defaults={"num_inference_steps": 28, "guidance_scale": 7.0, "width": 1024, "height": 1024},
            guidance="cfg",
            gpu_dtype="bfloat16",
            adapters=True,
            lora_components=("transformer", "text_encoder", "text_encoder_2"),  # diffusers loads none into T5
            optional_components=("text_encoder_3",),
            controls=("controlnet",),  # SD3ControlNetModel (text-to-image)
            step_caches=("first_block",),
        ),
        Family(
            "zimage",
            {"ZImagePipeline": "text-to-image", "ZImageImg2ImgPipeline": "image-to-image"},
            size_multiple=16,  # the VAE's 8x times the transformer's 2x2 patches
            # Z-Image-Turbo's model card: 9 steps, guidance 0, 1024x1024.
            defaults={"num_inference_steps": 9, "guidance_scale": 0.0, "width": 1024, "height": 1024},
            guidance="none",  # Turbo is distilled: the pipeline runs no classifier-free guidance at guidance 0
            gpu_dtype="bfloat16",
            adapters=True,
            # diffusers' LoRA loading (its ZImage/Flux2/QwenImageLoraLoaderMixin) changes the transformer only; the
            # community layouts it converts (kohya's, ai-toolkit's) are not checked here yet, so the PEFT one only.
            lora_components=("transformer",),
            lora_layouts=("peft",),
        ),
        Family(
            "flux2-klein",
            {"Flux2KleinPipeline": "text-to-image"},  # its `image` is a reference to edit from, not an img2img start
            size_multiple=16,  # the VAE's 8x times the pipeline's 2x2 patches
            # FLUX.2 [klein] 4B's model card: 4 steps (step-distilled), 1024x1024.
            defaults={"num_inference_steps": 4, "guidance_scale": 0.0, "width": 1024, "height": 1024},
            guidance="none",  # the distilled pipeline (`is_distilled`) ignores guidance; no guidance embedding
            gpu_dtype="bfloat16",
            adapters=True,
            # diffusers' LoRA loading (its ZImage/Flux2/QwenImageLoraLoaderMixin) changes the transformer only; the
            # community layouts it converts (kohya's, ai-toolkit's) are not checked here yet, so the PEFT one only.
            lora_components=("transformer",),
            lora_layouts=("peft",),
        ),
        Family(
            "qwenimage",
            {"QwenImagePipeline": "text-to-image", "QwenImageImg2ImgPipeline": "image-to-image"},
            size_multiple=16,  # the VAE's 8x times the pipeline's 2x2 packing
            # Qwen-Image's model card: 50 steps, true_cfg_scale 4 (a request's `guidance_scale`), 1328x1328 for 1:1.
            defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "width": 1328, "height": 1328},
            guidance="cfg",  # the pipeline's `true_cfg_scale` with a negative prompt (its own `guidance_scale` is for
            # guidance-distilled weights, which Qwen-Image's are not), the guided prediction rescaled to the positive
            # one's norm
            gpu_dtype="bfloat16",
            adapters=True,
            # diffusers' LoRA loading (its ZImage/Flux2/QwenImageLoraLoaderMixin) changes the transformer only; the
            # community layouts it converts (kohya's, ai-toolkit's) are not checked here yet, so the PEFT one only.
            lora_components=("transformer",),
            lora_layouts=("peft",),
        ),
    )
}
PIPELINES: dict[str, Family] = {pipeline: family for family in FAMILIES.values() for pipeline in family.pipelines}


def family_of(pipeline: str | None) -> Family | None:
    """The family of a catalog pipeline class; None for the synthetic runners (no pipeline)."""
    return PIPELINES.get(pipeline) if pipeline else None


def unknown_pipeline_error(model: str, pipeline: str) -> str:
    return f"{model}: pipeline {pipeline!r} is not served; the accepted classes are {', '.join(sorted(PIPELINES))}"
