"""The worker's model families: one denoiser per family (`base.Denoiser`), picked by the catalog's pipeline class.

A new family is a new module here and a line in `denoiser_for`; the runner and the step scheduler stay as
they are.
"""

from __future__ import annotations

from contract.model_spec import ModelSpec
from model_worker.model.families.base import Denoiser


def denoiser_class(spec: ModelSpec) -> type[Denoiser]:
    """The denoiser of the spec's family (its `load_kwargs` say how to load the pipeline it wraps)."""
    from model_worker.model.families.flow import FluxDenoiser, FluxFillDenoiser, FluxKontextDenoiser, SD3Denoiser
    from model_worker.model.families.flux2 import Flux2KleinDenoiser
    from model_worker.model.families.qwenimage import QwenImageDenoiser
    from model_worker.model.families.unet import (
        SD15InpaintDenoiser,
        SDXLDenoiser,
        SDXLInpaintDenoiser,
        UNetDenoiser,
    )
    from model_worker.model.families.zimage import ZImageDenoiser

    denoisers: dict[str, type[Denoiser]] = {
        "sd15": UNetDenoiser, "sdxl": SDXLDenoiser, "flux": FluxDenoiser, "sd3": SD3Denoiser,
        "zimage": ZImageDenoiser, "flux2-klein": Flux2KleinDenoiser, "qwenimage": QwenImageDenoiser,
    }  # fmt: skip
    family = spec.family
    if family is None or family.name not in denoisers:
        raise ValueError(f"{spec.name}: no denoiser for pipeline {spec.pipeline}")
    if spec.task == "inpaint":  # the same family's denoiser, with the inpainting inputs per image
        inpainting: dict[str, type[Denoiser]] = {
            "sd15": SD15InpaintDenoiser, "sdxl": SDXLInpaintDenoiser, "flux": FluxFillDenoiser,
        }  # fmt: skip
        if family.name not in inpainting:
            raise ValueError(f"{spec.name}: no inpainting denoiser for pipeline {spec.pipeline}")
        return inpainting[family.name]
    if spec.task == "edit":  # an instruction and an image: the family's editing denoiser
        editing: dict[str, type[Denoiser]] = {"flux": FluxKontextDenoiser}
        if family.name not in editing:
            raise ValueError(f"{spec.name}: no editing denoiser for pipeline {spec.pipeline}")
        return editing[family.name]
    return denoisers[family.name]


__all__ = ["Denoiser", "denoiser_class"]
