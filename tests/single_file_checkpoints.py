"""Single-file checkpoints in the original layouts (CompVis/Stability's `.safetensors`, Black Forest Labs' FLUX
transformer), written from a tiny diffusers pipeline by inverting diffusers' key map.

Fine-tunes are shared in these layouts; the importer converts them back with diffusers' `from_single_file`. The
inverse here follows the layouts diffusers' converters read (`diffusers/loaders/single_file_utils.py`, the
`scripts/convert_diffusers_to_original_*` scripts). There is no separate round-trip helper: the import tests
(`tests/integration/test_single_file_import.py`) convert a written checkpoint back through the importer, which
runs diffusers' own converters, and check every tensor comes back under its diffusers name, unchanged.

A checkpoint written from the very folder used as its base could not tell a conversion from a copy of the base
(conversion starts from the base's folder). `fine_tune` makes the folder to write from: the base with every
tensor of the components a file carries changed, so that a component, or a single tensor, that silently fell
back to the base's is seen (`CARRIED`: what each family's file holds).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# The components a single file carries, by family (a FLUX file is its transformer alone).
CARRIED = {
    "sd15": ("unet", "vae", "text_encoder"),
    "sdxl": ("unet", "vae", "text_encoder", "text_encoder_2"),
    "flux": ("transformer",),
    "zimage": ("transformer",),
    "qwenimage": ("transformer",),
}
# Z-Image's original names for diffusers' (diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`
# renames these back, and splits the fused q/k/v).
_ZIMAGE_ORIGINAL = {"all_x_embedder.2-1.": "x_embedder.", "all_final_layer.2-1.": "final_layer.",
                    ".attention.to_out.0.": ".attention.out.", ".attention.norm_k.": ".attention.k_norm.",
                    ".attention.norm_q.": ".attention.q_norm."}  # fmt: skip

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}  # fmt: skip
_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}  # fmt: skip


def _resnet(rest: str) -> str:
    part, _, tail = rest.partition(".")
    return f"{_RESNET.get(part, part)}.{tail}"


def unet_to_original(state: dict, layers_per_block: int) -> dict:
    """A diffusers `UNet2DConditionModel` state dict in the original `model.diffusion_model.` layout."""
    per_block = layers_per_block + 1
    with_attention = {int(k.split(".")[1]) for k in state if re.match(r"up_blocks\.\d+\.attentions\.", k)}
    out = {}
    for name, tensor in state.items():
        top = next((old for old in _UNET_TOP if name.startswith(old + ".")), None)
        if top is not None:
            key = _UNET_TOP[top] + name[len(top) :]
        elif m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", name):
            i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            key = f"input_blocks.{per_block * i + j + 1}." + (
                "0." + _resnet(rest) if kind == "resnets" else "1." + rest
            )
        elif m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", name):
            key = f"input_blocks.{per_block * (int(m[1]) + 1)}.0.op.{m[2]}"
        elif m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", name):
            i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            key = f"output_blocks.{per_block * i + j}." + ("0." + _resnet(rest) if kind == "resnets" else "1." + rest)
        elif m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", name):
            i = int(m[1])
            key = f"output_blocks.{per_block * i + 2}.{2 if i in with_attention else 1}.{m[2]}"
        elif m := re.match(r"mid_block\.resnets\.(\d+)\.(.+)", name):
            key = f"middle_block.{2 * int(m[1])}.{_resnet(m[2])}"
        elif name.startswith("mid_block.attentions.0."):
            key = "middle_block.1." + name[len("mid_block.attentions.0.") :]
        else:
            raise KeyError(f"no original name for UNet tensor {name}")
        out["model.diffusion_model." + key] = tensor
    return out


_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_to_original(state: dict) -> dict:
    """A diffusers `AutoencoderKL` state dict in the original `first_stage_model.` layout."""
    blocks = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("decoder.up_blocks."))
    out = {}
    for name, tensor in state.items():
        key = name.replace("conv_norm_out", "norm_out")
        if m := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            key = f"encoder.down.{m[1]}.block.{m[2]}.{m[3]}"
        elif m := re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.+)", key):
            key = f"encoder.down.{m[1]}.downsample.{m[2]}"
        elif m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            key = f"decoder.up.{blocks - 1 - int(m[1])}.block.{m[2]}.{m[3]}"
        elif m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key):
            key = f"decoder.up.{blocks - 1 - int(m[1])}.upsample.{m[2]}"
        elif m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", key):
            key = f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"
        elif m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", key):
            key = f"{m[1]}.mid.attn_1.{_VAE_ATTENTION[m[2]]}.{m[3]}"
            if m[3] == "weight" and tensor.ndim == 2:
                tensor = tensor[:, :, None, None]  # the original's attention projections are 1x1 convolutions
        key = key.replace("conv_shortcut", "nin_shortcut")
        out["first_stage_model." + key] = tensor
    return out


def open_clip_to_original(state: dict, prefix: str) -> dict:
    """A transformers `CLIPTextModelWithProjection` state dict in OpenCLIP's layout (SDXL's second encoder)."""
    out = {}
    layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("text_model.encoder.layers."))
    for i in range(layers):
        hf, oc = f"text_model.encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for part in ("weight", "bias"):
            out[f"{oc}attn.in_proj_{part}"] = torch.cat(
                [state[f"{hf}self_attn.{p}_proj.{part}"] for p in ("q", "k", "v")], dim=0
            )
            for old, new in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"),
                             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):  # fmt: skip
                out[f"{oc}{new}.{part}"] = state[f"{hf}{old}.{part}"]
    out[f"{prefix}token_embedding.weight"] = state["text_model.embeddings.token_embedding.weight"]
    out[f"{prefix}positional_embedding"] = state["text_model.embeddings.position_embedding.weight"]
    out[f"{prefix}ln_final.weight"] = state["text_model.final_layer_norm.weight"]
    out[f"{prefix}ln_final.bias"] = state["text_model.final_layer_norm.bias"]
    out[f"{prefix}text_projection"] = state["text_projection.weight"].T.contiguous()
    return out


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def flux_to_original(state: dict) -> dict:
    """A diffusers `FluxTransformer2DModel` state dict in Black Forest Labs' layout (flux1-dev.safetensors)."""
    out, state = {}, dict(state)

    def move(new: str, old: str) -> None:
        for part in ("weight", "bias"):
            if f"{old}.{part}" in state:
                out[f"{new}.{part}"] = state.pop(f"{old}.{part}")

    def fuse(new: str, olds: list[str]) -> None:
        for part in ("weight", "bias"):
            out[f"{new}.{part}"] = torch.cat([state.pop(f"{old}.{part}") for old in olds], dim=0)

    move("img_in", "x_embedder")
    move("txt_in", "context_embedder")
    for new, old in (
        ("time_in", "timestep_embedder"),
        ("vector_in", "text_embedder"),
        ("guidance_in", "guidance_embedder"),
    ):
        move(f"{new}.in_layer", f"time_text_embed.{old}.linear_1")
        move(f"{new}.out_layer", f"time_text_embed.{old}.linear_2")
    double = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")), default=-1)
    for i in range(double):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        move(d + "img_mod.lin", b + "norm1.linear")
        move(d + "txt_mod.lin", b + "norm1_context.linear")
        fuse(d + "img_attn.qkv", [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"])
        fuse(d + "txt_attn.qkv", [b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"])
        for new, old in (("img_attn.norm.query_norm", "norm_q"), ("img_attn.norm.key_norm", "norm_k"),
                         ("txt_attn.norm.query_norm", "norm_added_q"), ("txt_attn.norm.key_norm", "norm_added_k")):  # fmt: skip
            out[f"{d}{new}.scale"] = state.pop(f"{b}attn.{old}.weight")
        move(d + "img_mlp.0", b + "ff.net.0.proj")
        move(d + "img_mlp.2", b + "ff.net.2")
        move(d + "txt_mlp.0", b + "ff_context.net.0.proj")
        move(d + "txt_mlp.2", b + "ff_context.net.2")
        move(d + "img_attn.proj", b + "attn.to_out.0")
        move(d + "txt_attn.proj", b + "attn.to_add_out")
    single = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")), default=-1)
    for i in range(single):
        s, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        move(s + "modulation.lin", b + "norm.linear")
        fuse(s + "linear1", [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"])
        out[s + "norm.query_norm.scale"] = state.pop(b + "attn.norm_q.weight")
        out[s + "norm.key_norm.scale"] = state.pop(b + "attn.norm_k.weight")
        move(s + "linear2", b + "proj_out")
    move("final_layer.linear", "proj_out")
    for part in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{part}"] = _swap_halves(state.pop(f"norm_out.linear.{part}"))
    if state:
        raise KeyError(f"no original name for FLUX tensors {sorted(state)}")
    return out


def _load(folder: Path, component: str) -> dict:
    files = sorted((folder / component).glob("*.safetensors"))
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def write_sd_checkpoint(pipeline: Path, out: Path) -> Path:
    """The whole SD 1.5 or SDXL pipeline (UNet, VAE, text encoders) as one original-layout file."""
    layers = json.loads((pipeline / "unet" / "config.json").read_text())["layers_per_block"]
    tensors = {**unet_to_original(_load(pipeline, "unet"), layers), **vae_to_original(_load(pipeline, "vae"))}
    # transformers 5 saves CLIPTextModel without its `text_model.` level; the original layout has it.
    clip = {
        (k if k.startswith("text_model.") else f"text_model.{k}"): v for k, v in _load(pipeline, "text_encoder").items()
    }
    if (pipeline / "text_encoder_2").is_dir():  # SDXL
        tensors.update({f"conditioner.embedders.0.transformer.{k}": v for k, v in clip.items()})
        tensors.update(open_clip_to_original(_load(pipeline, "text_encoder_2"), "conditioner.embedders.1.model."))
    else:
        tensors.update({f"cond_stage_model.transformer.{k}": v for k, v in clip.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)
    return out


def write_flux_checkpoint(pipeline: Path, out: Path, prefix: str = "") -> Path:
    """The FLUX transformer alone (how FLUX fine-tunes are shared), optionally under `model.diffusion_model.`."""
    tensors = {prefix + k: v.contiguous() for k, v in flux_to_original(_load(pipeline, "transformer")).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out)
    return out


def fine_tune(base: Path, out: Path, components: tuple[str, ...], seed: int = 1, scale: float = 0.02) -> Path:
    """A copy of the diffusers folder `base` whose `components` have every tensor changed (small noise added, so
    the model still works), as a fine-tune differs from its base; the rest (configs, tokenizers) is the base's."""
    shutil.copytree(base, out)
    generator = torch.Generator().manual_seed(seed)
    for component in components:
        for file in sorted((out / component).glob("*.safetensors")):
            with safe_open(file, "pt") as handle:
                metadata = handle.metadata()
            tuned = {
                name: tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                for name, tensor in load_file(file).items()
            }
            save_file(tuned, file, metadata=metadata)
    return out


def component_tensors(folder: Path, component: str) -> dict:
    """Every tensor of one component of a diffusers folder, by its diffusers name."""
    return _load(folder, component)


def zimage_to_original(state: dict) -> dict:
    """Z-Image's transformer in its original names: q, k and v fused into `attention.qkv`."""
    original = {}
    for name, tensor in state.items():
        if ".attention.to_k." in name or ".attention.to_v." in name:
            continue
        if ".attention.to_q." in name:
            parts = [state[name.replace(".to_q.", f".{p}.")] for p in ("to_q", "to_k", "to_v")]
            original[name.replace(".attention.to_q.", ".attention.qkv.")] = torch.cat(parts, dim=0)
            continue
        for theirs, ours in _ZIMAGE_ORIGINAL.items():
            name = name.replace(theirs, ours)
        original[name] = tensor
    return original


def write_transformer_checkpoint(pipeline: Path, out: Path, family: str, prefix: str = "") -> Path:
    """A Z-Image (original names) or Qwen-Image (diffusers' names) transformer alone, optionally under
    `model.diffusion_model.` (ComfyUI's)."""
    state = _load(pipeline, "transformer")
    if family == "zimage":
        state = zimage_to_original(state)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, out)
    return out
