"""Single-file checkpoints of the 2026 families (issue 52): a Z-Image transformer in its original names and a
Qwen-Image transformer in ComfyUI's (`model.diffusion_model.` + diffusers' names) convert against a base of their
family with diffusers' own converters, every tensor the file's under its diffusers name; a file for another family's
base, of other shapes, or a FLUX.2 file is refused naming why. (The stack's import path, upload and download are
the same as FLUX.1's: tests/integration/test_single_file_import.py.)"""

from __future__ import annotations

import pytest
import torch

from model_worker.weights.checkpoints import CheckpointRefusedError, convert_checkpoint
from tests.single_file_checkpoints import CARRIED, component_tensors, fine_tune, write_transformer_checkpoint

PIPELINES = {"zimage": "ZImagePipeline", "qwenimage": "QwenImagePipeline"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (the tiny pipeline: the base, its fine-tune, the fine-tune's transformer as one file)."""
    from emulators.tiny_pipeline import build_pipeline

    root = tmp_path_factory.mktemp("single-file-2026")
    made = {}
    for family, pipeline in PIPELINES.items():
        base = build_pipeline(root / family, pipeline, "cfg" if family == "qwenimage" else "none")
        tuned = fine_tune(base, root / f"{family}-tuned", CARRIED[family])
        prefix = "model.diffusion_model." if family == "qwenimage" else ""
        made[family] = base, tuned, write_transformer_checkpoint(tuned, root / f"{family}.safetensors", family, prefix)
    return made


@pytest.mark.parametrize("family", list(PIPELINES))
def test_a_transformer_file_converts_against_its_familys_base_with_every_tensor_the_files(tiny, tmp_path, family):
    base, tuned, file = tiny[family]
    found, from_base, notes = convert_checkpoint(file, base, tmp_path / "out", family=family)
    assert (found, notes) == (family, [])
    assert "transformer" not in from_base and {"text_encoder", "vae"} <= set(from_base)
    imported, expected = component_tensors(tmp_path / "out", "transformer"), component_tensors(tuned, "transformer")
    assert imported.keys() == expected.keys()
    assert all(torch.equal(imported[name], expected[name]) for name in expected)
    original = component_tensors(base, "transformer")
    assert not any(torch.equal(imported[name], original[name]) for name in original), "a tensor is the base's"


def test_another_familys_base_other_shapes_and_a_flux2_file_are_refused_naming_why(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    zimage_base, _, zimage_file = tiny["zimage"]
    qwen_base, _, qwen_file = tiny["qwenimage"]
    with pytest.raises(CheckpointRefusedError, match="a zimage checkpoint, but the base .* is QwenImagePipeline"):
        convert_checkpoint(zimage_file, qwen_base, tmp_path / "a")
    with pytest.raises(CheckpointRefusedError, match="--family zimage, but its tensors are a qwenimage checkpoint"):
        convert_checkpoint(qwen_file, zimage_base, tmp_path / "b", family="zimage")
    tensors = load_file(qwen_file)
    tensors["model.diffusion_model.img_in.weight"] = torch.zeros(8, 3)
    save_file(tensors, tmp_path / "wider.safetensors")
    with pytest.raises(CheckpointRefusedError, match=r"img_in.weight is \[8, 3\], the base's transformer/img_in"):
        convert_checkpoint(tmp_path / "wider.safetensors", qwen_base, tmp_path / "c")
    save_file({"double_stream_modulation_img.lin.weight": torch.zeros(4, 4)}, tmp_path / "flux2.safetensors")
    with pytest.raises(CheckpointRefusedError, match="a FLUX.2 checkpoint .* import FLUX.2 \\[klein\\] as a diffusers"):
        convert_checkpoint(tmp_path / "flux2.safetensors", qwen_base, tmp_path / "d")
