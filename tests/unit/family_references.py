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
# The tiny Qwen-Image's random transformer predicts a velocity too small to move the image past the tolerance, and its
# text barely reaches the image through the joint attention: a wrong timestep, no guidance or another negative prompt
# would each change a pixel by 1-5/255. Its output projection, text input and the text's attention values scaled up
# make each visible (20-50/255), as a trained model's are.
QWEN_SHARPENING = {"proj_out.": 10.0, "txt_in.": 10.0, ".attn.add_v_proj.": 10.0}
# The tiny FLUX.1 Kontext's input image reaches the generated tokens only through attention, which its random weights
# barely pass on: another image changes the edit by 0.2/255, under the tolerance. Its output projection and the
# attention values scaled up make it 10/255 (a worker that gave a row another row's image would pass otherwise).
KONTEXT_SHARPENING = {"proj_out.": 10.0, ".attn.to_v.": 10.0}


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
        if spec.pipeline.startswith("QwenImage"):
            sharpen(directory / "transformer" / "diffusion_pytorch_model.safetensors", QWEN_SHARPENING)
        if spec.pipeline == "FluxKontextPipeline":
            sharpen(directory / "transformer" / "diffusion_pytorch_model.safetensors", KONTEXT_SHARPENING)
        left_out = {key: None for c in spec.without for key in (c, c.replace("text_encoder", "tokenizer"))}
        reference = getattr(diffusers, spec.pipeline).from_pretrained(directory, **left_out)
        reference.set_progress_bar_config(disable=True)
        built[name] = (directory, reference)
    return built


def sharpen_unet(directory: Path) -> None:
    """Scales the tiny UNet's time embedding and output in place (`UNET_SHARPENING`); no UNet, no change."""
    path = directory / "unet" / "diffusion_pytorch_model.safetensors"
    if path.exists():
        sharpen(path, UNET_SHARPENING)


def sharpen(path: Path, factors: dict[str, float]) -> None:
    """Scales, in place, the weights named by a key of `factors` (a prefix, or a part of the name when it starts with
    a dot) by its factor."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name in tensors:
        factor = next((f for part, f in factors.items() if (part in name if part[0] == "." else name.startswith(part))),
                      None)  # fmt: skip
        if factor is not None:
            tensors[name] = tensors[name] * factor
    save_file(tensors, path, metadata={"format": "pt"})
