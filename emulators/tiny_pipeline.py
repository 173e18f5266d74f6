"""Builds a tiny random-weight Stable Diffusion pipeline and uploads it where the catalog says SD 1.5 lives.

No machine here can download weights. The tiny pipeline has the same component classes as SD 1.5
(UNet2DConditionModel, AutoencoderKL with an 8x latent, CLIPTextModel, a BPE CLIP tokenizer), so the
worker downloads and loads it exactly as it would the real model. Its images are noise. It is the local
stack's and the tests' fixture, so it lives with the emulators, not in the worker's package.

    python -m emulators.tiny_pipeline --out .stack/tiny-model --upload
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

VOCAB_SIZE = 1000
# A small corpus for the BPE vocabulary: prompt-like words, enough for a realistic token stream.
CORPUS = """
a photo of a lighthouse at dawn on a rocky coast, oil painting, highly detailed, sharp focus
portrait of a cat wearing a tiny hat, studio lighting, bokeh, watercolor, pastel colors
futuristic city skyline at night with neon lights and rain, cinematic, wide angle lens
a bowl of fruit on a wooden table, still life, soft light, baroque style, dramatic shadows
mountain landscape with a lake and pine trees, sunrise, mist, national park, 35mm film
an astronaut riding a horse on mars, digital art, trending, concept art, red desert dust
a cozy cabin in a snowy forest, warm light in the windows, winter evening, illustration
sailing boat on a calm blue sea, summer afternoon, impressionist, brush strokes, clouds
""".strip()


def _byte_alphabet() -> list[str]:
    """CLIP's byte-to-unicode table: every byte maps to one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            codes.append(256 + extra)
            extra += 1
    return [chr(code) for code in codes]


def build_tokenizer(out_dir: Path) -> tuple[int, int]:
    """Writes a CLIP BPE tokenizer (vocab.json, merges.txt) learned from CORPUS; returns (bos, eos) ids.

    The vocabulary is laid out like CLIP's: the 256 byte characters, the same with `</w>`, the learned
    merges, then the two special tokens.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, end_of_word_suffix="</w>", show_progress=False)
    tokenizer.train_from_iterator(CORPUS.lower().splitlines(), trainer=trainer)
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" "))
        for m in json.loads(tokenizer.to_str())["model"]["merges"]
    ]
    alphabet = _byte_alphabet()
    tokens = alphabet + [char + "</w>" for char in alphabet] + ["".join(pair) for pair in merges]
    tokens = list(dict.fromkeys(tokens))[: VOCAB_SIZE - 2] + ["<|startoftext|>", "<|endoftext|>"]
    kept = set(tokens)
    merges = [pair for pair in merges if "".join(pair) in kept]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(p) for p in merges) + "\n")
    clip = CLIPTokenizer(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(pair) for pair in merges],
        model_max_length=77,
    )
    clip.save_pretrained(out_dir)
    return len(tokens) - 2, len(tokens) - 1


def build_pipeline(
    out_dir: Path, pipeline_class: str = "StableDiffusionPipeline", guidance: str = "cfg", without: tuple = ()
) -> Path:
    """Builds the pipeline deterministically (fixed seed) and saves it as safetensors.

    The catalog's pipeline class picks the components: SD 1.5's (a UNet, one CLIP), SDXL's (a UNet with
    `text_time` conditioning, two CLIP encoders, the second with a projection) or FLUX.1's (a flow-matching
    transformer, CLIP and T5, a VAE with a shift factor), each at the sizes diffusers' own tests use. An SDXL
    image-to-image entry `without` its first text encoder is the refiner (`_sdxl_refiner`).
    """
    import diffusers
    import torch

    torch.manual_seed(0)
    builder = _BUILDERS.get(pipeline_class)
    if builder is None:
        raise ValueError(f"no tiny pipeline for {pipeline_class}; one of {', '.join(sorted(_BUILDERS))}")
    if pipeline_class == "StableDiffusionXLImg2ImgPipeline" and "text_encoder" in without:
        builder = _sdxl_refiner
    components = builder(out_dir, guidance_embeds=True) if guidance == "embedded" else builder(out_dir)
    pipeline = getattr(diffusers, pipeline_class)(**components)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    for tokenizer in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        if (out_dir / tokenizer / "tokenizer_config.json").exists():
            _make_tokenizer_reproducible(out_dir / tokenizer)
    return out_dir


def _vae(latent_channels: int = 4, **extra):
    """Four blocks, so the VAE shrinks images 8x like the real ones."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(32, 64, 64, 64),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        norm_num_groups=32,
        sample_size=512,
        **extra,
    )


def _clip(out_dir: Path, name: str, with_projection: bool = False, hidden: int = 32):
    """A small CLIP text encoder and its locally built BPE tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    tokenizer_dir = out_dir / name
    bos_id, eos_id = build_tokenizer(tokenizer_dir)
    config = CLIPTextConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        hidden_size=hidden,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=5,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=77,
        projection_dim=32,
    )
    encoder = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    return encoder, CLIPTokenizer.from_pretrained(tokenizer_dir)


def _t5(out_dir: Path, name: str, d_model: int):
    """A small T5 encoder and its locally built tokenizer."""
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer(out_dir / name)
    encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )  # fmt: skip
    return encoder, tokenizer


def sd15_unet(in_channels: int = 4):
    """The tiny SD 1.5 UNet (also what the control-model tests check their ControlNets and IP-Adapters against)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=64,
        in_channels=in_channels,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=32,
    )


def _sd15(out_dir: Path, in_channels: int = 4) -> dict:
    from diffusers import PNDMScheduler

    unet = sd15_unet(in_channels)
    vae = _vae()
    text_encoder, tokenizer = _clip(out_dir, "tokenizer")
    scheduler = PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True, steps_offset=1
    )
    return {
        "unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler,
        "safety_checker": None, "feature_extractor": None, "requires_safety_checker": False,
    }  # fmt: skip


def _sd15_inpaint(out_dir: Path) -> dict:
    """SD 1.5's inpainting UNet (stable-diffusion-inpainting): 9 input channels, the latents, the mask and the
    masked image's latents side by side; the rest is SD 1.5's."""
    return _sd15(out_dir, in_channels=9)


def _sdxl_unet(projection_class_embeddings_input_dim: int, cross_attention_dim: int, in_channels: int = 4):
    """The tiny SDXL UNet, base or refiner: they differ in their conditioning widths only (an inpainting UNet in
    its 9 input channels)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=128,
        in_channels=in_channels,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=projection_class_embeddings_input_dim,
        cross_attention_dim=cross_attention_dim,
        norm_num_groups=32,
    )


def _sdxl(out_dir: Path) -> dict:
    from diffusers import EulerDiscreteScheduler

    # 6 time ids x 8 + the second encoder's 32-wide projection; the two encoders' hidden states side by side.
    unet = _sdxl_unet(projection_class_embeddings_input_dim=80, cross_attention_dim=64)
    text_encoder, tokenizer = _clip(out_dir, "tokenizer")
    text_encoder_2, tokenizer_2 = _clip(out_dir, "tokenizer_2", with_projection=True)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )
    return {
        "unet": unet, "vae": _vae(force_upcast=True), "text_encoder": text_encoder, "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2, "scheduler": scheduler,
    }  # fmt: skip


def _sdxl_inpaint(out_dir: Path) -> dict:
    """SDXL's inpainting UNet (stable-diffusion-xl-1.0-inpainting-0.1): 9 input channels, the rest the base's."""
    components = _sdxl(out_dir)
    components["unet"] = _sdxl_unet(projection_class_embeddings_input_dim=80, cross_attention_dim=64, in_channels=9)
    return components


def _sdxl_refiner(out_dir: Path) -> dict:
    """The SDXL refiner's configuration (diffusers' stable-diffusion-xl-refiner-1.0): `text_encoder_2` only, its
    UNet conditioned on that encoder alone and on an aesthetic score (five time ids, `requires_aesthetics_score`),
    no zeroed negative prompt. Its VAE and second encoder are the tiny base's own (built first from the same seed),
    as the real refiner shares the base's."""
    import shutil

    base = _sdxl(out_dir)
    shutil.rmtree(out_dir / "tokenizer", ignore_errors=True)  # the first encoder's: the refiner has none
    # 5 time ids (with the aesthetic score) x 8 + the 32-wide pooled; the second encoder's hidden states alone.
    unet = _sdxl_unet(projection_class_embeddings_input_dim=72, cross_attention_dim=32)
    return {
        "unet": unet, "vae": base["vae"], "text_encoder": None, "tokenizer": None,
        "text_encoder_2": base["text_encoder_2"], "tokenizer_2": base["tokenizer_2"], "scheduler": base["scheduler"],
        "requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False,
    }  # fmt: skip


def _flux(out_dir: Path, guidance_embeds: bool = False) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # the VAE's 4 latent channels packed 2x2 into tokens
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=guidance_embeds,
    )
    text_encoder, tokenizer = _clip(out_dir, "tokenizer")
    t5, t5_tokenizer = _t5(out_dir, "tokenizer_2", d_model=32)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
        max_shift=1.15,
    )  # fmt: skip
    vae = _vae(shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)
    return {
        "transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
        "text_encoder_2": t5, "tokenizer_2": t5_tokenizer, "scheduler": scheduler,
    }  # fmt: skip


def _flux_fill(out_dir: Path, guidance_embeds: bool = False) -> dict:
    """FLUX.1 Fill's transformer over the tiny FLUX.1's components: its input takes the packed latents, the masked
    image's packed latents and the 8x8 mask packed 2x2 (16 + 16 + 256 channels), its output the latents' 16."""
    from diffusers import FluxTransformer2DModel

    components = _flux(out_dir, guidance_embeds)
    components["transformer"] = FluxTransformer2DModel(
        patch_size=1, in_channels=16 + 16 + 4 * 64, out_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=guidance_embeds,
    )  # fmt: skip
    return components


def build_t5_tokenizer(out_dir: Path):
    """A T5 tokenizer (a Unigram model learned from CORPUS), wrapped as transformers' fast T5 tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))]
    )
    wrapped = T5TokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0,
        model_max_length=512,
    )  # fmt: skip
    wrapped.save_pretrained(out_dir)
    return wrapped


def _sd3(out_dir: Path) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=64,  # T5's width; the two CLIPs' hidden states side by side are padded to it
        pooled_projection_dim=64,  # the two CLIPs' 32-wide projections side by side
        out_channels=4,
        pos_embed_max_size=64,  # up to 64x64 patches: 1024x1024 pixels
    )
    text_encoder, tokenizer = _clip(out_dir, "tokenizer", with_projection=True)
    text_encoder_2, tokenizer_2 = _clip(out_dir, "tokenizer_2", with_projection=True)
    t5, t5_tokenizer = _t5(out_dir, "tokenizer_3", d_model=64)
    vae = _vae(shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)
    return {
        "transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2, "text_encoder_3": t5, "tokenizer_3": t5_tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
    }  # fmt: skip


# The Qwen chat template, as the Qwen2.5 / Qwen3 tokenizers apply it (system and user turns, then the assistant's).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen_tokenizer(out_dir: Path):
    """A Qwen2 tokenizer (a byte-level BPE learned from CORPUS, with Qwen's `<|im_start|>`/`<|im_end|>` and its chat
    template): what Z-Image's and FLUX.2 [klein]'s Qwen3 and Qwen-Image's Qwen2.5-VL encoders read."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    wrapped = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    wrapped.chat_template = QWEN_CHAT_TEMPLATE
    wrapped.save_pretrained(out_dir)
    return Qwen2Tokenizer.from_pretrained(out_dir)


def _qwen3(out_dir: Path, hidden: int, layers: int = 2, causal_lm: bool = False):
    """A small Qwen3 text encoder (Z-Image's `Qwen3Model`, FLUX.2 [klein]'s `Qwen3ForCausalLM`) and its tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    tokenizer = build_qwen_tokenizer(out_dir / "tokenizer")
    config = Qwen3Config(
        hidden_size=hidden, intermediate_size=37, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=causal_lm,
    )  # fmt: skip
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config), tokenizer


def _zimage(out_dir: Path) -> dict:
    """Z-Image's classes at diffusers' own test sizes: a single-stream DiT over 2x2 patches, a Qwen3 encoder whose
    second-to-last hidden states it reads, FLUX.1's 16-channel VAE."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[256, 64, 64],
    )  # fmt: skip
    with torch.no_grad():  # made with torch.empty: fixed, as diffusers' tests fix them, so a build is reproducible
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    text_encoder, tokenizer = _qwen3(out_dir, hidden=16)
    vae = _vae(latent_channels=16, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
               use_post_quant_conv=False)  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}  # fmt: skip


def _flux2_klein(out_dir: Path) -> dict:
    """FLUX.2 [klein]'s classes at diffusers' own test sizes: a double- and a single-stream block over 2x2-patchified
    latents, a Qwen3 causal LM of 28 layers (the pipeline reads hidden states 9, 18 and 27, side by side: the
    transformer's 48-wide context), a four-block FLUX.2 VAE (8x, with its latent batch norm); step-distilled."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False,
    )  # fmt: skip
    text_encoder, tokenizer = _qwen3(out_dir, hidden=16, layers=28, causal_lm=True)
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 64, 64, 64), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=32, sample_size=512,
        use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler, "is_distilled": True}  # fmt: skip


def _qwenimage(out_dir: Path) -> dict:
    """Qwen-Image's classes at diffusers' own test sizes: its MMDiT over 2x2-packed latents, a Qwen2.5-VL encoder
    (text and a small vision tower), its causal 3-D VAE with four levels (8x, as the real one) and 4 latent channels."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )  # fmt: skip
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    tokenizer = build_qwen_tokenizer(out_dir / "tokenizer")
    text_config = {
        "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "vocab_size": len(tokenizer),
        "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
    }  # fmt: skip
    vision_config = {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, vocab_size=len(tokenizer))
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=256,
        max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift_terminal=0.02, time_shift_type="exponential",
    )  # fmt: skip
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}  # fmt: skip


_BUILDERS = {
    "StableDiffusionPipeline": _sd15,
    "StableDiffusionImg2ImgPipeline": _sd15,
    "StableDiffusionInpaintPipeline": _sd15_inpaint,
    "StableDiffusionXLPipeline": _sdxl,
    "StableDiffusionXLImg2ImgPipeline": _sdxl,
    "StableDiffusionXLInpaintPipeline": _sdxl_inpaint,
    "FluxPipeline": _flux,
    "FluxImg2ImgPipeline": _flux,
    "FluxFillPipeline": _flux_fill,
    "FluxKontextPipeline": _flux,  # FLUX.1 Kontext [dev]: FLUX.1's components (guidance embedded)
    "StableDiffusion3Pipeline": _sd3,
    "ZImagePipeline": _zimage,
    "ZImageImg2ImgPipeline": _zimage,
    "Flux2KleinPipeline": _flux2_klein,
    "QwenImagePipeline": _qwenimage,
    "QwenImageImg2ImgPipeline": _qwenimage,
}


def _make_tokenizer_reproducible(tokenizer_dir: Path) -> None:
    """transformers records load-time flags in tokenizer_config.json; drop them so builds are identical."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for volatile in ("name_or_path", "tokenizer_file", "added_tokens_decoder"):
        config.pop(volatile, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


# The local stack's two tiny LoRA adapters: name -> (seed, rank). Deterministic, like the pipeline itself.
TINY_ADAPTERS = {"tiny-ink": (1, 4), "tiny-neon": (2, 8)}
ADAPTER_VERSION = "1"
# The Linear modules they change: the UNet's attention projections and the text encoder's q/v projections.
TINY_ADAPTER_TARGETS = (".to_q", ".to_k", ".to_v", ".to_out.0", ".self_attn.q_proj", ".self_attn.v_proj")


def build_adapter(
    pipeline_dir: Path, out_file: Path, seed: int, rank: int, strength: float = 1.0, components: tuple[str, ...] = ()
) -> Path:
    """A random LoRA (diffusers' PEFT layout, safetensors) for the pipeline in `pipeline_dir`: its targets and
    shapes come from the base weights' own headers, so it fits the pipeline it was built for, and only it.
    `components`: the family's LoRA components (every one the pipeline has, when empty)."""
    import torch
    from safetensors.torch import save_file

    from contract.lora_files import BASE_FILES, bytes_reader, read_header

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for component, path in BASE_FILES.items():
        if not (pipeline_dir / path).exists() or (components and component not in components):
            continue  # a component of another family, or one diffusers loads no LoRA into for this one
        data = (pipeline_dir / path).read_bytes()
        for name, entry in sorted(read_header(bytes_reader(data), len(data)).items()):
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and module.endswith(TINY_ADAPTER_TARGETS) and len(entry["shape"]) == 2):
                continue
            out_features, in_features = entry["shape"]
            # B is not zero (as a trained LoRA's is not): the adapter visibly changes the image.
            tensors[f"{component}.{module}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5
            )
            tensors[f"{component}.{module}.lora_B.weight"] = (
                strength * torch.randn(out_features, rank, generator=generator) / rank**0.5
            )
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_file)
    return out_file


def publish_adapters(spec, pipeline_dir: Path, out_dir: Path, bucket_name: str) -> list[str]:
    """Builds the tiny adapters for one model, uploads them under `adapters/{model}/{name}/1/` and registers
    them the way the admin call does (the same checks, the same registration record)."""
    from contract import google_clients, naming
    from contract.settings import Settings
    from contract.stores.adapter_registry import AdapterRegistry

    bucket = google_clients.storage_client(Settings.from_env()).bucket(bucket_name)
    registry = AdapterRegistry(bucket)
    registered = []
    for name, (seed, rank) in TINY_ADAPTERS.items():
        file = out_dir / name / ADAPTER_VERSION / "pytorch_lora_weights.safetensors"
        if not file.exists():
            build_adapter(pipeline_dir, file, seed, rank, components=spec.family.lora_components)
        prefix = naming.adapter_prefix(spec.name, name, ADAPTER_VERSION)
        bucket.blob(prefix + naming.ADAPTER_FILE).upload_from_filename(file)
        record = registry.register(spec, name, ADAPTER_VERSION)
        registered.append(f"{name}@{record.version} (rank {record.rank}, {record.targets} targets)")
    return registered


# The `origin` of the manifests the local stack writes for its tiny pipelines.
TINY_ORIGIN = "local stack: tiny pipeline"


def upload_directory(local_dir: Path, bucket_name: str, prefix: str) -> int:
    """Uploads the pipeline with its manifest (`model_worker/weights/store.py`), as an imported model is uploaded."""
    from contract import google_clients
    from contract.settings import Settings
    from model_worker.weights.store import upload_with_manifest

    client = google_clients.storage_client(Settings.from_env())
    return len(upload_with_manifest(client, local_dir, bucket_name, prefix, origin=TINY_ORIGIN)["files"])


def imported_weights(local_dir: Path, bucket_name: str, prefix: str) -> str | None:
    """Why the weights under `prefix` are someone's import, or None when the tiny pipeline may be uploaded there.

    A prefix whose manifest was not written by the stack (`origin`) and lists other files than the tiny
    pipeline's was imported (`python -m model_worker.weights import`): the stack keeps it, so a restart never
    overwrites a model being rolled out. The tiny pipeline is uploaded again over its own earlier upload, which
    repairs a file a test changed."""
    import json

    from contract import google_clients
    from contract.settings import Settings
    from model_worker.weights.store import MANIFEST, build_manifest

    blob = (
        google_clients.storage_client(Settings.from_env()).bucket(bucket_name).blob(f"{prefix.rstrip('/')}/{MANIFEST}")
    )
    if not blob.exists():
        return None
    manifest = json.loads(blob.download_as_bytes())
    listed = manifest.get("files") or {}
    if manifest.get("origin") == TINY_ORIGIN or listed == build_manifest(local_dir)["files"]:
        return None
    return f"its {MANIFEST} lists {len(listed)} files of its own"


def main() -> None:
    from contract.settings import Settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".stack/tiny-model"))
    parser.add_argument("--upload", action="store_true", help="upload to the model bucket for every catalog model")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = Settings.from_env()
    # One build at a time in a folder: the test suite's two stacks start together and built the same tiny models
    # into it at once (one read a tokenizer file the other was writing). The second waits, then finds them built.
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / ".building.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        publish(settings, args.out, args.upload)


def publish(settings, out: Path, upload: bool) -> None:
    """Builds what is missing under `out` and, with `upload`, uploads and registers it for every catalog model."""
    built: dict[str, Path] = {}  # weights path -> the tiny pipeline uploaded there
    for spec in settings.catalog().units():
        if spec.runner != "diffusers":
            continue
        # Units on the same weights (the local SD 1.5 image-to-image on the text-to-image's) share one upload: the
        # catalog's pipeline class loads the same files.
        shared = spec.weights_path in built
        target = built.setdefault(spec.weights_path, out / spec.queue)
        if not shared and not (target / "model_index.json").exists():
            build_pipeline(target, spec.pipeline, spec.guidance_mode, tuple(spec.without))
            log.info("built tiny %s for %s in %s", spec.pipeline, spec.queue, target)
        if upload:
            imported = imported_weights(target, settings.model_bucket, spec.weights_path)
            if imported:
                log.info("kept gs://%s/%s: imported weights, not the tiny pipeline (%s)",
                         settings.model_bucket, spec.weights_path, imported)  # fmt: skip
            elif not shared:
                count = upload_directory(target, settings.model_bucket, spec.weights_path)
                log.info("uploaded %d files to gs://%s/%s", count, settings.model_bucket, spec.weights_path)
            if spec.adapters is not None:
                adapters = publish_adapters(spec, target, out / "adapters" / spec.name, settings.model_bucket)
                log.info("registered adapters for %s: %s", spec.name, ", ".join(adapters))
            if spec.controls is not None:
                from emulators.tiny_controls import publish_controls

                controls = publish_controls(spec, target, out / "controls" / spec.name, settings.model_bucket)
                log.info("registered control models for %s: %s", spec.name, ", ".join(controls))


if __name__ == "__main__":
    main()
