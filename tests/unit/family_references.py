"""The oracle's side of the family tests: each family's tiny pipeline, built offline, and diffusers' own pipeline
loaded from it (what the worker's images are compared with)."""

from __future__ import annotations

from pathlib import Path


def tiny_pipelines(root: Path, families: dict) -> dict:
    """Per name: (the tiny pipeline's directory, the diffusers pipeline loaded from it, without what the entry
    leaves out)."""
    import diffusers
    import torch

    from model_worker.tiny_pipeline import build_pipeline

    torch.set_num_threads(1)
    built = {}
    for name, spec in families.items():
        directory = build_pipeline(root / name, spec.pipeline, spec.guidance_mode)
        left_out = {key: None for c in spec.without for key in (c, c.replace("text_encoder", "tokenizer"))}
        reference = getattr(diffusers, spec.pipeline).from_pretrained(directory, **left_out)
        reference.set_progress_bar_config(disable=True)
        built[name] = (directory, reference)
    return built
