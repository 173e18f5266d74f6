"""The oracle's side of the family tests: each family's tiny pipeline, built offline, and diffusers' own pipeline
loaded from it (what the worker's images are compared with)."""

from __future__ import annotations

from pathlib import Path

# A random-weight UNet barely depends on its timestep (its output moves by a tenth when t goes from 999 to 0,
# and the image by 2-3/255, inside the oracle's tolerance) and predicts noise of a third of the right size: an
# oracle over it cannot tell a wrong timestep from the right one. A trained UNet's prediction depends on t above
# all; the oracle's tiny UNets get that by a stronger time embedding and a noise prediction of the right size
# (the same architecture and code path, other numbers). The transformers condition every block on t already.
UNET_SHARPENING = {"time_embedding.linear_2.": 10.0, "conv_out.": 3.0}


def tiny_pipelines(root: Path, families: dict) -> dict:
    """Per name: (the tiny pipeline's directory, the diffusers pipeline loaded from it, without what the entry
    leaves out)."""
    import diffusers
    import torch

    from emulators.tiny_pipeline import build_pipeline

    torch.set_num_threads(1)
    built = {}
    for name, spec in families.items():
        directory = build_pipeline(root / name, spec.pipeline, spec.guidance_mode, tuple(spec.without))
        sharpen_unet(directory)
        left_out = {key: None for c in spec.without for key in (c, c.replace("text_encoder", "tokenizer"))}
        reference = getattr(diffusers, spec.pipeline).from_pretrained(directory, **left_out)
        reference.set_progress_bar_config(disable=True)
        built[name] = (directory, reference)
    return built


def sharpen_unet(directory: Path) -> None:
    """Scales the tiny UNet's time embedding and output in place (`UNET_SHARPENING`); no UNet, no change."""
    from safetensors.torch import load_file, save_file

    path = directory / "unet" / "diffusion_pytorch_model.safetensors"
    if not path.exists():
        return
    tensors = load_file(path)
    for name in tensors:
        factor = next((f for prefix, f in UNET_SHARPENING.items() if name.startswith(prefix)), None)
        if factor is not None:
            tensors[name] = tensors[name] * factor
    save_file(tensors, path, metadata={"format": "pt"})
