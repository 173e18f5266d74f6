"""Quantization at load (the catalog's `quantization:`, contract/quantization.py): the weights stay safetensors in
the bucket and the worker quantizes the named components while diffusers loads them, through diffusers' own
`PipelineQuantizationConfig` with one torchao `AOBaseConfig` object per component (diffusers' `TorchAoConfig` for
a diffusers model, transformers' for a text encoder: the two classes' signatures differ, so a per-component
`quant_mapping`, not `quant_backend`).

Where torchao cannot run a type, the load is refused before any weight is read, with the reason: fp8 needs a
CUDA device of compute capability 8.9 (L4, H100; not an A100), and torchao's float8 dynamic quantization does not
run on a CPU at all. torchao does run float8 weight-only on a CPU (it upcasts the fp8 weight for each matmul), so
the local stack and the tests can load it; int8 weight-only runs everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.quantization import FLOAT8_MIN_COMPUTE_CAPABILITY, Quantization

# The catalog's type -> torchao's config class (torchao.quantization).
TORCHAO_CONFIGS = {
    "float8_weight_only": "Float8WeightOnlyConfig",
    "float8_dynamic": "Float8DynamicActivationFloat8WeightConfig",
    "int8_weight_only": "Int8WeightOnlyConfig",
}


class QuantizationUnsupportedError(ValueError):
    """The catalog asks for a quantization this device (or these weights) cannot run: the worker's configuration,
    not its weights, is wrong, so it is not retried."""


def device_problem(quantization: Quantization, device: str, capability: tuple[int, int] | None) -> str | None:
    """Why `quantization` cannot run on this device (`capability`: the CUDA device's, None on a CPU), or None."""
    if not quantization.needs_float8:
        return None
    need = ".".join(map(str, FLOAT8_MIN_COMPUTE_CAPABILITY))
    if device == "cuda" and capability is not None and tuple(capability) < FLOAT8_MIN_COMPUTE_CAPABILITY:
        have = ".".join(map(str, capability))
        return (f"{quantization.type} needs fp8 tensor cores (CUDA compute capability {need}: L4, H100); this GPU has "
                f"{have} (an A100 is 8.0): serve this version on hardware: l4, or with int8_weight_only or no "
                "quantization")  # fmt: skip
    if device != "cuda" and quantization.type == "float8_dynamic":
        return (f"float8_dynamic runs only on a CUDA device of compute capability {need} (L4, H100): torchao has no "
                "CPU kernel for fp8 activations; this worker runs on the CPU (float8_weight_only and int8_weight_only "
                "run there)")  # fmt: skip
    return None


def worker_device() -> str:
    """The device the runner loads onto: `cuda` when there is one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(model: str, quantization: Quantization | None, device: str) -> None:
    """Refuses, before anything is loaded, a quantization this worker's device cannot run."""
    if quantization is None:
        return
    capability = None
    if device == "cuda":
        import torch

        capability = torch.cuda.get_device_capability(0)
    if (problem := device_problem(quantization, device, capability)) is not None:
        raise QuantizationUnsupportedError(f"{model}: quantization {problem}")


def component_libraries(weights_dir: Path) -> dict[str, str]:
    """Each model component of the saved pipeline (one with safetensors weights: not a tokenizer or scheduler) ->
    the library that loads it (diffusers, transformers)."""
    index = json.loads((weights_dir / "model_index.json").read_text())
    return {
        name: entry[0]
        for name, entry in index.items()
        if not name.startswith("_")
        and isinstance(entry, list)
        and len(entry) == 2
        and entry[0]
        and any((weights_dir / name).glob("*.safetensors"))
    }


def pipeline_quantization(model: str, quantization: Quantization, weights_dir: Path, without: list[str]):
    """diffusers' `PipelineQuantizationConfig` for `from_pretrained`: the catalog's type for each named component."""
    import diffusers
    import torchao.quantization
    import transformers

    libraries = component_libraries(weights_dir)
    config_classes = {"diffusers": diffusers.TorchAoConfig, "transformers": transformers.TorchAoConfig}
    mapping = {}
    for component in quantization.components:
        library = libraries.get(component)
        if component in without or library not in config_classes:
            quantizable = sorted(c for c, lib in libraries.items() if lib in config_classes and c not in without)
            raise QuantizationUnsupportedError(
                f"{model}: quantization names {component!r}, which is not a loaded model component of these weights "
                f"(quantizable: {', '.join(quantizable)})"
            )
        # A fresh AOBaseConfig object per component (diffusers >= 0.38 takes the object, not a string).
        ao_config = getattr(torchao.quantization, TORCHAO_CONFIGS[quantization.type])()
        mapping[component] = config_classes[library](ao_config)
    return diffusers.PipelineQuantizationConfig(quant_mapping=mapping)
