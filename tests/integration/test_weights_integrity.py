"""Weights are checked against their manifest before loading: a changed file is never served, and fixing it recovers.

Against the real GCS emulator and a real worker process: the stack uploads every tiny pipeline with its
manifest (`maas-manifest.json`, each file's size and SHA-256), as `python -m model_worker.weights` does.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import pytest
import requests

from emulators.processes import ProcessRegistry
from emulators.stack import ROOT, worker_env
from model_worker.weights.store import MANIFEST, WeightsIntegrityError, download_weights
from tests.conftest import wait_for

pytestmark = pytest.mark.stack
WEIGHTS = "flux-versions/2"
CHANGED = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture
def bucket(settings):
    from contract import google_clients

    client = google_clients.storage_client(settings)
    return client, client.bucket(settings.model_bucket)


def readyz(url: str) -> tuple[int, str]:
    try:
        response = requests.get(url, timeout=2)
        return response.status_code, response.text
    except requests.RequestException as exc:
        return 0, str(exc)


def test_the_stack_uploads_each_model_with_a_manifest_that_matches_its_files(bucket, settings, tmp_path):
    client, model_bucket = bucket
    manifest = json.loads(model_bucket.blob(f"{WEIGHTS}/{MANIFEST}").download_as_bytes())
    assert CHANGED in manifest["files"] and "model_index.json" in manifest["files"]
    directory = download_weights(client, settings.model_bucket, WEIGHTS, tmp_path)
    assert (directory / CHANGED).stat().st_size == manifest["files"][CHANGED]["size"]


@pytest.mark.parametrize("damage", ["changed", "truncated", "missing"])
def test_a_damaged_file_is_refused_naming_the_file(bucket, settings, tmp_path, damage):
    client, model_bucket = bucket
    blob = model_bucket.blob(f"{WEIGHTS}/{CHANGED}")
    original = blob.download_as_bytes()
    try:
        if damage == "changed":
            blob.upload_from_string(original[:-16] + bytes(16))
        elif damage == "truncated":
            blob.upload_from_string(original[: len(original) // 2])
        else:
            blob.delete()
        with pytest.raises(WeightsIntegrityError) as caught:
            download_weights(client, settings.model_bucket, WEIGHTS, tmp_path)
        assert caught.value.file == CHANGED
        expected = {"changed": "sha256", "truncated": "bytes", "missing": "missing"}[damage]
        assert expected in caught.value.reason
    finally:
        blob.upload_from_string(original)


def test_a_worker_finding_a_changed_file_is_not_ready_naming_it_and_recovers_once_fixed(stack, bucket, tmp_path):
    _, model_bucket = bucket
    blob = model_bucket.blob(f"{WEIGHTS}/{CHANGED}")
    original = blob.download_as_bytes()
    registry = ProcessRegistry(stack.stack_dir)
    index = 60
    url = f"http://127.0.0.1:{stack.worker_health_port(index)}/readyz"
    env = {**worker_env(stack, "flux-versions", index), "MAAS_WEIGHTS_CACHE_DIR": str(tmp_path / "weights"),
           "MAAS_WEIGHTS_RETRY_SECONDS": "1"}  # fmt: skip
    try:
        blob.upload_from_string(original[:-16] + bytes(16))
        registry.start("worker-integrity", [sys.executable, "-m", "model_worker"], env, cwd=ROOT)
        status, reason = wait_for(lambda: (r := readyz(url))[0] == 503 and CHANGED in r[1] and r)
        assert status == 503 and "v2" in reason and "sha256" in reason and "not served" in reason
        blob.upload_from_string(original)
        wait_for(lambda: readyz(url)[0] == 200)
        log = (stack.stack_dir / "logs" / "worker-integrity.log").read_text()
        assert log.count(CHANGED) >= 1 and "recovered: weights of flux-versions v2" in log
    finally:
        blob.upload_from_string(original)
        registry.stop("worker-integrity", timeout=30)


# What the worker's format check (contract/safetensors_checks.py) says of the tensor `overlapping` moved.
OVERLAP_REASON = "truncated or inconsistent safetensors file at '{}': its data_offsets"


def overlapping(data: bytes) -> tuple[bytes, str]:
    """The safetensors file with its second tensor's data moved back over the first's (same length, same file
    size, every offset inside the file), as the probe damaged one: what safetensors itself refuses to load."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    first, second = header[names[0]]["data_offsets"], header[names[1]]["data_offsets"]
    shift = max((first[1] - first[0]) // 2, 1)
    header[names[1]]["data_offsets"] = [second[0] - shift, second[1] - shift]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= length
    return data[:8] + raw.ljust(length) + data[8 + length :], names[1]


def test_a_worker_whose_weights_do_not_load_stays_up_not_ready_saying_why_once_and_recovers(stack, bucket, tmp_path):
    """Weights that match their manifest (as imported) but that safetensors refuses: the worker does not exit
    and restart, its /readyz is 503 naming the file and the format check's reason, its log says it once, and a new
    upload (a new manifest) is loaded without a restart."""
    _, model_bucket = bucket
    blob, manifest_blob = model_bucket.blob(f"{WEIGHTS}/{CHANGED}"), model_bucket.blob(f"{WEIGHTS}/{MANIFEST}")
    original, original_manifest = blob.download_as_bytes(), manifest_blob.download_as_bytes()
    damaged, tensor = overlapping(original)
    manifest = json.loads(original_manifest)
    manifest["files"][CHANGED] = {"size": len(damaged), "sha256": hashlib.sha256(damaged).hexdigest()}
    registry = ProcessRegistry(stack.stack_dir)
    index, name = 61, "worker-unloadable"
    probes = f"http://127.0.0.1:{stack.worker_health_port(index)}"
    env = {**worker_env(stack, "flux-versions", index), "MAAS_WEIGHTS_CACHE_DIR": str(tmp_path / "weights"),
           "MAAS_WEIGHTS_RETRY_SECONDS": "1"}  # fmt: skip
    try:
        blob.upload_from_string(damaged)
        manifest_blob.upload_from_string(json.dumps(manifest))
        registry.start(name, [sys.executable, "-m", "model_worker"], env, cwd=ROOT)
        status, reason = wait_for(lambda: (r := readyz(f"{probes}/readyz"))[0] == 503 and CHANGED in r[1] and r)
        assert "weights of flux-versions v2" in reason and f"does not load ({OVERLAP_REASON.format(tensor)}" in reason
        response = requests.get(f"{probes}/readyz", timeout=2)
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert response.content.decode("utf-8") == response.text  # "—" reads as itself, not as mojibake
        time.sleep(5)  # five retry intervals: the same weights are not loaded again, nor the process restarted
        assert registry.is_running(name) and readyz(f"{probes}/readyz") == (status, reason)
        # Started (the kubelet hands over to readiness and liveness) and alive: not a restart loop.
        assert readyz(f"{probes}/startupz")[0] == 200 and readyz(f"{probes}/livez")[0] == 200
        log = registry.log_path(name).read_text()
        assert log.count(OVERLAP_REASON.format(tensor)) == 1, log
        assert "Traceback" not in log
        assert "weights already cached" not in log  # the same upload was neither fetched nor loaded again
        blob.upload_from_string(original)
        manifest_blob.upload_from_string(original_manifest)
        wait_for(lambda: readyz(f"{probes}/readyz")[0] == 200)
        assert "recovered: weights of flux-versions v2" in registry.log_path(name).read_text()
    finally:
        blob.upload_from_string(original)
        manifest_blob.upload_from_string(original_manifest)
        registry.stop(name, timeout=30)
