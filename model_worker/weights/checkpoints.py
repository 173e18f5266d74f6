"""Converts a single-file checkpoint (SD 1.5, SDXL, FLUX.1, Z-Image, Qwen-Image) into a diffusers folder with diffusers'
own loaders.

Fine-tunes are mostly shared as one `.safetensors` file in the original layout (CompVis/Stability's
`model.diffusion_model.*` UNet with its VAE and text encoders; Black Forest Labs' FLUX transformer alone; Z-Image's and
Qwen-Image's transformer alone, as ComfyUI shares them). A FLUX.2 file is refused (import it as a folder). Its
family is read from its tensor names; nothing in it is executed or unpickled (only safetensors, its header checked
first as the format requires: `contract/safetensors_checks.py`). A single file carries weights but no configuration: the *base*, a diffusers folder of the same family
(local, or the weights path of a model already served), gives every component's configuration, the
tokenizers and scheduler, and every component the file lacks (a FLUX fine-tune ships only its transformer).
A fine-tune has its base's shapes: the file's key tensors are checked against the base's own safetensors
headers before converting, and every converted component against them after. One setting is taken from what
the file is rather than from the base: a VAE that is not the base's decodes in float32 (`force_upcast`) even
where the base's, the fp16-fix VAE, need not, since a file may bake in the original SDXL VAE.

Each component is converted by diffusers (`Model.from_single_file(..., config=base, subfolder=...)`, and
`create_diffusers_clip_model_from_ldm` for the CLIP text encoders, what `Pipeline.from_single_file` calls),
offline: the base is a local directory and `local_files_only` is set. One step is adapted: diffusers 0.42's
FLUX converter splits `single_blocks.{i}.linear1` into q, k, v and the MLP at a hard-coded width of 3072
(FLUX.1's); `convert_flux_transformer` runs diffusers' converter for everything and redoes that one split at
the width the file itself has (`img_in.weight`'s rows), so narrower FLUX-architecture models convert too.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from contract.families import family_of
from contract.safetensors_checks import SafetensorsError, is_pickle, read_file_header

UNET_PREFIX = "model.diffusion_model."
# diffusers 0.42.1 `convert_flux_transformer_checkpoint_to_diffusers`: `inner_dim = 3072`.
DIFFUSERS_FLUX_WIDTH = 3072


class CheckpointRefusedError(ValueError):
    """The checkpoint cannot be converted; the message names the file and the problem."""


@dataclass(frozen=True)
class Component:
    """A pipeline component a single file may carry: its diffusers class and the names of its tensors there."""

    name: str
    cls: str
    prefixes: tuple[str, ...]
    text_encoder: bool = False


COMPONENTS = {
    "sd15": (
        Component("unet", "UNet2DConditionModel", (UNET_PREFIX,)),
        Component("vae", "AutoencoderKL", ("first_stage_model.",)),
        Component("text_encoder", "CLIPTextModel", ("cond_stage_model.transformer.",), text_encoder=True),
    ),
    "sdxl": (
        Component("unet", "UNet2DConditionModel", (UNET_PREFIX,)),
        Component("vae", "AutoencoderKL", ("first_stage_model.",)),
        Component("text_encoder", "CLIPTextModel", ("conditioner.embedders.0.transformer.",), text_encoder=True),
        Component(
            "text_encoder_2", "CLIPTextModelWithProjection", ("conditioner.embedders.1.model.",), text_encoder=True
        ),  # fmt: skip
    ),
    # FLUX files are the transformer's tensors, bare or under `model.diffusion_model.`; the rest is the base's.
    "flux": (Component("transformer", "FluxTransformer2DModel", ("",)),),
    # So are Z-Image's (its original names: fused q/k/v, `x_embedder`, `final_layer`) and Qwen-Image's (diffusers'
    # names already, as ComfyUI shares them).
    "zimage": (Component("transformer", "ZImageTransformer2DModel", ("",)),),
    "qwenimage": (Component("transformer", "QwenImageTransformer2DModel", ("",)),),
}
# The families whose file is their transformer alone, each with a tensor name that only it has.
TRANSFORMER_FILES = {
    "zimage": re.compile(
        r"^(model\.diffusion_model\.)?(layers|noise_refiner|context_refiner)\.\d+\.adaLN_modulation\."
    ),
    "qwenimage": re.compile(r"^(model\.diffusion_model\.)?transformer_blocks\.\d+\.img_mod\."),
}
_FLUX2_NAMES = re.compile(r"^(model\.diffusion_model\.)?(double|single)_stream_modulation")
_FLUX_NAMES = re.compile(r"^(model\.diffusion_model\.)?(double_blocks|single_blocks)\.\d+\.")
_SD3_NAMES = re.compile(r"^(model\.diffusion_model\.)?joint_blocks\.\d+\.")

# Tensors whose shapes say which model a file was trained from: (name in the file, name in the base component).
_SIGNATURES = {
    "sd15": (
        "unet",
        [
            ("input_blocks.0.0.weight", "conv_in.weight"),
            ("out.2.weight", "conv_out.weight"),
            ("time_embed.0.weight", "time_embedding.linear_1.weight"),
        ],
    ),  # fmt: skip
    "flux": (
        "transformer",
        [
            ("img_in.weight", "x_embedder.weight"),
            ("txt_in.weight", "context_embedder.weight"),
            ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight"),
        ],
    ),  # fmt: skip
    "zimage": (
        "transformer",
        [
            ("x_embedder.weight", "all_x_embedder.2-1.weight"),
            ("cap_embedder.1.weight", "cap_embedder.1.weight"),
            ("final_layer.linear.weight", "all_final_layer.2-1.linear.weight"),
        ],
    ),  # fmt: skip
    "qwenimage": (
        "transformer",
        [
            ("img_in.weight", "img_in.weight"),
            ("txt_in.weight", "txt_in.weight"),
            ("proj_out.weight", "proj_out.weight"),
        ],
    ),  # fmt: skip
}
_SIGNATURES["sdxl"] = ("unet", [*_SIGNATURES["sd15"][1], ("label_emb.0.0.weight", "add_embedding.linear_1.weight")])


def read_checkpoint_header(path: Path) -> dict:
    """The file's safetensors header; a pickle (whatever its name), a foreign format or a truncated file is refused."""
    if is_pickle(path.name):
        raise CheckpointRefusedError(f"{path.name}: a pickle checkpoint ({path.suffix}); only safetensors is "
                                     "imported (loading a pickle runs code from the file)")  # fmt: skip
    if path.suffix != ".safetensors":
        raise CheckpointRefusedError(f"{path.name}: not a .safetensors file")
    try:
        return read_file_header(path)
    except SafetensorsError as exc:
        raise CheckpointRefusedError(f"{path.name}: {exc}") from exc


def detect_family(names: list[str] | set[str], file: str) -> str:
    """sd15, sdxl, flux, zimage or qwenimage, from the tensor names alone."""
    if any(_FLUX2_NAMES.match(name) for name in names):
        raise CheckpointRefusedError(f"{file}: a FLUX.2 checkpoint (double_stream_modulation); import FLUX.2 [klein] "
                                     "as a diffusers folder")  # fmt: skip
    for family, pattern in TRANSFORMER_FILES.items():
        if any(pattern.match(name) for name in names):
            return family
    if any(_FLUX_NAMES.match(name) for name in names):
        return "flux"
    if any(_SD3_NAMES.match(name) for name in names):
        raise CheckpointRefusedError(f"{file}: an SD 3 checkpoint (joint_blocks); import SD 3.5 as a diffusers folder")
    if any(name.startswith(("conditioner.embedders.1.model.", UNET_PREFIX + "label_emb.")) for name in names):
        return "sdxl"
    if any(name.startswith("cond_stage_model.model.") for name in names):
        raise CheckpointRefusedError(f"{file}: an SD 2.x checkpoint (OpenCLIP text encoder); SD 2.x is not served")
    if any(name.startswith((UNET_PREFIX + "input_blocks.", "cond_stage_model.transformer.")) for name in names):
        return "sd15"
    raise CheckpointRefusedError(f"{file}: no SD 1.5, SDXL, FLUX.1, Z-Image or Qwen-Image tensors (e.g. "
                                 f"{UNET_PREFIX}input_blocks.*, conditioner.embedders.1.model.*, double_blocks.*, "
                                 "layers.*.adaLN_modulation.*, transformer_blocks.*.img_mod.*); a LoRA or another "
                                 "model?")  # fmt: skip


def pipeline_class(index: Path, label: str = "") -> str:
    """The `_class_name` a diffusers folder's model_index.json names: the folder import and a base read it alike."""
    try:
        pipeline = json.loads(index.read_text())["_class_name"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointRefusedError(f"{label}{index}: unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(pipeline, str):
        raise CheckpointRefusedError(f"{label}{index}: _class_name is {pipeline!r}, not a pipeline class name")
    return pipeline


def base_pipeline(base: Path) -> str:
    index = base / "model_index.json"
    if not index.is_file():
        raise CheckpointRefusedError(f"base {base}: no model_index.json (the base must be a diffusers folder)")
    return pipeline_class(index, "base ")


def _base_header(base: Path, component: str) -> dict:
    header = {}
    for file in sorted((base / component).glob("*.safetensors")):
        try:
            header.update(read_file_header(file))  # the header alone: a base's weights run to gigabytes
        except SafetensorsError as exc:
            raise CheckpointRefusedError(f"base {base}: {file.relative_to(base)}: {exc}") from exc
    return header


def check_shapes(header: dict, family: str, base: Path, file: str) -> None:
    """The file's key tensors have the base's shapes (and FLUX its block counts and guidance input)."""
    component, pairs = _SIGNATURES[family]
    base_header = _base_header(base, component)
    unet = component == "unet"
    prefix = UNET_PREFIX if unet or any(name.startswith(UNET_PREFIX) for name in header) else ""
    if unet and not any(name.startswith(UNET_PREFIX) for name in header):
        return  # no UNet in the file: its text encoders and VAE are checked as they convert
    for ours, theirs in pairs:
        entry = header.get(prefix + ours)
        if entry is None:
            raise CheckpointRefusedError(f"{file}: no {prefix + ours} (a {family} checkpoint has one)")
        if theirs not in base_header:
            raise CheckpointRefusedError(f"{file}: the base {base} has no {component}/{theirs} to check it against")
        if entry["shape"] != base_header[theirs]["shape"]:
            raise CheckpointRefusedError(f"{file}: {prefix + ours} is {entry['shape']}, the base's {component}/"
                                         f"{theirs} is {base_header[theirs]['shape']}: not a fine-tune of this base")  # fmt: skip
    if family == "flux":
        config = _base_config(base, "transformer")
        counts = {kind: len({n.split(".")[1] for n in header if n.startswith(prefix + kind + ".")})
                  for kind in ("double_blocks", "single_blocks")}  # fmt: skip
        expected = {"double_blocks": config.get("num_layers"), "single_blocks": config.get("num_single_layers")}
        guided = any(n.startswith(prefix + "guidance_in.") for n in header)
        if counts != expected or guided != bool(config.get("guidance_embeds")):
            raise CheckpointRefusedError(f"{file}: {counts['double_blocks']} double and {counts['single_blocks']} single "
                                         f"blocks, guidance input {guided}; the base has {expected['double_blocks']}, "
                                         f"{expected['single_blocks']}, {bool(config.get('guidance_embeds'))}")  # fmt: skip


def _base_config(base: Path, component: str) -> dict:
    path = base / component / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointRefusedError(f"base {base}: {component}/config.json unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointRefusedError(f"base {base}: {component}/config.json is not an object")
    return config


def convert_flux_transformer(checkpoint: dict) -> dict:
    """diffusers' FLUX converter, with `single_blocks.{i}.linear1` split at the file's own width.

    The converter splits linear1 into (3072, 3072, 3072, 4 x 3072) rows whatever the model's width; it is given
    a zero-copy placeholder of that shape, and its q, k, v and MLP outputs for each block are replaced by the
    real linear1 split at `img_in.weight`'s width (the MLP taking the rest). Every other tensor is diffusers'."""
    import torch
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    checkpoint = {name.removeprefix(UNET_PREFIX): tensor for name, tensor in checkpoint.items()}
    width = checkpoint["img_in.weight"].shape[0]
    if width == DIFFUSERS_FLUX_WIDTH:
        return convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    linear1 = {name: checkpoint[name] for name in checkpoint if re.match(r"single_blocks\.\d+\.linear1\.", name)}
    rows = 3 * DIFFUSERS_FLUX_WIDTH + 4 * DIFFUSERS_FLUX_WIDTH
    for name, tensor in linear1.items():
        checkpoint[name] = torch.zeros((1,) * tensor.ndim, dtype=tensor.dtype).expand(rows, *tensor.shape[1:])
    converted = convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    for name, tensor in linear1.items():
        block, part = re.match(r"single_blocks\.(\d+)\.linear1\.(weight|bias)", name).groups()
        q, k, v, mlp = torch.split(tensor, (width, width, width, tensor.shape[0] - 3 * width), dim=0)
        prefix = f"single_transformer_blocks.{block}."
        for target, value in (("attn.to_q", q), ("attn.to_k", k), ("attn.to_v", v), ("proj_mlp", mlp)):
            converted[f"{prefix}{target}.{part}"] = value.contiguous()
    return converted


def _convert_component(component: Component, tensors: dict, base: Path):
    import diffusers
    import transformers
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm

    if component.text_encoder:
        cls = getattr(transformers, component.cls)
        return create_diffusers_clip_model_from_ldm(cls, tensors, subfolder=component.name, config=str(base),
                                                    local_files_only=True)  # fmt: skip
    if component.cls == "FluxTransformer2DModel":
        tensors = convert_flux_transformer(tensors)  # already diffusers' names: from_single_file loads them as is
    elif component.cls == "QwenImageTransformer2DModel":  # diffusers maps its names as they are: the prefix dropped
        tensors = {name.removeprefix(UNET_PREFIX): tensor for name, tensor in tensors.items()}
    cls = getattr(diffusers, component.cls)
    return cls.from_single_file(tensors, config=str(base), subfolder=component.name, local_files_only=True)


def _check_converted(model, component: str, base: Path, file: str) -> None:
    """Every tensor converted, with its base's name and shape (nothing left uninitialised)."""
    expected = {name: entry["shape"] for name, entry in _base_header(base, component).items()}
    state = model.state_dict()
    got = {name: list(tensor.shape) for name, tensor in state.items()}
    empty = [name for name, tensor in state.items() if tensor.is_meta]
    differing = sorted(n for n in expected.keys() | got.keys() if got.get(n) != expected.get(n))
    if empty or differing:
        what = differing[0] if differing else empty[0]
        raise CheckpointRefusedError(f"{file}: its {component} does not have the base's tensors "
                                     f"({what}: {got.get(what)}, the base's {expected.get(what)}; "
                                     f"{len(differing) + len(empty)} such)")  # fmt: skip


def _needs_upcast(vae, base: Path) -> bool:
    """Whether a converted VAE must decode in float32 where its base says it need not (`force_upcast: false`, the
    fp16-fix VAE SDXL bases often carry). The file's config is the base's, so it says nothing of the file's VAE:
    a file that bakes in another VAE (the original SDXL one overflows float16) gets `force_upcast` unless its
    tensors are the base's (up to half-precision rounding), which is what makes the base's setting true of it."""
    import torch
    from safetensors.torch import load_file

    if vae.config.get("force_upcast", True):
        return False  # decoded in float32 already
    state = vae.state_dict()
    theirs = {name: t for file in sorted((base / "vae").glob("*.safetensors")) for name, t in load_file(file).items()}
    return state.keys() != theirs.keys() or not all(
        torch.allclose(state[name].float(), theirs[name].float(), rtol=2**-8, atol=1e-5) for name in state
    )


def convert_checkpoint(
    path: Path, base: Path, out: Path, family: str | None = None
) -> tuple[str, list[str], list[str]]:
    """Writes the diffusers folder for `path` into `out` (the base's folder, its converted components replaced);
    returns the family, the components taken from the base unchanged, and notes on what differs from the base's
    configuration (a VAE decoded in float32 where the base's is not)."""
    from safetensors.torch import load_file

    header = read_checkpoint_header(path)
    found = detect_family(list(header), path.name)
    if family is not None and family != found:
        raise CheckpointRefusedError(f"{path.name}: --family {family}, but its tensors are a {found} checkpoint")
    pipeline = base_pipeline(base)
    base_family = family_of(pipeline)
    if base_family is None or base_family.name != found:
        raise CheckpointRefusedError(f"{path.name}: a {found} checkpoint, but the base {base} is {pipeline} "
                                     f"({base_family.name if base_family else 'not served'})")  # fmt: skip
    check_shapes(header, found, base, path.name)
    try:
        tensors = load_file(path)  # safetensors: tensors only, nothing executed; the header is checked above
    except Exception as exc:  # e.g. a dtype safetensors knows and this torch does not (F4, F8_E8M0)
        raise CheckpointRefusedError(
            f"{path.name}: safetensors cannot load it here ({type(exc).__name__}: {exc})"
        ) from exc
    shutil.copytree(base, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("maas-manifest.json", ".download-*"))
    from_base, notes = [], []
    for component in COMPONENTS[found]:
        mine = {name: tensor for name, tensor in tensors.items() if name.startswith(component.prefixes)}
        if not mine:
            from_base.append(component.name)
            continue
        try:
            model = _convert_component(component, mine, base)
        except CheckpointRefusedError:
            raise
        except Exception as exc:  # diffusers' converters raise KeyError, ValueError, RuntimeError on foreign files
            raise CheckpointRefusedError(f"{path.name}: its {component.name} does not convert against the base "
                                         f"({type(exc).__name__}: {exc})") from exc  # fmt: skip
        _check_converted(model, component.name, base, path.name)
        if component.name == "vae" and _needs_upcast(model, base):
            model.register_to_config(force_upcast=True)
            notes.append("vae: the file's own, not the base's (force_upcast: false): decoded in float32 (force_upcast)")
        shutil.rmtree(out / component.name)
        model.save_pretrained(out / component.name, safe_serialization=True)
    from_base += [p.name for p in sorted(base.iterdir()) if p.is_dir() and p.name not in
                  {c.name for c in COMPONENTS[found]}]  # fmt: skip
    return found, sorted(set(from_base)), notes
