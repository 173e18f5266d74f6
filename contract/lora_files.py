"""LoRA adapter files checked without torch, by the API at registration and by the worker before it loads one.

An adapter is one safetensors file in one of the layouts diffusers' `load_lora_weights` converts:

- diffusers/PEFT (`save_lora_weights`): `{component}.{module}.lora_A.weight` (rank x in) and `.lora_B.weight`
  (out x rank), `component` one of the family's LoRA components (`unet`, `text_encoder`, `text_encoder_2`,
  `transformer`). diffusers refuses a stray `.alpha` in this layout, so this check does too.
- kohya (`lora_unet_*`, `lora_te_*`/`lora_te1_*`, `lora_te2_*`): `.lora_down.weight`, `.lora_up.weight` and an
  optional scalar `.alpha`; the module is the diffusers module path with dots written as underscores, which is
  how diffusers' conversion reads it back; SDXL files name the UNet in the original (SGM) blocks
  (`input_blocks_4_1_...`, `middle_block_1_...`, `output_blocks_...`), renamed to diffusers' blocks as diffusers
  does (`layers_per_block` read from the base UNet's header). LoCon files add conv layers: down
  (rank x in x kh x kw), up (out x rank x 1 x 1).
- FLUX.1 in kohya's BFL naming (`lora_unet_double_blocks_{i}_img_attn_qkv`, `lora_unet_single_blocks_{i}_linear1`,
  ...): diffusers splits a fused projection into its modules (q, k, v, and FLUX's MLP input), so the file's
  output rows must be those modules' rows side by side.

A family takes the layouts its `Family.lora_layouts` names: Z-Image, FLUX.2 [klein] and Qwen-Image the PEFT one only
(diffusers converts their community layouts with names of their own, not checked here), refused naming the layout.

Every target must exist, with the same shape, in the base model's own safetensors headers (per component), so a
LoRA for another model or family is refused before anything loads it. Only headers are parsed, and checked as the
safetensors format requires (`contract/safetensors_checks.py`): a pickle never is. The one look at the data is for
NaN and infinity (their exponent bits, compared a byte column at a time), which would turn every image the adapter
touches black.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from contract import safetensors_checks
from contract.families import Family
from contract.safetensors_checks import RangeReader, SafetensorsError, is_pickle
from contract.safetensors_checks import bytes_reader as bytes_reader  # what the adapter callers read with

# The dtypes of a LoRA pair's weights diffusers applies; an alpha is a real number torch loads (and, for a float,
# one `check_finite` reads).
LORA_DTYPES = ("F16", "BF16", "F32")
ALPHA_DTYPES = (*LORA_DTYPES, "F64", "I8", "U8", "I16", "I32", "I64")
# The base model's weight file per LoRA component, relative to its weights path (diffusers' layout); a model has
# the ones of its family (SD 1.5: unet and text_encoder; SDXL: both text encoders; FLUX.1: the transformer).
BASE_FILES = {
    "unet": "unet/diffusion_pytorch_model.safetensors",
    "transformer": "transformer/diffusion_pytorch_model.safetensors",
    "text_encoder": "text_encoder/model.safetensors",
    "text_encoder_2": "text_encoder_2/model.safetensors",
}
_PEFT_KEY = re.compile(r"^(unet|transformer|text_encoder|text_encoder_2)\.(.+)\.(lora_A\.weight|lora_B\.weight|alpha)$")
_KOHYA_KEY = re.compile(r"^lora_(unet|te|te1|te2)_(.+)\.(lora_down\.weight|lora_up\.weight|alpha)$")
_KOHYA_COMPONENTS = {"unet": "unet", "te": "text_encoder", "te1": "text_encoder", "te2": "text_encoder_2"}
_PARTS = {"lora_A.weight": "down", "lora_down.weight": "down", "lora_B.weight": "up", "lora_up.weight": "up"}
# FLUX.1 in BFL naming (kohya's FLUX files): block part -> the diffusers modules whose rows it holds, in order.
_BFL_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn_proj": ("attn.to_out.0",),
    "txt_attn_proj": ("attn.to_add_out",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_mod_lin": ("norm1_context.linear",),
}
_BFL_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
_BFL_KEY = re.compile(r"^(double|single)_blocks_(\d+)_(.+)$")
# SDXL in kohya's SGM names (kohya trains SDXL on the original UNet): block -> diffusers block, as diffusers maps them.
_SGM_KEY = re.compile(r"^(?:(input_blocks|output_blocks)_(\d+)_(\d+)|middle_block_(\d+))_(.+)$")
_SGM_INNER = ("resnets", "attentions", "upsamplers")
_SGM_MIDDLE = ("resnets_0", "attentions_0", "resnets_1")
_SGM_RESNET = {"in_layers_2": "conv1", "out_layers_3": "conv2", "emb_layers_1": "time_emb_proj",
               "skip_connection": "conv_shortcut"}  # fmt: skip
_SGM_TOP = {"input_blocks_0_0": "conv_in", "out_2": "conv_out", "time_embed_0": "time_embedding_linear_1",
            "time_embed_2": "time_embedding_linear_2", "label_emb_0_0": "add_embedding_linear_1",
            "label_emb_0_2": "add_embedding_linear_2"}  # fmt: skip

# A base weights file by its path relative to the weights root: (its RangeReader, its size), or None when absent.
FileOpener = Callable[[str], "tuple[RangeReader, int] | None"]


def _all_ones(mask: int) -> bytes:
    """A `bytes.translate` table: 1 for a byte whose `mask` bits are all set, 0 for any other."""
    return bytes(int(byte & mask == mask) for byte in range(256))


# Per floating dtype: its element size, and (byte within a little-endian element, its exponent bits) for every
# byte that holds exponent bits. An element is NaN or infinite exactly when all its exponent bits are set.
_EXPONENT_BYTES = {
    "F64": (8, ((7, 0x7F), (6, 0xF0))),
    "F32": (4, ((3, 0x7F), (2, 0x80))),
    "F16": (2, ((1, 0x7C),)),
    "BF16": (2, ((1, 0x7F), (0, 0x80))),
    "F8_E5M2": (1, ((0, 0x7C),)),
    "F8_E4M3": (1, ((0, 0x7F),)),  # E4M3FN: no infinity, and NaN is the one all-ones pattern
}
_TABLES = {mask: _all_ones(mask) for _, exponent in _EXPONENT_BYTES.values() for _, mask in exponent}


class AdapterFileError(ValueError):
    """The adapter is refused; the message names the problem (a 422 at registration, bad_input on the worker)."""


@dataclass(frozen=True)
class LoraTarget:
    """One low-rank pair of a file: `module` as the file writes it (a dotted path, or kohya's underscored name)."""

    component: str
    module: str
    layout: str  # "peft" or "kohya"
    rank: int
    down: tuple[int, ...]  # lora_A / lora_down: rank x in (x kh x kw for a conv layer)
    up: tuple[int, ...]  # lora_B / lora_up: out x rank (x 1 x 1)

    @property
    def name(self) -> str:
        if self.layout == "peft":
            return f"{self.component}.{self.module}"
        prefix = {"unet": "unet", "text_encoder": "te", "text_encoder_2": "te2"}[self.component]
        return f"lora_{prefix}_{self.module}"


def read_header(read: RangeReader, size: int, file: str = "") -> dict:
    """The file's tensors, checked as the safetensors format requires (`contract/safetensors_checks.py`); a
    malformed file is an AdapterFileError (`file`, when given, names it in the message)."""
    try:
        return safetensors_checks.read_header(read, size)
    except SafetensorsError as exc:
        raise AdapterFileError(f"{file}: {exc}" if file else str(exc)) from exc


def base_headers(components: tuple[str, ...], open_file: FileOpener) -> dict[str, dict]:
    """The base model's safetensors header per LoRA component: its one weights file, or the shards its
    `.index.json` names (FLUX.1's transformer ships in shards), merged. A component with neither is left out."""
    headers = {}
    for component in components:
        path = BASE_FILES[component]
        single = open_file(path)
        if single is not None:
            headers[component] = read_header(*single, file=f"the base model's {path}")
            continue
        index = open_file(f"{path}.index.json")
        if index is None:
            continue
        read, size = index
        try:
            shards = sorted(set(json.loads(read(0, size - 1))["weight_map"].values()))
            if not all(isinstance(shard, str) for shard in shards):
                raise TypeError("a shard that is not a file name")
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise AdapterFileError(f"{path}.index.json of the base model is not a weight index") from exc
        merged: dict = {}
        folder = path.rsplit("/", 1)[0]
        for shard in shards:
            opened = open_file(f"{folder}/{shard}") if "/" not in shard else None
            if opened is None:
                raise AdapterFileError(f"{folder}/{shard}, named by the base model's weight index, is missing")
            merged.update(read_header(*opened, file=f"the base model's {folder}/{shard}"))
        headers[component] = merged
    return headers


def lora_targets(header: dict, family: Family | None = None) -> list[LoraTarget]:
    """The modules a LoRA file changes, one per down/up pair; refuses anything diffusers would not load, and a file
    in a layout the model's family does not take (`Family.lora_layouts`)."""
    layouts = family.lora_layouts if family is not None else ("peft", "kohya")
    pairs: dict[tuple[str, str, str], dict[str, dict]] = {}
    for name, entry in header.items():
        if match := _PEFT_KEY.fullmatch(name):
            layout, (component, module, part) = "peft", match.groups()
            if part == "alpha":
                raise AdapterFileError(f"{name}: a diffusers/PEFT-layout file carries no .alpha (diffusers refuses "
                                       "it; kohya-layout files may)")  # fmt: skip
        elif match := _KOHYA_KEY.fullmatch(name):
            layout, (prefix, module, part) = "kohya", match.groups()
            component = _KOHYA_COMPONENTS[prefix]
        else:
            raise AdapterFileError(
                f"not a LoRA tensor diffusers loads: {name!r} (expected {{component}}.{{module}}.lora_A.weight and "
                ".lora_B.weight, or kohya's lora_unet_*/lora_te*_* .lora_down.weight, .lora_up.weight and .alpha)"
            )
        if part != "alpha" and entry["dtype"] not in LORA_DTYPES:
            raise AdapterFileError(f"{name}: dtype {entry['dtype']} ({', '.join(LORA_DTYPES)} only)")
        if part == "alpha" and entry["dtype"] not in ALPHA_DTYPES:
            raise AdapterFileError(f"{name}: dtype {entry['dtype']} ({', '.join(ALPHA_DTYPES)} only for an alpha)")
        if layout not in layouts:
            raise AdapterFileError(f"{name}: a {layout}-layout file; this model takes adapters in diffusers' PEFT "
                                   "layout only ({component}.{module}.lora_A.weight and .lora_B.weight, as "
                                   "save_lora_weights writes them)")  # fmt: skip
        pairs.setdefault((layout, component, module), {})[_PARTS.get(part, "alpha")] = entry
    if len({layout for layout, _, _ in pairs}) > 1:
        raise AdapterFileError("the file mixes the diffusers/PEFT and kohya layouts")
    targets = []
    for (layout, component, module), parts in sorted(pairs.items()):
        down, up = parts.get("down"), parts.get("up")
        label = f"{component}.{module}" if layout == "peft" else f"{module} ({component})"
        if down is None or up is None:
            raise AdapterFileError(f"{label}: both halves (lora_A/lora_down and lora_B/lora_up) must be present")
        d, u = down["shape"], up["shape"]
        if len(d) not in (2, 4) or len(u) != len(d) or d[0] != u[1] or any(k != 1 for k in u[2:]):
            raise AdapterFileError(f"{label}: down {d} and up {u} do not make a LoRA pair (Linear: rank x in and "
                                   "out x rank; conv: rank x in x kh x kw and out x rank x 1 x 1)")  # fmt: skip
        alpha = parts.get("alpha")
        if alpha is not None and alpha["shape"] not in ([], [1]):
            raise AdapterFileError(f"{label}.alpha must be a scalar")
        targets.append(LoraTarget(component, module, layout, d[0], tuple(d), tuple(u)))
    if not targets:
        raise AdapterFileError("the file holds no LoRA tensors")
    return targets


def check_targets(targets: list[LoraTarget], base: dict[str, dict], max_rank: int) -> int:
    """Every target exists in the base model with its shape and within the rank limit; returns the largest rank.

    `base`: per component the base model has, its safetensors header. A kohya name is resolved as diffusers'
    conversion reads it: the base module whose dotted path, written with underscores, is the name (a text
    encoder's `text_model.` prefix either way); FLUX.1's BFL names through the fused-projection table."""
    modules = {component: _module_shapes(header) for component, header in base.items()}
    for target in targets:
        if target.rank > max_rank:
            raise AdapterFileError(f"{target.name}: rank {target.rank} exceeds {max_rank}")
        shapes = _resolve(target, modules)
        out_rows = sum(shape[0] for shape in shapes)
        expected = [target.up[0], *target.down[1:]]
        fused = len(shapes) > 1
        if (fused and any(list(shape[1:]) != expected[1:] for shape in shapes)) or (
            not fused and list(shapes[0]) != expected
        ) or out_rows != target.up[0]:  # fmt: skip
            base_shape = " + ".join("x".join(map(str, shape)) for shape in shapes)
            raise AdapterFileError(
                f"{target.name}: shape {'x'.join(map(str, expected))} does not match the base model's {base_shape} "
                "(a LoRA for another model?)"
            )
    return max(target.rank for target in targets)


def _module_shapes(header: dict) -> dict[str, list[int]]:
    """A base component's weights by module path (a text encoder's `text_model.` prefix dropped)."""
    return {
        name.removesuffix(".weight").removeprefix("text_model."): entry["shape"]
        for name, entry in header.items()
        if name.endswith(".weight")
    }


def _resolve(target: LoraTarget, modules: dict[str, dict[str, list[int]]]) -> list[list[int]]:
    """The base shapes of the modules `target` changes (several for a fused FLUX projection)."""
    component = target.component
    names: tuple[str, ...]
    if target.layout == "kohya" and component == "unet" and "unet" not in modules and "transformer" in modules:
        component, names = "transformer", _bfl_modules(target)
    elif target.layout == "kohya":
        underscored = {name.replace(".", "_"): name for name in modules.get(component, {})}
        module = target.module.removeprefix("text_model_")
        if component == "unet":
            module = _sgm_to_diffusers(module, modules.get("unet", {}))
        found = underscored.get(module)
        names = (found,) if found else ()
    else:
        names = (target.module.removeprefix("text_model."),)
    if component not in modules:
        raise AdapterFileError(f"{target.name}: the base model has no {component} (a LoRA for another family?)")
    shapes = [modules[component].get(name) for name in names]
    if not names or None in shapes:
        raise AdapterFileError(f"{target.name}: no such module in the base model (a LoRA for another model?)")
    return shapes


def _sgm_to_diffusers(module: str, unet: dict[str, list[int]]) -> str:
    """A kohya UNet name in SGM blocks (`input_blocks_4_1_...`) as diffusers renames it (`down_blocks_1_attentions_0_
    ...`: `layers_per_block` from the base UNet's own resnets); any other name unchanged."""
    for sgm, name in _SGM_TOP.items():
        if module == sgm or module.startswith(f"{sgm}_"):
            return name + module[len(sgm) :]
    match = _SGM_KEY.fullmatch(module)
    if match is None:
        return module
    kind, index, inner, middle, rest = match.groups()
    per_block = 1 + len({name.split(".")[3] for name in unet if name.startswith("down_blocks.0.resnets.")})
    for sgm, name in _SGM_RESNET.items():
        rest = name + rest[len(sgm) :] if rest == sgm or rest.startswith(f"{sgm}_") else rest
    if middle is not None:
        return f"mid_block_{_SGM_MIDDLE[int(middle)]}_{rest}" if int(middle) < len(_SGM_MIDDLE) else module
    index, inner = int(index), int(inner)
    if kind == "input_blocks":
        block, layer = divmod(index - 1, per_block)
        if rest == "op":
            return f"down_blocks_{block}_downsamplers_0_conv"
        return f"down_blocks_{block}_{_SGM_INNER[inner]}_{layer}_{rest}" if inner < 2 else module
    block, layer = divmod(index, per_block)
    return f"up_blocks_{block}_{_SGM_INNER[inner]}_{layer if inner < 2 else 0}_{rest}" if inner < 3 else module


def _bfl_modules(target: LoraTarget) -> tuple[str, ...]:
    match = _BFL_KEY.fullmatch(target.module)
    if match is None:
        return ()
    kind, index, part = match.groups()
    table, block = (
        (_BFL_DOUBLE, "transformer_blocks") if kind == "double" else (_BFL_SINGLE, "single_transformer_blocks")
    )
    return tuple(f"{block}.{index}.{module}" for module in table.get(part, ()))


def check_finite(header: dict, data: bytes) -> None:
    """Refuses a file (`header`: its `read_header`) whose floating tensors hold NaN or infinity, naming the first.

    Linear in the file's size at C speed (slices, `translate` and one big-integer AND per exponent byte), no
    numpy or torch: about what the SHA-256 of the same bytes costs (0.29 s against 0.21 s for 67 MB here)."""
    start = 8 + int.from_bytes(data[:8], "little")
    for name, entry in header.items():
        if entry["dtype"] not in _EXPONENT_BYTES:
            continue  # integers are finite
        size, exponent = _EXPONENT_BYTES[entry["dtype"]]
        first, last = (start + offset for offset in entry["data_offsets"])
        all_set = -1
        for byte, mask in exponent:
            column = data[first + byte : last : size].translate(_TABLES[mask])
            all_set &= int.from_bytes(column, "little")
        if all_set:
            raise AdapterFileError(f"{name} holds NaN or infinite values")


def check_file_names(names: list[str]) -> None:
    """An adapter version holds exactly one file, `pytorch_lora_weights.safetensors`: no pickle, nothing else."""
    from contract.naming import ADAPTER_FILE

    pickled = [name for name in names if is_pickle(name)]
    if pickled:
        raise AdapterFileError(f"pickle-format files are refused (safetensors only): {', '.join(pickled)}")
    others = [name for name in names if name != ADAPTER_FILE]
    if others:
        raise AdapterFileError(f"only {ADAPTER_FILE} is accepted; found {', '.join(others)}")
    if not names:
        raise AdapterFileError(f"no {ADAPTER_FILE} found")
