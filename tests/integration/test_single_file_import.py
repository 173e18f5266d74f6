"""Importing a single-file checkpoint (SD 1.5, SDXL, FLUX.1): converted by diffusers against a base, uploaded with
its manifest to the real GCS emulator, downloaded by the worker's checked path, and its images are the original
pipeline's; a pickle, a truncated file, another family and other shapes are refused naming the file and why.

The checkpoints are written by the test in the original layouts (`tests/single_file_checkpoints.py`) from a
fine-tune of each tiny pipeline: the pipeline with every tensor of every component the file carries changed, and
the pipeline itself is the base. So each imported component is checked to be the file's, tensor for tensor, and
none of them the base's (conversion starts from a copy of the base: a component that fell back to it would
otherwise pass); that the import gives back every tensor unchanged also proves the inverse.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from emulators.stack import ROOT
from model_worker.weights.importer import ImportRefusedError, import_model
from model_worker.weights.store import MANIFEST, download_weights
from tests.single_file_checkpoints import (
    CARRIED,
    component_tensors,
    fine_tune,
    write_flux_checkpoint,
    write_sd_checkpoint,
)

pytestmark = pytest.mark.stack
PIPELINES = {"sd15": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline", "flux": "FluxPipeline"}
# The stack serves this tiny FLUX.1 [schnell] (built with the same seed as the test's): an already-served base.
SERVED_FLUX = "flux-versions/1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (the tiny diffusers pipeline: the base, its fine-tune, the fine-tune as one original-layout file)."""
    from emulators.tiny_pipeline import build_pipeline

    root = tmp_path_factory.mktemp("single-file")
    made = {}
    for family, pipeline in PIPELINES.items():
        base = build_pipeline(root / family, pipeline)
        tuned = fine_tune(base, root / f"{family}-tuned", CARRIED[family])
        write = write_flux_checkpoint if family == "flux" else write_sd_checkpoint
        made[family] = base, tuned, write(tuned, root / f"{family}-finetune.safetensors")
    return made


@pytest.fixture(scope="module")
def storage(stack, settings):
    from contract import google_clients

    return google_clients.storage_client(settings)


def image(folder, pipeline: str):
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(folder, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(7)
    size = {"height": 32, "width": 32} if pipeline == "FluxPipeline" else {"height": 64, "width": 64}
    return pipe("a lighthouse at dawn", num_inference_steps=2, generator=generator, output_type="np", **size).images


def assert_same_weights(original, imported):
    for file in sorted(original.rglob("*.safetensors")):
        name = file.relative_to(original)
        expected, got = load_file(file), load_file(imported / name)
        assert expected.keys() == got.keys(), name
        assert all(torch.equal(expected[key], got[key]) for key in expected), name


def assert_served_as_the_file(family, base, tuned, imported):
    """Every component the file carries is the file's, tensor for tensor, and not one tensor is the base's; the
    rest (tokenizers, scheduler, what a FLUX file lacks) is the base's."""
    for component in CARRIED[family]:
        theirs, file, got = (component_tensors(folder, component) for folder in (base, tuned, imported))
        assert got.keys() == file.keys() == theirs.keys(), component
        assert all(torch.equal(got[name], file[name]) for name in file), f"{component} is not the file's"
        assert not any(torch.equal(got[name], theirs[name]) for name in theirs), f"{component}: a tensor is the base's"
    assert_same_weights(tuned, imported)  # the components the file lacks, too


def uploaded(storage, settings, prefix, tmp_path):
    bucket = storage.bucket(settings.model_bucket)
    manifest = json.loads(bucket.blob(f"{prefix}/{MANIFEST}").download_as_bytes())
    return manifest, download_weights(storage, settings.model_bucket, prefix, tmp_path / "cache")  # checked


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_a_single_file_sd_checkpoint_imports_as_its_pipeline_with_the_files_weights_and_images(
    storage, settings, tiny, tmp_path, family
):
    base, tuned, checkpoint = tiny[family]
    entry = import_model(storage, settings.model_bucket, checkpoint, f"single-{family}", "3", family, str(base))
    assert f'"3": {{weights_path: single-{family}/3, pipeline: {PIPELINES[family]}}}' in entry
    assert f"converted from {checkpoint.name} ({family})" in entry and "0%" in entry
    manifest, loaded = uploaded(storage, settings, f"single-{family}/3", tmp_path)
    assert set(manifest["files"]) == {p.relative_to(loaded).as_posix() for p in loaded.rglob("*")
                                      if p.is_file() and not p.name.startswith(".")}  # fmt: skip
    assert_served_as_the_file(family, base, tuned, loaded)
    served = image(loaded, PIPELINES[family])
    assert (served == image(tuned, PIPELINES[family])).all()
    assert not (served == image(base, PIPELINES[family])).all()


def test_a_flux_transformer_file_imports_against_a_served_base_through_the_command(
    stack, storage, settings, tiny, tmp_path
):
    base, tuned, checkpoint = tiny["flux"]  # base: built as the stack's flux-versions/1 is, with the same seed
    prefixed = tmp_path / "prefixed.safetensors"  # as some FLUX files are shared: under model.diffusion_model.
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(checkpoint).items()}, prefixed)
    env = {**stack.client_env(), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "model_worker.weights", "import", str(prefixed), "--model", "single-flux", "--version",
         "2", "--base", f"gs://{settings.model_bucket}/{SERVED_FLUX}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "FluxPipeline (flux)" in done.stdout and '"2": {weights_path: single-flux/2' in done.stdout
    assert f"from the base gs://{settings.model_bucket}/{SERVED_FLUX}: scheduler, text_encoder" in done.stdout
    _, loaded = uploaded(storage, settings, "single-flux/2", tmp_path)
    assert_served_as_the_file("flux", base, tuned, loaded)
    served = image(loaded, "FluxPipeline")
    assert (served == image(tuned, "FluxPipeline")).all() and not (served == image(base, "FluxPipeline")).all()


def test_an_sdxl_file_with_its_own_vae_on_an_fp16_fix_base_decodes_in_float32(storage, settings, tiny, tmp_path):
    """A base with the fp16-fix VAE (`force_upcast: false`) says nothing of a file that bakes in another VAE (the
    original SDXL one overflows float16): that file's VAE is decoded through the upcast; one whose VAE is the
    base's keeps the base's setting."""
    base, _, checkpoint = tiny["sdxl"]
    fp16_fix = tmp_path / "fp16-fix-base"
    shutil.copytree(base, fp16_fix)
    config = json.loads((fp16_fix / "vae" / "config.json").read_text())
    (fp16_fix / "vae" / "config.json").write_text(json.dumps({**config, "force_upcast": False}))

    def imported_vae(source, version: str) -> tuple[dict, str]:
        entry = import_model(storage, settings.model_bucket, source, "single-vae", version, "sdxl", str(fp16_fix))
        _, loaded = uploaded(storage, settings, f"single-vae/{version}", tmp_path / version)
        return json.loads((loaded / "vae" / "config.json").read_text()), entry

    own_vae, entry = imported_vae(checkpoint, "1")  # every component, the VAE included, differs from the base's
    assert own_vae["force_upcast"] is True and "vae: the file's own" in entry
    same_vae = fine_tune(fp16_fix, tmp_path / "unet-only", ("unet", "text_encoder", "text_encoder_2"))
    base_vae, entry = imported_vae(write_sd_checkpoint(same_vae, tmp_path / "base-vae.safetensors"), "2")
    assert base_vae["force_upcast"] is False and "vae: the file's own" not in entry


def refusal(storage, settings, source, base, family=None) -> str:
    with pytest.raises(ImportRefusedError) as refused:
        import_model(storage, settings.model_bucket, source, "refused", "1", family, str(base))
    return str(refused.value)


def test_a_pickle_a_truncated_file_and_a_pickle_checkpoint_are_refused_naming_the_file(
    storage, settings, tiny, tmp_path
):
    folder, _, checkpoint = tiny["sd15"]
    renamed = tmp_path / "renamed.safetensors"
    renamed.write_bytes(pickle.dumps({"state_dict": {"weight": [1.0, 2.0]}}))
    assert "renamed.safetensors: not a safetensors file" in refusal(storage, settings, renamed, folder)
    truncated = tmp_path / "truncated.safetensors"
    data = checkpoint.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    assert "truncated.safetensors: truncated" in refusal(storage, settings, truncated, folder)
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(pickle.dumps({}))
    assert "model.ckpt: a pickle checkpoint (.ckpt); only safetensors" in refusal(storage, settings, ckpt, folder)


def test_a_family_mismatch_and_other_shapes_are_refused_naming_both(storage, settings, tiny, tmp_path):
    sdxl_folder, _, sdxl_file = tiny["sdxl"]
    flux_folder, _, flux_file = tiny["flux"]
    message = refusal(storage, settings, sdxl_file, sdxl_folder, family="flux")
    assert "sdxl-finetune.safetensors: --family flux, but its tensors are a sdxl checkpoint" in message
    message = refusal(storage, settings, flux_file, sdxl_folder)
    assert "a flux checkpoint, but the base" in message and "StableDiffusionXLPipeline (sdxl)" in message
    tensors = load_file(tiny["sd15"][2])
    tensors["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(32, 9, 3, 3)  # an inpainting UNet
    inpainting = tmp_path / "inpainting.safetensors"
    save_file(tensors, inpainting)
    message = refusal(storage, settings, inpainting, tiny["sd15"][0])
    assert "inpainting.safetensors: model.diffusion_model.input_blocks.0.0.weight is [32, 9, 3, 3]" in message
    assert "the base's unet/conv_in.weight is [32, 4, 3, 3]: not a fine-tune of this base" in message
    deeper = load_file(flux_file)
    deeper.update({k.replace("single_blocks.0.", "single_blocks.1."): v.clone() for k, v in deeper.items()
                   if k.startswith("single_blocks.0.")})  # fmt: skip
    save_file(deeper, tmp_path / "deeper.safetensors")
    message = refusal(storage, settings, tmp_path / "deeper.safetensors", flux_folder)
    assert "1 double and 2 single blocks" in message and "the base has 1, 1" in message
