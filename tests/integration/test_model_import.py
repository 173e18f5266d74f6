"""Importing a model: a diffusers folder checked, uploaded with its manifest to the real GCS emulator, and loaded
by the worker's own download path; what cannot be served safely is refused with the file and the reason."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest

from emulators.stack import ROOT
from model_worker.weights.importer import ImportRefusedError, check_folder
from model_worker.weights.store import MANIFEST, download_weights

pytestmark = pytest.mark.stack
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory):
    from emulators.tiny_pipeline import build_pipeline

    return build_pipeline(tmp_path_factory.mktemp("import") / "sdxl", "StableDiffusionXLPipeline")


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def test_an_imported_folder_is_uploaded_with_its_manifest_and_loads_as_the_worker_loads_it(
    stack, settings, tiny_sdxl, tmp_path
):
    # Nothing in the environment names the stack: `--stack` reads it from the directory `make up` recorded it in.
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "model_worker.weights", "import", str(tiny_sdxl), "--model", "imported-sdxl",
         "--version", "7", "--family", "sdxl", "--stack", str(stack.stack_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "imported-sdxl/7" in done.stdout and "StableDiffusionXLPipeline (sdxl)" in done.stdout
    assert '"7": {weights_path: imported-sdxl/7' in done.stdout and "0%" in done.stdout
    from contract import google_clients

    client = google_clients.storage_client(settings)
    manifest = json.loads(client.bucket(settings.model_bucket).blob(f"imported-sdxl/7/{MANIFEST}").download_as_bytes())
    local = {p.relative_to(tiny_sdxl).as_posix() for p in tiny_sdxl.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == local
    loaded = download_weights(client, settings.model_bucket, "imported-sdxl/7", tmp_path)  # checked against it
    assert (loaded / UNET_WEIGHTS).read_bytes() == (tiny_sdxl / UNET_WEIGHTS).read_bytes()


def test_a_pickle_renamed_safetensors_is_refused_naming_the_file(tiny_sdxl, tmp_path):
    folder = copy_of(tiny_sdxl, tmp_path)
    (folder / UNET_WEIGHTS).write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    with pytest.raises(ImportRefusedError, match=f"{UNET_WEIGHTS}: not a safetensors file"):
        check_folder(folder)


def test_a_truncated_weights_file_is_refused(tiny_sdxl, tmp_path):
    folder = copy_of(tiny_sdxl, tmp_path)
    data = (folder / UNET_WEIGHTS).read_bytes()
    (folder / UNET_WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ImportRefusedError, match=f"{UNET_WEIGHTS}: truncated"):
        check_folder(folder)


@pytest.mark.parametrize(
    ("pipeline", "family"),
    [("ZImagePipeline", "zimage"), ("Flux2KleinPipeline", "flux2-klein"), ("QwenImagePipeline", "qwenimage")],
)
def test_a_2026_family_folder_is_accepted_and_checked_as_the_others_are(tmp_path, pipeline, family):
    """Z-Image, FLUX.2 [klein] and Qwen-Image diffusers folders import with their family and task (the family table
    names their pipelines), and their weights get the same safetensors checks."""
    from emulators.tiny_pipeline import build_pipeline

    folder = build_pipeline(tmp_path / family, pipeline)
    checked = check_folder(folder, family=family)
    assert (checked.pipeline, checked.family, checked.task) == (pipeline, family, "text-to-image")
    with pytest.raises(ImportRefusedError, match=f"is a {family} model"):
        check_folder(folder, family="sd15")
    weights = "transformer/diffusion_pytorch_model.safetensors"
    (folder / weights).write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    with pytest.raises(ImportRefusedError, match=f"{weights}: not a safetensors file"):
        check_folder(folder)


def test_pickled_weights_a_family_mismatch_and_a_single_file_are_refused(tiny_sdxl, tmp_path):
    folder = copy_of(tiny_sdxl, tmp_path)
    with pytest.raises(ImportRefusedError, match="--family flux, but its pipeline StableDiffusionXLPipeline is a sdxl"):
        check_folder(folder, family="flux")
    (folder / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ImportRefusedError, match="diffusion_pytorch_model.bin: not safetensors"):
        check_folder(folder)
    with pytest.raises(ImportRefusedError, match="single-file checkpoint"):
        check_folder(tiny_sdxl / UNET_WEIGHTS)
    index = json.loads((tiny_sdxl / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyPipeline"}))
    with pytest.raises(ImportRefusedError, match="KandinskyPipeline' is not served"):
        check_folder(folder)


def test_the_local_stack_never_uploads_its_tiny_pipeline_over_an_imported_model(stack, settings, tiny_sdxl, tmp_path):
    """`make up` uploads the tiny pipeline to every catalog version's weights path: over its own earlier upload
    (which repairs a changed file), never over a model imported there."""
    from contract import google_clients
    from emulators.tiny_pipeline import imported_weights, upload_directory
    from model_worker.weights.importer import import_model

    client = google_clients.storage_client(settings)
    bucket = settings.model_bucket
    upload_directory(tiny_sdxl, bucket, "stack-owned/1")
    assert imported_weights(tiny_sdxl, bucket, "stack-owned/1") is None
    assert imported_weights(tiny_sdxl, bucket, "nothing-here/1") is None

    fine_tune = copy_of(tiny_sdxl, tmp_path)
    (fine_tune / "README.md").write_text("a fine-tune of the tiny SDXL\n")
    import_model(client, bucket, fine_tune, "stack-owned", "2", "sdxl")
    assert "lists" in imported_weights(tiny_sdxl, bucket, "stack-owned/2")
