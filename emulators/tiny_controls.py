"""Tiny random-weight control models for a tiny SD 1.5 pipeline: a ControlNet (`ControlNetModel.from_unet`, its
zero convolutions given random values so that it visibly steers the image) and a plain IP-Adapter with its tiny CLIP
image encoder, saved in diffusers' layouts (`contract/control_files.py`). Deterministic per seed, like the pipeline;
the tests' oracles and the local stack use them."""

from __future__ import annotations

from pathlib import Path

# The local stack's tiny control models for SD 1.5: name -> (kind, seed).
TINY_CONTROLS = {"tiny-edges": ("controlnet", 11), "tiny-style": ("ip_adapter", 12)}
CONTROL_VERSION = "1"
# The tiny image encoder's sizes (a CLIP vision model of hidden 32, as diffusers' own IP-Adapter tests build one).
IMAGE_ENCODER = {"hidden_size": 32, "projection_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 37, "image_size": 32, "patch_size": 4}  # fmt: skip


def build_controlnet(pipeline_dir: Path, out_dir: Path, seed: int, strength: float = 0.5) -> Path:
    """A ControlNet of the pipeline's UNet (`ControlNetModel.from_unet`; an inpainting UNet's of its 4 latent
    channels, as SD 1.5's own ControlNets are); its own layers random (a trained one's zero convolutions are no longer
    zero), with conditioning embedding channels small enough for 32-64 px images."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from contract.control_files import INPAINT_IN_CHANNELS

    if (pipeline_dir / "transformer").is_dir():  # FLUX.1's or SD 3.5's: `from_transformer`
        if _transformer_class(pipeline_dir) == "SD3Transformer2DModel":
            return build_sd3_controlnet(pipeline_dir, out_dir, seed, strength)
        return build_flux_controlnet(pipeline_dir, out_dir, seed, strength)
    unet = UNet2DConditionModel.from_pretrained(pipeline_dir / "unet")
    if unet.config.in_channels == INPAINT_IN_CHANNELS:  # an inpainting UNet's ControlNets take its latents alone
        latents = (INPAINT_IN_CHANNELS - 1) // 2
        conv_in = torch.nn.Conv2d(latents, unet.conv_in.out_channels, unet.conv_in.kernel_size,
                                  padding=unet.conv_in.padding)  # fmt: skip
        with torch.no_grad():
            conv_in.weight.copy_(unet.conv_in.weight[:, :latents])
            conv_in.bias.copy_(unet.conv_in.bias)
        unet.conv_in = conv_in
        unet.register_to_config(in_channels=latents)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 16, 16))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding")):
                parameter.copy_(
                    strength * torch.randn(parameter.shape, generator=generator) / parameter[0].numel() ** 0.5
                )
    controlnet.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_flux_controlnet(pipeline_dir: Path, out_dir: Path, seed: int, strength: float = 0.5,
                          guidance_embeds: bool = False) -> Path:  # fmt: skip
    """An InstantX-style ControlNet of the pipeline's FLUX.1 transformer (`FluxControlNetModel.from_transformer`: one
    double and one single block, its embedders copied from the transformer), its own layers (the control embedder and
    the per-block projections, zero when untrained) random; `guidance_embeds`: one that embeds the guidance scale, as
    InstantX's (made for FLUX.1 [dev]) do, whatever its base takes."""
    import torch
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(pipeline_dir / "transformer")
    config = transformer.config
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
    )  # fmt: skip
    if guidance_embeds:
        plain = controlnet
        settings = {key: value for key, value in plain.config.items() if key != "_use_default_values"}
        controlnet = FluxControlNetModel.from_config({**settings, "guidance_embeds": True})
        controlnet.load_state_dict(plain.state_dict(), strict=False)  # the guidance embedder stays random
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "controlnet_single_blocks", "controlnet_x_embedder")):
                parameter.copy_(
                    strength * torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5
                )
    controlnet.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_sd3_controlnet(pipeline_dir: Path, out_dir: Path, seed: int, strength: float = 0.5) -> Path:
    """An InstantX-style ControlNet of the pipeline's SD 3.5 transformer (`SD3ControlNetModel.from_transformer`: as
    many joint blocks as the transformer, its embedders copied from it, zero pooled projections), its own layers (the
    control input's patch embedding and the per-block projections, zero when untrained) random."""
    import torch
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(pipeline_dir / "transformer")
    config = {key: value for key, value in transformer.config.items() if not key.startswith("_")}
    controlnet = SD3ControlNetModel.from_config({**config, "extra_conditioning_channels": 0})
    controlnet.pos_embed.load_state_dict(transformer.pos_embed.state_dict())
    controlnet.time_text_embed.load_state_dict(transformer.time_text_embed.state_dict())
    controlnet.context_embedder.load_state_dict(transformer.context_embedder.state_dict())
    # Its blocks as the transformer's (but the transformer's last block, whose text side differs).
    shapes = {name: tensor.shape for name, tensor in controlnet.transformer_blocks.state_dict().items()}
    controlnet.transformer_blocks.load_state_dict({name: tensor for name, tensor in
                                                   transformer.transformer_blocks.state_dict().items()
                                                   if shapes.get(name) == tensor.shape}, strict=False)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "pos_embed_input")):
                parameter.copy_(
                    strength * torch.randn(parameter.shape, generator=generator) / parameter[0].numel() ** 0.5
                )
    controlnet.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _transformer_class(pipeline_dir: Path) -> str:
    import json

    return json.loads((pipeline_dir / "transformer" / "config.json").read_text())["_class_name"]


def build_union_controlnet(pipeline_dir: Path, out_dir: Path, seed: int, strength: float = 0.5) -> Path:
    """A ControlNet Union of the pipeline's denoiser: SDXL's `ControlNetUnionModel` (`from_unet`, its task transformer
    as wide as the UNet's first block, as xinsir's 320 is SDXL's) with six control types, or a FLUX.1
    `FluxControlNetModel` with `num_mode` 4 (InstantX's Union layout); its own layers random."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if (pipeline_dir / "transformer").is_dir():
        from diffusers import FluxControlNetModel

        plain = FluxControlNetModel.from_pretrained(build_flux_controlnet(pipeline_dir, out_dir, seed, strength))
        config = {key: value for key, value in plain.config.items() if key != "_use_default_values"}
        union = FluxControlNetModel.from_config({**config, "num_mode": 4})
        union.load_state_dict(plain.state_dict(), strict=False)
        with torch.no_grad():
            union.controlnet_mode_embedder.weight.copy_(torch.randn(union.controlnet_mode_embedder.weight.shape,
                                                                    generator=generator))  # fmt: skip
    else:
        from diffusers import ControlNetUnionModel, UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(pipeline_dir / "unet")
        base = ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 16, 16))
        width = unet.config.block_out_channels[0]
        config = {key: value for key, value in base.config.items() if key != "_use_default_values"}  # else ignored
        union = ControlNetUnionModel.from_config({**config, "num_trans_channel": width, "num_trans_head": 4,
                                                  "num_proj_channel": width})  # fmt: skip
        shapes = {name: tensor.shape for name, tensor in union.state_dict().items()}
        union.load_state_dict({name: tensor for name, tensor in base.state_dict().items()
                               if shapes.get(name) == tensor.shape}, strict=False)  # fmt: skip
        with torch.no_grad():
            for name, parameter in union.named_parameters():
                if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding",
                                    "spatial_ch_projs")):  # fmt: skip
                    parameter.copy_(
                        strength * torch.randn(parameter.shape, generator=generator) / parameter[0].numel() ** 0.5
                    )
    union.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_ip_adapter(pipeline_dir: Path, out_dir: Path, seed: int, embedding_width: int | None = None) -> Path:
    """A plain IP-Adapter for the pipeline's UNet (four image tokens, one key/value pair per cross-attention layer in
    diffusers' order) or FLUX.1 transformer (one pair per double block), and its tiny CLIP image encoder (its image
    embeddings `embedding_width` wide; None: `IMAGE_ENCODER`'s), as
    `load_ip_adapter(out_dir, subfolder="", weight_name="ip_adapter.safetensors")` reads them."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from contract.control_files import (
        BASE_TRANSFORMER_CONFIG,
        BASE_UNET_CONFIG,
        BASE_UNET_WEIGHTS,
        cross_attention_layers,
    )
    from contract.lora_files import bytes_reader, read_header

    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int):
        return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5

    embeddings = embedding_width or IMAGE_ENCODER["projection_dim"]
    flux = (pipeline_dir / "transformer").is_dir()
    if flux:  # XLabs' layout as diffusers reads it: tokens of the text width, a key/value pair per double block
        config = json.loads((pipeline_dir / BASE_TRANSFORMER_CONFIG).read_text())
        cross = config["joint_attention_dim"]
        layers = [[config["num_attention_heads"] * config["attention_head_dim"], cross]] * config["num_layers"]
        numbers = range(len(layers))
    else:
        config = json.loads((pipeline_dir / BASE_UNET_CONFIG).read_text())
        data = (pipeline_dir / BASE_UNET_WEIGHTS).read_bytes()
        layers = cross_attention_layers(read_header(bytes_reader(data), len(data)))
        cross = config["cross_attention_dim"]
        numbers = range(1, 2 * len(layers), 2)

    tensors = {
        "image_proj.proj.weight": random(4 * cross, embeddings),
        "image_proj.proj.bias": random(4 * cross),
        "image_proj.norm.weight": torch.ones(cross),
        "image_proj.norm.bias": torch.zeros(cross),
    }
    for number, (hidden, width) in zip(numbers, layers, strict=True):
        tensors[f"ip_adapter.{number}.to_k_ip.weight"] = random(hidden, width)
        tensors[f"ip_adapter.{number}.to_v_ip.weight"] = random(hidden, width)
        if flux:
            tensors[f"ip_adapter.{number}.to_k_ip.bias"] = random(hidden)
            tensors[f"ip_adapter.{number}.to_v_ip.bias"] = random(hidden)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "ip_adapter.safetensors")
    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**{**IMAGE_ENCODER, "projection_dim": embeddings}))
    encoder.save_pretrained(out_dir / "image_encoder", safe_serialization=True)
    return out_dir


def build_control(kind: str, pipeline_dir: Path, out_dir: Path, seed: int) -> Path:
    return (build_controlnet if kind == "controlnet" else build_ip_adapter)(pipeline_dir, out_dir, seed)


def control_files(folder: Path) -> dict[str, bytes]:
    """A built control version's files by their path in the folder (what is uploaded under its version prefix)."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def publish_controls(spec, pipeline_dir: Path, out_dir: Path, bucket_name: str) -> list[str]:
    """Builds the tiny control models of the kinds the model's family serves, uploads them under
    `adapters/_controls/{model}/{name}/1/` and registers them the way the admin call does (the same checks)."""
    from contract import google_clients, naming
    from contract.settings import Settings
    from contract.stores.control_registry import ControlRegistry

    bucket = google_clients.storage_client(Settings.from_env()).bucket(bucket_name)
    registry = ControlRegistry(bucket)
    registered = []
    for name, (kind, seed) in TINY_CONTROLS.items():
        if kind not in spec.family.controls:
            continue
        folder = out_dir / name / CONTROL_VERSION
        if not folder.exists():
            build_control(kind, pipeline_dir, folder, seed)
        prefix = naming.control_prefix(spec.name, name, CONTROL_VERSION)
        for file, data in control_files(folder).items():
            bucket.blob(prefix + file).upload_from_string(data)
        record = registry.register(spec, name, kind, CONTROL_VERSION)
        registered.append(f"{name}@{record.version} ({kind}, {record.bytes} bytes)")
    return registered
