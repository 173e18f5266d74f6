"""Malformed safetensors files on the real stack, as the probe made them: tensors whose bytes overlap, an F64 alpha
past the end of the file, hostile types. Refused with a 422 by the API's registration route, with exit status 2
and `refused: FILE: ...` by the import command (a single file and a diffusers folder), and by the worker's own
download, each naming the file and the tensor; never a 500, a traceback or an upload
(`contract/safetensors_checks.py`; the generated cases are in tests/unit/test_safetensors_checks.py)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest
import requests

from contract import google_clients, naming
from emulators.stack import ROOT
from model_worker.weights.store import WeightsIntegrityError, download_weights, upload_with_manifest
from tests.integration.test_adapters import MODEL, lora_bytes, register, upload_adapter
from tests.single_file_checkpoints import write_sd_checkpoint

pytestmark = pytest.mark.stack
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"
# The sd15 UNet module the tiny pipeline has (tests/integration/test_adapters.py uses it too).
MODULE = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"


def split(data: bytes) -> tuple[dict, bytes]:
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def joined(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def overlapping(data: bytes) -> tuple[bytes, str]:
    """The file with one tensor moved back into its neighbour's bytes (same size, so each entry alone is sound),
    the file's length unchanged; and the moved tensor's name."""
    header, body = split(data)
    order = sorted((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"])
    size = {name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0] for name in order}
    moved = next(name for before, name in zip(order, order[1:], strict=False) if size[before] >= 4 and size[name])
    begin, end = header[moved]["data_offsets"]
    header[moved]["data_offsets"] = [begin - 4, end - 4]
    return joined(header, body), moved


@pytest.fixture(scope="module")
def admin_headers() -> dict[str, str]:
    from tests.conftest import TEST_ADMIN_KEY

    return {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}


@pytest.fixture(scope="module")
def bucket(settings):
    return google_clients.storage_client(settings).bucket(settings.model_bucket)


def test_malformed_adapters_are_a_422_naming_the_tensor_and_are_never_listed(
    stack, settings, bucket, admin_headers, auth_headers
):
    good = lora_bytes(stack, seed=21)
    overlap, moved = overlapping(good)
    # kohya layout with an F64 alpha whose bytes lie past the end of the file (F64 skipped the old offset check).
    kohya_name = f"lora_unet_{MODULE.replace('.', '_')}"
    down, up, alpha = f"{kohya_name}.lora_down.weight", f"{kohya_name}.lora_up.weight", f"{kohya_name}.alpha"
    rows, columns = split((stack.tiny_model_dir / MODEL / UNET_WEIGHTS).read_bytes())[0][f"{MODULE}.weight"]["shape"]
    sizes = (4 * columns * 4, rows * 4 * 4)
    kohya = {down: {"dtype": "F32", "shape": [4, columns], "data_offsets": [0, sizes[0]]},
             up: {"dtype": "F32", "shape": [rows, 4], "data_offsets": [sizes[0], sum(sizes)]},
             alpha: {"dtype": "F64", "shape": [], "data_offsets": [sum(sizes), sum(sizes) + 8]}}  # fmt: skip
    body = bytes(sum(sizes))
    cases = {
        "overlap-style": (overlap, f"at '{moved}': its data_offsets"),
        "alpha-past-end": (joined(kohya, body), f"at '{alpha}': its data ends at byte {sum(sizes) + 8}, but the "
                                                f"file holds {sum(sizes)} bytes of data"),  # fmt: skip
        "shape-int": (joined({**kohya, alpha: {**kohya[alpha], "shape": 1}}, body + bytes(8)),
                      f"tensor '{alpha}' has shape 1, not a list of non-negative integers"),
        "dtype-list": (joined({**kohya, alpha: {**kohya[alpha], "dtype": ["F64"]}}, body + bytes(8)),
                       f"tensor '{alpha}' has dtype ['F64'], not one safetensors knows"),
        "offsets-int": (joined({**kohya, alpha: {**kohya[alpha], "data_offsets": 8}}, body + bytes(8)),
                        f"tensor '{alpha}' has data_offsets 8, not two non-negative integers"),
    }  # fmt: skip
    for name, (data, expected) in cases.items():
        upload_adapter(bucket, name, {naming.ADAPTER_FILE: data})
        response = register(stack, admin_headers, name)
        assert response.status_code == 422, (name, response.text)
        error = response.json()["error"]
        assert error["field"] == "file" and f"adapter file of {name}@1: " in error["message"], (name, error)
        assert expected in error["message"], (name, error["message"])
    listed = requests.get(f"{stack.api_url}/v1/models/{MODEL}/adapters", headers=auth_headers, timeout=30).json()
    assert not set(cases) & {adapter["name"] for adapter in listed["adapters"]}
    # The same kohya file, sound (its alpha inside the file), is registered: the refusals were for the format.
    upload_adapter(bucket, "alpha-inside", {naming.ADAPTER_FILE: joined(kohya, body + bytes(8))})
    assert register(stack, admin_headers, "alpha-inside").status_code == 200


def run_import(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "model_worker.weights", "import", *args, "--stack", str(stack.stack_dir)],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def uploaded(bucket, prefix: str) -> list[str]:
    return [blob.name for blob in bucket.client.list_blobs(bucket, prefix=f"{prefix}/")]


def test_the_import_command_refuses_overlapping_tensors_in_a_single_file_and_in_a_folder(stack, bucket, tmp_path):
    sdxl = stack.tiny_model_dir / "sdxl-txt2img"
    checkpoint = write_sd_checkpoint(sdxl, tmp_path / "fine-tune.safetensors")
    damaged, moved = overlapping(checkpoint.read_bytes())
    checkpoint.write_bytes(damaged)
    done = run_import(stack, str(checkpoint), "--model", "overlap-single", "--version", "2", "--base", str(sdxl))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"refused: fine-tune.safetensors: truncated or inconsistent safetensors file at "
                                  f"'{moved}': its data_offsets"), done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr and not uploaded(bucket, "overlap-single/2")

    folder = shutil.copytree(sdxl, tmp_path / "folder")
    damaged, moved = overlapping((folder / UNET_WEIGHTS).read_bytes())
    (folder / UNET_WEIGHTS).write_bytes(damaged)
    done = run_import(stack, str(folder), "--model", "overlap-folder", "--version", "2")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"refused: {UNET_WEIGHTS}: truncated or inconsistent safetensors file at "
                                  f"'{moved}'"), done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr and not uploaded(bucket, "overlap-folder/2")

    done = run_import(stack, str(sdxl), "--model", "overlap-folder", "--version", "2\n")
    assert done.returncode == 2 and "argument --version: version '2\\n' must be" in done.stderr, done.stderr


def test_the_worker_refuses_weights_uploaded_around_the_import(stack, settings, bucket, tmp_path):
    """Files put in the bucket by other means (a manifest and all) are checked by the worker's download too."""
    folder = shutil.copytree(stack.tiny_model_dir / "sdxl-txt2img", tmp_path / "folder")
    damaged, moved = overlapping((folder / UNET_WEIGHTS).read_bytes())
    (folder / UNET_WEIGHTS).write_bytes(damaged)
    upload_with_manifest(bucket.client, folder, settings.model_bucket, "around-import/1")
    with pytest.raises(WeightsIntegrityError) as refused:
        download_weights(bucket.client, settings.model_bucket, "around-import/1", tmp_path / "cache")
    assert refused.value.file == UNET_WEIGHTS
    assert refused.value.reason.startswith(f"truncated or inconsistent safetensors file at '{moved}'")
    assert not (tmp_path / "cache" / "around-import" / "1" / ".download-complete").exists()
