"""Control-model files (ControlNets and IP-Adapters) checked without torch, by the API at registration and by the
worker before it loads one, against the base model's own UNet (its `config.json` and its safetensors header).

A control version is a folder in diffusers' own layouts:

- `controlnet`: what `ControlNetModel.save_pretrained` writes, `config.json` (`_class_name` ControlNetModel) and
  `diffusion_pytorch_model.safetensors`. A ControlNet is a copy of the base UNet's encoder (`conv_in`, the time
  embedding, `down_blocks`, `mid_block`) plus its own layers (`controlnet_cond_embedding`, one zero convolution per
  down residual in `controlnet_down_blocks`, `controlnet_mid_block`), so its config must give the base UNet's
  architecture, every tensor it shares with the UNet must have the UNet's shape, and its own layers the shapes the
  UNet's residuals take: a ControlNet for another model is refused before a byte of it runs. A FLUX.1 or SD 3.5
  base's (`FluxControlNetModel`, `SD3ControlNetModel`) is checked against its transformer's config: the architecture
  its config repeats and the shapes of its own layers.
- `ip_adapter`: `ip_adapter.safetensors` as diffusers' `load_ip_adapter` reads it (`image_proj.*`: the image
  projection; `ip_adapter.{1,3,5,...}.to_k_ip.weight`/`.to_v_ip.weight`: one pair per cross-attention layer of the
  UNet, in diffusers' order) and its CLIP image encoder in `image_encoder/` (`config.json`, `model.safetensors`,
  a `CLIPVisionModelWithProjection`). Plain IP-Adapters (`image_proj.proj`, four image tokens) are served; the Plus
  and FaceID projections are refused by name. A FLUX.1 base's (XLabs' layout, as diffusers' `FluxIPAdapterMixin`
  reads it) has `ip_adapter.{0,1,...}.to_k_ip`/`.to_v_ip` weights and biases, one pair per double block of the
  transformer, each from its `joint_attention_dim` to its width, checked against its transformer's config.

Every file passes the one safetensors check (`contract/safetensors_checks.py`: overlapping or out-of-file tensors
refused), floating weights only, none NaN or infinite (`lora_files.check_finite`); no pickle, nothing else in the
folder. The version's digest is over its files (`digest`), so the worker loads exactly what was checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Literal

from contract.lora_files import AdapterFileError, bytes_reader, check_finite, read_header
from contract.safetensors_checks import is_pickle

ControlKind = Literal["controlnet", "ip_adapter"]
CONTROL_KINDS: tuple[str, ...] = ("controlnet", "ip_adapter")
CONTROLNET_FILES = ("config.json", "diffusion_pytorch_model.safetensors")
IP_ADAPTER_FILES = ("ip_adapter.safetensors", "image_encoder/config.json", "image_encoder/model.safetensors")
FILES: dict[str, tuple[str, ...]] = {"controlnet": CONTROLNET_FILES, "ip_adapter": IP_ADAPTER_FILES}
# The base model's UNet, relative to its weights path (diffusers' layout).
BASE_UNET_CONFIG = "unet/config.json"
BASE_UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"
# FLUX.1's transformer: its config alone (the published weights are sharded; the config fixes every shape a
# ControlNet of it must have).
BASE_TRANSFORMER_CONFIG = "transformer/config.json"
# The ControlNet class of each base denoiser class (diffusers' names): what a controlnet version's config must name.
CONTROLNET_CLASSES = {"ControlNetModel": "ControlNetModel", "ControlNetUnionModel": "ControlNetUnionModel",
                      "FluxControlNetModel": "FluxControlNetModel",
                      "SD3ControlNetModel": "SD3ControlNetModel"}  # fmt: skip
# A UNet's ControlNet may be a ControlNet Union (xinsir's SDXL Union: one model, a control type per mode).
_UNION_OF = {"ControlNetModel": "ControlNetUnionModel"}
_UNION_OWN = ("task_embedding", "transformer_layes.", "spatial_ch_projs.", "control_add_embedding.")
_CONTROLNET_OF = {"UNet2DConditionModel": "ControlNetModel", "FluxTransformer2DModel": "FluxControlNetModel",
                  "SD3Transformer2DModel": "SD3ControlNetModel"}  # fmt: skip
# The FLUX.1 transformer architecture a FluxControlNetModel's config repeats (`from_transformer` copies these).
FLUX_ARCHITECTURE_KEYS = (
    "patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
    "pooled_projection_dim", "axes_dims_rope",
)  # fmt: skip
# The SD 3.5 transformer architecture an SD3ControlNetModel's config repeats; a ControlNet that embeds the text
# itself (InstantX's; joint_attention_dim set, unlike Stability's SD 3.5 ControlNets) repeats its text widths too.
SD3_ARCHITECTURE_KEYS = ("patch_size", "in_channels", "attention_head_dim", "num_attention_heads",
                         "pooled_projection_dim")  # fmt: skip
SD3_TEXT_KEYS = ("joint_attention_dim", "caption_projection_dim")
WEIGHT_DTYPES = ("F16", "BF16", "F32")
# The UNet architecture a ControlNet's config repeats (`ControlNetModel.from_unet` copies these from the UNet).
ARCHITECTURE_KEYS = (
    "in_channels", "block_out_channels", "down_block_types", "layers_per_block", "cross_attention_dim",
    "attention_head_dim", "num_attention_heads", "transformer_layers_per_block", "norm_num_groups",
    "use_linear_projection", "class_embed_type", "addition_embed_type", "addition_time_embed_dim",
    "projection_class_embeddings_input_dim", "encoder_hid_dim", "encoder_hid_dim_type",
)  # fmt: skip
# An inpainting UNet's input channels: the latents (4), the mask (1) and the masked image's latents (4).
INPAINT_IN_CHANNELS = 9
_CONTROLNET_OWN = ("controlnet_cond_embedding.", "controlnet_down_blocks.", "controlnet_mid_block.")
_IP_KEY = re.compile(r"^ip_adapter\.(\d+)\.(to_k_ip|to_v_ip)\.weight$")
_ATTN2 = re.compile(r"^(down_blocks|up_blocks|mid_block)\.(?:(\d+)\.)?attentions\.(\d+)\.transformer_blocks\.(\d+)"
                    r"\.attn2\.to_k\.weight$")  # fmt: skip
_BLOCK_ORDER = {"down_blocks": 0, "up_blocks": 1, "mid_block": 2}  # the UNet's module order: its processors'


class ControlFileError(AdapterFileError):
    """The control model is refused; the message names the file and the problem (a 422 at registration)."""


@dataclass(frozen=True)
class ControlSummary:
    """What a checked control version is: its digest over the folder, its bytes and tensor count."""

    sha256: str
    bytes: int
    tensors: int
    # Elements over every tensor: its bytes on the device in the serving dtype are these times the dtype's size.
    parameters: int = 0


def digest(files: dict[str, bytes]) -> str:
    """The version's SHA-256: over each file's name and SHA-256, by name (what the worker checks on load)."""
    lines = "".join(f"{name}\0{hashlib.sha256(data).hexdigest()}\n" for name, data in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_file_names(kind: str, names: list[str]) -> None:
    """Exactly the kind's files (diffusers' names), safetensors and JSON only: no pickle, nothing else."""
    pickled = sorted(name for name in names if is_pickle(name))
    if pickled:
        raise ControlFileError(f"pickle-format files are refused (safetensors only): {', '.join(pickled)}")
    expected = FILES[kind]
    others = sorted(set(names) - set(expected))
    if others:
        raise ControlFileError(f"a {kind} version holds {', '.join(expected)} only; found {', '.join(others)}")
    missing = [name for name in expected if name not in names]
    if missing:
        raise ControlFileError(f"a {kind} version needs {', '.join(missing)}")


def check_control(kind: str, files: dict[str, bytes], base_config: dict, base_header: dict) -> ControlSummary:
    """Checks one control version's files against the base UNet (`base_config`: its config.json; `base_header`:
    its weights' safetensors header); ControlFileError names the reason."""
    if kind not in FILES:
        raise ControlFileError(f"kind: {kind!r} is not one of {', '.join(CONTROL_KINDS)}")
    check_file_names(kind, list(files))
    headers = {}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            headers[name] = _checked_weights(name, data)
    if kind == "controlnet":
        config = _config(files["config.json"], "config.json")
        expected = _CONTROLNET_OF.get(base_config.get("_class_name"), "ControlNetModel")
        if config.get("_class_name") not in (expected, _UNION_OF.get(expected)):
            raise ControlFileError(f"config.json: _class_name {config.get('_class_name')!r} is not {expected} (the "
                                   f"base model's {base_config.get('_class_name')} takes that)")  # fmt: skip
        if expected == "FluxControlNetModel":
            _check_flux_controlnet(config, headers["diffusion_pytorch_model.safetensors"], base_config)
        elif expected == "SD3ControlNetModel":
            _check_sd3_controlnet(config, headers["diffusion_pytorch_model.safetensors"], base_config)
        else:
            _check_controlnet(config, headers["diffusion_pytorch_model.safetensors"], base_config, base_header)
    else:
        encoder = _config(files["image_encoder/config.json"], "image_encoder/config.json")
        flux = base_config.get("_class_name") == "FluxTransformer2DModel"
        check = _check_flux_ip_adapter if flux else _check_ip_adapter
        check(headers["ip_adapter.safetensors"], encoder, headers["image_encoder/model.safetensors"], base_config,
              base_header)  # fmt: skip
    return ControlSummary(
        sha256=digest(files),
        bytes=sum(len(data) for data in files.values()),
        tensors=sum(len(header) for header in headers.values()),
        parameters=sum(math.prod(entry["shape"]) for header in headers.values() for entry in header.values()),
    )


def _checked_weights(name: str, data: bytes) -> dict:
    """The file's header, checked as safetensors; floating weights, all finite."""
    try:
        header = read_header(bytes_reader(data), len(data))
        for tensor, entry in header.items():
            if entry["dtype"] not in WEIGHT_DTYPES:
                raise ControlFileError(f"{tensor}: dtype {entry['dtype']} ({', '.join(WEIGHT_DTYPES)} only)")
        check_finite(header, data)
    except AdapterFileError as exc:
        raise ControlFileError(f"{name}: {exc}") from exc
    return header


def _config(data: bytes, name: str) -> dict:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ControlFileError(f"{name} is not JSON") from exc
    if not isinstance(config, dict):
        raise ControlFileError(f"{name} is not a JSON object")
    return config


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def _check_controlnet(config: dict, header: dict, base_config: dict, base_header: dict) -> None:
    if config.get("_class_name") not in ("ControlNetModel", "ControlNetUnionModel"):
        raise ControlFileError(f"config.json: _class_name {config.get('_class_name')!r} is not ControlNetModel")
    own = _CONTROLNET_OWN + (_UNION_OWN if config["_class_name"] == "ControlNetUnionModel" else ())
    base_config, base_header = _latents_view(base_config, base_header)
    for key in ARCHITECTURE_KEYS:
        mine, base = config.get(key), base_config.get(key)
        if isinstance(mine, list) or isinstance(base, list):  # JSON lists; a config may write a scalar for all
            mine, base = json.dumps(mine), json.dumps(base)
        if mine != base:
            raise ControlFileError(f"config.json: {key} {config.get(key)!r} does not match the base UNet's "
                                   f"{base_config.get(key)!r} (a ControlNet for another model?)")  # fmt: skip
    where = "diffusion_pytorch_model.safetensors"
    for name, entry in header.items():
        if name.startswith(own):
            continue
        base = base_header.get(name)
        if base is None:
            raise ControlFileError(f"{where}: {name} is neither the base UNet's nor a ControlNet layer")
        if entry["shape"] != base["shape"]:
            raise ControlFileError(f"{where}: {name} is {_shape(entry['shape'])}, the base UNet's is "
                                   f"{_shape(base['shape'])} (a ControlNet for another model?)")  # fmt: skip
    channels = config["block_out_channels"]
    per_block = config["layers_per_block"]
    # One zero convolution per residual the UNet's down blocks hand on: conv_in's, each layer's, each downsampler's.
    expected = [channels[0]]
    for index, width in enumerate(channels):
        expected += [width] * per_block + ([width] if index < len(channels) - 1 else [])
    wanted = {f"controlnet_down_blocks.{i}.weight": [width, width, 1, 1] for i, width in enumerate(expected)}
    wanted["controlnet_mid_block.weight"] = [channels[-1], channels[-1], 1, 1]
    embedding_out = header.get("controlnet_cond_embedding.conv_out.weight")
    if embedding_out is None or embedding_out["shape"][:1] != [channels[0]]:
        raise ControlFileError(f"{where}: controlnet_cond_embedding.conv_out.weight must have {channels[0]} outputs "
                               "(the UNet's first block)")  # fmt: skip
    for name, shape in wanted.items():
        entry = header.get(name)
        if entry is None:
            raise ControlFileError(f"{where}: {name} is missing (the base UNet has {len(expected)} down residuals)")
        if entry["shape"] != shape:
            raise ControlFileError(f"{where}: {name} is {_shape(entry['shape'])}, the base UNet's residual needs "
                                   f"{_shape(shape)}")  # fmt: skip
    extra = [name for name in header if name.startswith("controlnet_down_blocks.") and name.endswith(".weight")
             and name not in wanted]  # fmt: skip
    if extra:
        raise ControlFileError(f"{where}: {extra[0]}: more zero convolutions than the base UNet has down residuals")


def _latents_view(base_config: dict, base_header: dict) -> tuple[dict, dict]:
    """The base UNet as its ControlNets see it. An inpainting UNet's input is the latents, the mask and the masked
    image's latents (9 channels); its ControlNets take the latents alone (4: diffusers'
    `StableDiffusionControlNetInpaintPipeline` gives them `control_model_input`), so theirs is the plain UNet's."""
    channels = base_config.get("in_channels")
    if channels != INPAINT_IN_CHANNELS:
        return base_config, base_header
    latents = (channels - 1) // 2
    view = dict(base_header)
    conv_in = view.get("conv_in.weight")
    if conv_in is not None:
        view["conv_in.weight"] = {**conv_in, "shape": [conv_in["shape"][0], latents, *conv_in["shape"][2:]]}
    return {**base_config, "in_channels": latents}, view


def union_modes(kind: str, files: dict[str, bytes]) -> int | None:
    """A ControlNet Union's number of control modes (SDXL's `num_control_type`, FLUX.1's `num_mode`); None for a
    ControlNet without modes (or an IP-Adapter). For checked files."""
    if kind != "controlnet":
        return None
    config = _config(files["config.json"], "config.json")
    if config.get("_class_name") == "ControlNetUnionModel":
        return int(config.get("num_control_type") or 6)  # diffusers' default
    modes = config.get("num_mode") if config.get("_class_name") == "FluxControlNetModel" else None
    return None if modes is None else int(modes)


def controlnet_blocks(kind: str, files: dict[str, bytes]) -> int | None:
    """The residuals a FLUX.1 or SD 3.5 ControlNet hands its transformer, one per block of its own (its config's
    `num_layers` and `num_single_layers`): what the memory plan counts of its call; None for a UNet's ControlNet (its
    residuals are the UNet's skips) or an IP-Adapter. For checked files."""
    if kind != "controlnet":
        return None
    config = _config(files["config.json"], "config.json")
    if config.get("_class_name") not in ("FluxControlNetModel", "SD3ControlNetModel"):
        return None
    return int(config.get("num_layers") or 0) + int(config.get("num_single_layers") or 0)


def base_denoiser_files(family: str) -> tuple[str, str | None]:
    """The base model's denoiser files a control version is checked against, relative to its weights path: its
    config and its safetensors weights (None: the config alone, FLUX.1's and SD 3.5's sharded transformers)."""
    if family in ("flux", "sd3"):
        return BASE_TRANSFORMER_CONFIG, None
    return BASE_UNET_CONFIG, BASE_UNET_WEIGHTS


def _check_flux_controlnet(config: dict, header: dict, base_config: dict) -> None:
    """A FluxControlNetModel of the base transformer: its architecture, and the shapes of its embedders and of one
    projection per block it hands the transformer (derived from the base's config)."""
    for key in FLUX_ARCHITECTURE_KEYS:
        if json.dumps(config.get(key)) != json.dumps(base_config.get(key)):
            raise ControlFileError(f"config.json: {key} {config.get(key)!r} does not match the base transformer's "
                                   f"{base_config.get(key)!r} (a ControlNet for another model?)")  # fmt: skip
    inner = base_config["num_attention_heads"] * base_config["attention_head_dim"]
    channels = base_config["in_channels"]
    wanted = {
        "x_embedder.weight": [inner, channels],
        "controlnet_x_embedder.weight": [inner, channels],
        "context_embedder.weight": [inner, base_config["joint_attention_dim"]],
        **{f"controlnet_blocks.{i}.weight": [inner, inner] for i in range(int(config.get("num_layers") or 0))},
        **{f"controlnet_single_blocks.{i}.weight": [inner, inner]
           for i in range(int(config.get("num_single_layers") or 0))},
    }  # fmt: skip
    if config.get("num_mode") is not None:
        wanted["controlnet_mode_embedder.weight"] = [int(config["num_mode"]), inner]
    where = "diffusion_pytorch_model.safetensors"
    for name, shape in wanted.items():
        entry = header.get(name)
        if entry is None:
            raise ControlFileError(f"{where}: {name} is missing")
        if entry["shape"] != shape:
            raise ControlFileError(f"{where}: {name} is {_shape(entry['shape'])}, the base transformer needs "
                                   f"{_shape(shape)} (a ControlNet for another model?)")  # fmt: skip


def _check_sd3_controlnet(config: dict, header: dict, base_config: dict) -> None:
    """An SD3ControlNetModel of the base SD 3.5 transformer: its architecture, and the shapes of its control input's
    patch embedding and of one projection per block it hands the transformer (derived from the base's config)."""
    keys = SD3_ARCHITECTURE_KEYS + (SD3_TEXT_KEYS if config.get("joint_attention_dim") is not None else ())
    for key in keys:
        if json.dumps(config.get(key)) != json.dumps(base_config.get(key)):
            raise ControlFileError(f"config.json: {key} {config.get(key)!r} does not match the base transformer's "
                                   f"{base_config.get(key)!r} (a ControlNet for another model?)")  # fmt: skip
    inner = base_config["num_attention_heads"] * base_config["attention_head_dim"]
    patch = base_config["patch_size"]
    channels = base_config["in_channels"] + int(config.get("extra_conditioning_channels") or 0)
    wanted = {
        "pos_embed_input.proj.weight": [inner, channels, patch, patch],
        **{f"controlnet_blocks.{i}.weight": [inner, inner] for i in range(int(config.get("num_layers") or 0))},
    }
    if config.get("joint_attention_dim") is not None:
        wanted["context_embedder.weight"] = [base_config["caption_projection_dim"], base_config["joint_attention_dim"]]
    where = "diffusion_pytorch_model.safetensors"
    for name, shape in wanted.items():
        entry = header.get(name)
        if entry is None:
            raise ControlFileError(f"{where}: {name} is missing")
        if entry["shape"] != shape:
            raise ControlFileError(f"{where}: {name} is {_shape(entry['shape'])}, the base transformer needs "
                                   f"{_shape(shape)} (a ControlNet for another model?)")  # fmt: skip


def cross_attention_layers(base_header: dict) -> list[list[int]]:
    """The base UNet's cross-attention (attn2) key projections' shapes, in diffusers' processor order (the order
    `load_ip_adapter` numbers its `ip_adapter.{1,3,5,...}` pairs)."""

    def order(name: str) -> tuple:
        match = _ATTN2.fullmatch(name)
        assert match is not None
        block, index, attention, layer = match.groups()
        return _BLOCK_ORDER[block], int(index or 0), int(attention), int(layer)

    names = sorted((name for name in base_header if _ATTN2.fullmatch(name)), key=order)
    return [base_header[name]["shape"] for name in names]


def _check_ip_adapter(header: dict, encoder: dict, encoder_header: dict, base_config: dict, base_header: dict) -> None:
    where = "ip_adapter.safetensors"
    projection = {name: entry for name, entry in header.items() if name.startswith("image_proj.")}
    layers = {name: entry for name, entry in header.items() if name.startswith("ip_adapter.")}
    others = sorted(set(header) - set(projection) - set(layers))
    if others:
        raise ControlFileError(f"{where}: {others[0]} is neither image_proj.* nor ip_adapter.*")
    if "image_proj.proj.weight" not in projection:
        kind = "Plus" if "image_proj.latents" in projection else "FaceID or Full Face"
        raise ControlFileError(f"{where}: an IP-Adapter {kind} projection; plain IP-Adapters (image_proj.proj) only")
    cross = base_config.get("cross_attention_dim")
    rows, embeddings = projection["image_proj.proj.weight"]["shape"]
    if rows != 4 * cross:
        raise ControlFileError(f"{where}: image_proj.proj.weight has {rows} rows; four image tokens of the base "
                               f"UNet's cross_attention_dim {cross} need {4 * cross}")  # fmt: skip
    _check_image_encoder(encoder, encoder_header, embeddings)
    expected = cross_attention_layers(base_header)
    found: dict[int, dict[str, list[int]]] = {}
    for name, entry in layers.items():
        match = _IP_KEY.fullmatch(name)
        if match is None:
            raise ControlFileError(f"{where}: {name} is not ip_adapter.N.to_k_ip.weight or .to_v_ip.weight")
        found.setdefault(int(match.group(1)), {})[match.group(2)] = entry["shape"]
    numbers = [2 * index + 1 for index in range(len(expected))]
    if sorted(found) != numbers:
        raise ControlFileError(f"{where}: {len(found)} ip_adapter layers; the base UNet has {len(expected)} "
                               "cross-attention layers (a file for another model?)")  # fmt: skip
    for number, shape in zip(numbers, expected, strict=True):
        for part in ("to_k_ip", "to_v_ip"):
            mine = found[number].get(part)
            if mine != shape:
                raise ControlFileError(f"{where}: ip_adapter.{number}.{part}.weight is "
                                       f"{_shape(mine) if mine else 'missing'}; the base UNet's cross-attention "
                                       f"there needs {_shape(shape)}")  # fmt: skip


def image_prompt_shape(files: dict[str, bytes], base_config: dict) -> tuple[int, int]:
    """A checked IP-Adapter's (image embedding width, image tokens): its image projection's input width, and its rows
    over the base denoiser's text width (a UNet's `cross_attention_dim`, a FLUX.1 transformer's
    `joint_attention_dim`)."""
    data = files["ip_adapter.safetensors"]
    rows, width = read_header(bytes_reader(data), len(data))["image_proj.proj.weight"]["shape"]
    text = base_config.get("cross_attention_dim") or base_config["joint_attention_dim"]
    return width, rows // text


def slots_problem(model: str, width: int, tokens: int, slots_width: int, slots_tokens: int) -> str | None:
    """Why an IP-Adapter of `width`-wide image embeddings and `tokens` image tokens does not fit a compiled model's
    IP-Adapter slots (contract/model_spec.py `ImagePromptSlots`), or None when it does (shared by the API's
    registration and the worker)."""
    if (width, tokens) == (slots_width, slots_tokens):
        return None
    return (f"the IP-Adapter takes {width}-wide image embeddings to {tokens} image tokens; {model} is compiled with "
            f"IP-Adapter slots of {slots_width}-wide embeddings and {slots_tokens} tokens "
            "(controls.image_prompt_slots): an IP-Adapter of that shape only")  # fmt: skip


def _check_image_encoder(encoder: dict, encoder_header: dict, embeddings: int) -> None:
    """The IP-Adapter's CLIP image encoder: a CLIPVisionModelWithProjection giving the `embeddings` its image
    projection takes."""
    if encoder.get("projection_dim") != embeddings:
        raise ControlFileError(f"image_encoder/config.json: projection_dim {encoder.get('projection_dim')!r} is not "
                               f"the {embeddings} image_proj.proj.weight takes")  # fmt: skip
    if "CLIPVisionModelWithProjection" not in (encoder.get("architectures") or []):
        raise ControlFileError("image_encoder/config.json: architectures must name CLIPVisionModelWithProjection")
    if "visual_projection.weight" not in encoder_header:
        raise ControlFileError("image_encoder/model.safetensors: no visual_projection.weight (a CLIP vision model "
                               "with projection)")  # fmt: skip
    if encoder_header["visual_projection.weight"]["shape"][0] != embeddings:
        raise ControlFileError(f"image_encoder/model.safetensors: visual_projection.weight is "
                               f"{_shape(encoder_header['visual_projection.weight']['shape'])}, not {embeddings} "
                               "image embeddings")  # fmt: skip


def _check_flux_ip_adapter(header: dict, encoder: dict, encoder_header: dict, base_config: dict, _: dict) -> None:
    """A FLUX.1 IP-Adapter of the base transformer (XLabs' layout as diffusers converts it): its image projection gives
    tokens of the transformer's `joint_attention_dim` (four; XLabs' 16 when the projection has 65,536 rows, as
    diffusers reads it), and one key/value pair with biases per double block, from that width to the transformer's."""
    where = "ip_adapter.safetensors"
    others = sorted(name for name in header if not name.startswith(("image_proj.", "ip_adapter.")))
    if others:
        raise ControlFileError(f"{where}: {others[0]} is neither image_proj.* nor ip_adapter.*")
    if "image_proj.proj.weight" not in header:
        raise ControlFileError(f"{where}: no image_proj.proj.weight (plain IP-Adapters only)")
    joint = base_config["joint_attention_dim"]
    inner = base_config["num_attention_heads"] * base_config["attention_head_dim"]
    rows, embeddings = header["image_proj.proj.weight"]["shape"]
    tokens = 16 if rows == 65536 else 4  # diffusers' rule (FluxTransformer2DLoadersMixin)
    if rows != tokens * joint:
        raise ControlFileError(f"{where}: image_proj.proj.weight has {rows} rows; {tokens} image tokens of the base "
                               f"transformer's joint_attention_dim {joint} need {tokens * joint}")  # fmt: skip
    _check_image_encoder(encoder, encoder_header, embeddings)
    blocks = int(base_config.get("num_layers") or 0)
    wanted = {f"ip_adapter.{i}.{part}.{kind}": [inner, joint] if kind == "weight" else [inner]
              for i in range(blocks) for part in ("to_k_ip", "to_v_ip") for kind in ("weight", "bias")}  # fmt: skip
    extra = sorted(name for name in header if name.startswith("ip_adapter.") and name not in wanted)
    if extra:
        raise ControlFileError(f"{where}: {extra[0]}: the base transformer has {blocks} double blocks (a file for "
                               "another model?)")  # fmt: skip
    for name, shape in wanted.items():
        entry = header.get(name)
        if entry is None or entry["shape"] != shape:
            found = _shape(entry["shape"]) if entry else "missing"
            raise ControlFileError(f"{where}: {name} is {found}; the base transformer's double block there needs "
                                   f"{_shape(shape)}")  # fmt: skip
