"""LoRA adapters per request, on the real stack: the tiny pipeline, the two tiny adapters `make up` registers,
the model bucket on the GCS emulator, the API and the step-scheduled worker."""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests

from contract import google_clients, naming
from contract.lora_files import AdapterFileError
from contract.stores.adapter_registry import AdapterRecord, AdapterRegistry
from emulators.stack import local_catalog
from tests.conftest import SLOW_ADAPTER, SLOW_ADAPTER_LOAD_SECONDS, TEST_ADMIN_KEY, query_rows

pytestmark = pytest.mark.stack
MODEL = "sd15-txt2img"
SPEC = local_catalog(test_fixtures=True).get(MODEL)
# Pixel values may move by a few levels inside another batch composition (float rounding), no more.
PIXEL_TOLERANCE = 3


def predict(stack, headers, seed: int, adapters=None, prompt: str = "a lighthouse", **extra) -> requests.Response:
    parameters = {"seed": seed, "width": 64, "height": 64, "num_inference_steps": 4}
    if adapters is not None:
        parameters["adapters"] = adapters
    body = {"instances": [{"prompt": prompt}], "parameters": parameters}
    return requests.post(f"{stack.api_url}/v1/models/{MODEL}:predict", json=body, headers={**headers, **extra},
                         timeout=90)  # fmt: skip


def pixels(response: requests.Response) -> np.ndarray:
    from PIL import Image

    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["predictions"][0]["image_b64"])
    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def fresh(stack, headers, seed, adapters=None, **extra) -> np.ndarray:
    """A run of the model, not a cache hit."""
    return pixels(predict(stack, headers, seed, adapters, **{"Cache-Control": "no-cache", **extra}))


@pytest.fixture(scope="module")
def bucket(settings):
    return google_clients.storage_client(settings).bucket(settings.model_bucket)


@pytest.fixture(scope="module")
def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}


def upload_adapter(bucket, name: str, files: dict[str, bytes], version: str = "1") -> None:
    for file, data in files.items():
        bucket.blob(naming.adapter_prefix(MODEL, name, version) + file).upload_from_string(data)


def lora_bytes(stack, seed: int, rank: int = 4, **shapes) -> bytes:
    """A valid tiny LoRA for the stack's tiny pipeline (the `make up` builder), as bytes."""
    from emulators.tiny_pipeline import build_adapter

    path = Path(stack.stack_dir) / f"lora-{seed}-{rank}-{uuid.uuid4().hex[:6]}.safetensors"
    return build_adapter(stack.tiny_model_dir / MODEL, path, seed, rank).read_bytes()


def register(stack, headers, name: str, version: str = "1") -> requests.Response:
    return requests.put(f"{stack.api_url}/v1/models/{MODEL}/adapters/{name}", json={"version": version},
                        headers=headers, timeout=30)  # fmt: skip


def test_an_adapter_changes_the_image_repeats_exactly_composes_and_scale_zero_is_the_base(stack, auth_headers):
    seed = 11
    base = fresh(stack, auth_headers, seed)
    ink = fresh(stack, auth_headers, seed, [{"name": "tiny-ink", "scale": 0.8}])
    assert np.abs(ink - base).max() > 10, "the adapter did not change the image"
    assert np.array_equal(fresh(stack, auth_headers, seed, [{"name": "tiny-ink", "scale": 0.8}]), ink)
    neon = fresh(stack, auth_headers, seed, [{"name": "tiny-neon", "scale": 0.5}])
    both = fresh(stack, auth_headers, seed, [{"name": "tiny-ink", "scale": 0.8}, {"name": "tiny-neon", "scale": 0.5}])
    assert min(np.abs(both - ink).max(), np.abs(both - neon).max()) > 10, "two adapters did not compose"
    zero = fresh(stack, auth_headers, seed, [{"name": "tiny-ink", "scale": 0.0}])
    assert np.abs(zero - base).max() <= PIXEL_TOLERANCE


def test_an_adapter_request_gets_the_same_image_beside_base_model_requests(stack, auth_headers):
    seed, adapters = 12, [{"name": "tiny-neon", "scale": 1.0}]
    alone = fresh(stack, auth_headers, seed, adapters)
    results: dict[str, np.ndarray] = {}

    def send(key: str, seed: int, adapters=None) -> None:
        results[key] = fresh(stack, auth_headers, seed, adapters)

    threads = [threading.Thread(target=send, args=(f"base-{i}", 100 + i)) for i in range(4)]
    threads.insert(2, threading.Thread(target=send, args=("adapter", seed, adapters)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 5
    assert np.abs(results["adapter"] - alone).max() <= PIXEL_TOLERANCE


def test_adapter_parameters_are_refused_before_anything_is_queued(stack, auth_headers):
    cases = [
        ([{"name": "no-such-adapter", "scale": 1.0}], "parameters.adapters.0.name"),
        ([{"name": "tiny-ink", "scale": 9.0}], "parameters.adapters.0.scale"),
        ([{"name": "tiny-ink"}, {"name": "tiny-neon"}, {"name": "tiny-ink"}], "parameters.adapters"),
        ([{"name": "Not A Name"}], "parameters.adapters.0.name"),
        ([{"name": "tiny-ink", "scale": "high"}], "parameters.adapters.0.scale"),
    ]
    for adapters, field in cases:
        response = predict(stack, auth_headers, 1, adapters)
        assert response.status_code == 422, (adapters, response.text)
        assert response.json()["error"]["field"] == field, response.text
    noop = requests.post(f"{stack.api_url}/v1/models/noop:predict", headers=auth_headers, timeout=30,
                         json={"instances": [{"prompt": "x"}], "parameters": {"adapters": [{"name": "tiny-ink"}]}})  # fmt: skip
    assert noop.status_code == 422 and noop.json()["error"]["field"] == "parameters.adapters"


def test_registration_checks_the_files_and_needs_an_admin_key(stack, auth_headers, admin, bucket):
    import torch
    from safetensors.torch import save

    good = lora_bytes(stack, seed=5)
    upload_adapter(bucket, "fresh-style", {naming.ADAPTER_FILE: good})
    assert register(stack, auth_headers, "fresh-style").status_code == 403
    registered = register(stack, admin, "fresh-style")
    assert registered.status_code == 200, registered.text
    assert registered.json()["rank"] == 4
    listed = requests.get(f"{stack.api_url}/v1/models/{MODEL}/adapters", headers=auth_headers, timeout=30).json()
    assert {"tiny-ink", "tiny-neon", "fresh-style"} <= {adapter["name"] for adapter in listed["adapters"]}

    module = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    elsewhere = "down_blocks.2.attentions.1.transformer_blocks.3.attn1.to_q"  # SD 1.5's, not the tiny UNet's
    refused = {
        "pickle": {"adapter_model.bin": pickle.dumps({"lora": [1, 2, 3]})},
        "pickle-renamed": {naming.ADAPTER_FILE: pickle.dumps({"lora": [1, 2, 3]})},
        "not-only": {naming.ADAPTER_FILE: good, "notes.txt": b"hello"},
        "other-model": {naming.ADAPTER_FILE: save({
            f"unet.{elsewhere}.lora_A.weight": torch.zeros(4, 640), f"unet.{elsewhere}.lora_B.weight": torch.zeros(640, 4),
        })},
        "other-shape": {naming.ADAPTER_FILE: save({
            f"unet.{module}.lora_A.weight": torch.zeros(4, 320), f"unet.{module}.lora_B.weight": torch.zeros(320, 4),
        })},
        "truncated": {naming.ADAPTER_FILE: good[: len(good) // 2]},
        "claims-8gb": {naming.ADAPTER_FILE: claimed_header(
            {"w": {"dtype": "F32", "shape": [65536, 32768], "data_offsets": [0, 8 * 2**30]}})},
        "header-100mb": {naming.ADAPTER_FILE: (100 * 2**20).to_bytes(8, "little") + b"{}" + bytes(64)},
        "other-family": {naming.ADAPTER_FILE: save({  # FLUX.1's transformer, not this SD 1.5 model's UNet
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4),
        })},
    }  # fmt: skip
    expected = {
        "pickle": "pickle",
        "pickle-renamed": "not a safetensors file",
        "not-only": "only pytorch_lora_weights.safetensors",
        "other-model": "no such module",
        "other-shape": "does not match",
        "truncated": "truncated",
        "claims-8gb": "truncated or inconsistent safetensors file at 'w'",
        "header-100mb": "bad header length",
        "other-family": "the base model has no transformer (a LoRA for another family?)",
    }
    for name, files in refused.items():
        upload_adapter(bucket, name, files)
        response = register(stack, admin, name)
        assert response.status_code == 422, (name, response.text)
        assert expected[name] in response.json()["error"]["message"], (name, response.text)
    assert register(stack, admin, "never-uploaded").status_code == 422
    for name, version, field in (("a..b", "1", "name"), ("fresh-style", "..", "version")):
        response = register(stack, admin, name, version)
        assert response.status_code == 422, (name, version, response.text)
        assert response.json()["error"]["field"] == field and "'..'" in response.json()["error"]["message"]


def test_a_version_registered_again_with_another_file_is_served_from_the_new_file(stack, auth_headers, admin, bucket):
    """Registering a version again with another file (uploaded over it) makes that file current: the worker, which
    held the old file's tensors on the host and on the device, serves the new one (its caches go by the digest)."""
    old, new = lora_bytes(stack, seed=14), lora_bytes(stack, seed=15)
    upload_adapter(bucket, "restyle", {naming.ADAPTER_FILE: old})
    upload_adapter(bucket, "restyle-new", {naming.ADAPTER_FILE: new})  # the new file under a name of its own
    for name in ("restyle", "restyle-new"):
        assert register(stack, admin, name).status_code == 200
    seed = 16
    before = fresh(stack, auth_headers, seed, [{"name": "restyle", "scale": 1.0}])
    expected = fresh(stack, auth_headers, seed, [{"name": "restyle-new", "scale": 1.0}])
    assert np.abs(before - expected).max() > 10, "the two files make the same image: the test proves nothing"
    upload_adapter(bucket, "restyle", {naming.ADAPTER_FILE: new})
    again = register(stack, admin, "restyle")
    assert again.status_code == 200, again.text
    assert again.json()["sha256"] == hashlib.sha256(new).hexdigest()
    after = fresh(stack, auth_headers, seed, [{"name": "restyle", "scale": 1.0}])
    assert np.abs(after - expected).max() <= PIXEL_TOLERANCE, "the old file's tensors were served"


def claimed_header(header: dict) -> bytes:
    """A safetensors file whose header claims tensors far larger than the file."""
    import json

    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(64)


def error_row(bigquery, settings, response: requests.Response) -> dict:
    """The log row of a request the stack answered with an error."""
    assert response.status_code != 200, response.text
    request_id = response.json()["error"]["request_id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    [row] = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=30)
    return row


def test_an_adapter_with_non_finite_weights_is_refused_at_registration_and_at_the_workers_first_load(
    stack, auth_headers, admin, bucket, bigquery, settings
):
    from safetensors.torch import load, save

    tensors = load(lora_bytes(stack, seed=9))
    poisoned = next(name for name in sorted(tensors) if name.endswith("lora_B.weight"))
    tensors[poisoned][0, 0] = float("nan")
    nan_file = save(tensors)
    upload_adapter(bucket, "nan-style", {naming.ADAPTER_FILE: nan_file})
    refused = register(stack, admin, "nan-style")
    assert refused.status_code == 422, refused.text
    assert f"nan-style@1: {poisoned} holds NaN or infinite values" in refused.json()["error"]["message"]

    # One registered before registration looked at the values (as the probe's was): the worker refuses it at its
    # first load, and the request fails alone, with bad_input, naming the adapter; it is never served black.
    record = AdapterRecord(name="nan-style", version="1", sha256=hashlib.sha256(nan_file).hexdigest(),
                           bytes=len(nan_file), rank=4, targets=len(tensors) // 2)  # fmt: skip
    bucket.blob(naming.adapter_record(MODEL, "nan-style")).upload_from_string(record.model_dump_json())
    for seed in (30, 31):  # the second is refused again (nothing was cached), not served
        failed = predict(stack, auth_headers, seed, [{"name": "nan-style", "scale": 1.0}])
        message = failed.json()["error"]["message"]
        assert failed.status_code == 422, failed.text  # the request's adapter is at fault, not the service
        assert f"nan-style@1: {poisoned} holds NaN or infinite values" in message, failed.text
        assert error_row(bigquery, settings, failed)["error_kind"] == "bad_input"
    pixels(predict(stack, auth_headers, 32, **{"Cache-Control": "no-cache"}))  # and the worker serves on


def test_an_adapter_set_that_cannot_be_applied_fails_alone_and_the_next_base_request_is_the_base_image(
    stack, auth_headers, admin, bucket, bigquery, settings
):
    """A kohya file whose text-encoder part diffusers 0.42 cannot convert (only q_proj: its layout guess needs
    out_proj) passes registration; diffusers loads its UNet layers and then fails in the text encoder's, after
    tiny-ink was applied: the load must leave nothing behind."""
    import torch
    from safetensors.torch import save

    from contract.lora_files import BASE_FILES, bytes_reader, read_header

    def shapes(component: str) -> dict:
        data = (stack.tiny_model_dir / MODEL / BASE_FILES[component]).read_bytes()
        return {k.removesuffix(".weight"): v["shape"] for k, v in read_header(bytes_reader(data), len(data)).items()}

    tensors = {}
    for prefix, component, suffix in (
        ("lora_unet", "unet", ".to_q"),
        ("lora_te_text_model", "text_encoder", ".q_proj"),
    ):
        for module, (rows, columns) in ((m, s) for m, s in shapes(component).items() if m.endswith(suffix)):
            name = f"{prefix}_{module.removeprefix('text_model.').replace('.', '_')}"
            tensors[f"{name}.lora_down.weight"] = torch.full((4, columns), 0.1)
            tensors[f"{name}.lora_up.weight"] = torch.full((rows, 4), 0.1)
    upload_adapter(bucket, "half-style", {naming.ADAPTER_FILE: save(tensors)})
    assert register(stack, admin, "half-style").status_code == 200
    seed, ink = 13, [{"name": "tiny-ink", "scale": 0.8}]
    base, inked = fresh(stack, auth_headers, seed), fresh(stack, auth_headers, seed, ink)
    failed = predict(stack, auth_headers, seed, [*ink, {"name": "half-style"}], **{"Cache-Control": "no-cache"})
    message = failed.json()["error"]["message"]
    assert failed.status_code == 422, failed.text
    assert "adapter half-style@1 could not be loaded: Could not automatically infer state dict type" in message, (
        failed.text
    )
    assert error_row(bigquery, settings, failed)["error_kind"] == "bad_input"
    assert np.array_equal(fresh(stack, auth_headers, seed), base), "the next base request ran with part of an adapter"
    assert np.array_equal(fresh(stack, auth_headers, seed, ink), inked)


def test_an_oversized_adapter_is_refused(stack, bucket):
    upload_adapter(bucket, "big-style", {naming.ADAPTER_FILE: lora_bytes(stack, seed=6, rank=8)})
    capped = SPEC.model_copy(update={"adapters": SPEC.adapters.model_copy(update={"max_bytes": 1024})})
    with pytest.raises(AdapterFileError, match="exceeds the limit of 1024"):
        AdapterRegistry(bucket).register(capped, "big-style", "1")


def held_requests(stack) -> float:
    catalog = local_catalog(test_fixtures=True)
    index = list(catalog.deployments()).index(catalog.get(MODEL).deployment)
    body = requests.get(f"http://127.0.0.1:{stack.worker_health_port(index)}/metrics", timeout=5).text
    line = next(line for line in body.splitlines() if line.startswith("maas_worker_held_requests "))
    return float(line.split()[1])


def test_base_requests_are_served_while_an_adapter_loads(stack, auth_headers, admin, bucket):
    upload_adapter(bucket, SLOW_ADAPTER, {naming.ADAPTER_FILE: lora_bytes(stack, seed=7)})
    assert register(stack, admin, SLOW_ADAPTER).status_code == 200
    answered: dict[str, float] = {}

    def slow() -> None:
        response = predict(stack, auth_headers, 21, [{"name": SLOW_ADAPTER, "scale": 1.0}])
        assert response.status_code == 200, response.text
        answered["adapter"] = time.monotonic()

    sent = time.monotonic()
    thread = threading.Thread(target=slow)
    thread.start()
    # The worker holds the adapter request aside while its adapter loads (the worker's own gauge says so).
    while held_requests(stack) < 1:  # held for the whole load (8 s), so a poll every 50 ms sees it
        assert time.monotonic() - sent < 120, "the adapter request never reached the worker"  # bounds a hang only
        assert "adapter" not in answered, "the adapter request was answered without being held while it loaded"
        time.sleep(0.05)
    latencies, first_answered = [], None
    for seed in range(3):
        started = time.monotonic()
        pixels(predict(stack, auth_headers, 200 + seed, **{"Cache-Control": "no-cache"}))
        latencies.append(time.monotonic() - started)
        first_answered = first_answered or time.monotonic()
    thread.join(timeout=60)
    assert "adapter" in answered, "the adapter request was not answered once its adapter loaded"
    # Had the device waited for the load, the first base request (sent while the adapter request was held for
    # it) would have waited for it too and been answered after the adapter request, which is older: checked by
    # that order. The base requests' latencies are printed, not bounded: a busy machine decides them.
    print(f"base requests answered in {', '.join(f'{seconds:.2f}' for seconds in latencies)} s during the load")
    assert first_answered < answered["adapter"], latencies
    assert answered["adapter"] - sent >= SLOW_ADAPTER_LOAD_SECONDS


def test_alternating_two_adapters_through_a_cache_of_one(stack, bucket):
    """The worker's loader and runner in this process, on the stack's bucket and tiny model: one adapter fits."""
    import torch

    from contract.generation import AdapterRef
    from contract.messages import GenerationParameters
    from model_worker.adapters.loader import AdapterLoader
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    torch.set_num_threads(1)
    policy = SPEC.adapters.model_copy(update={"host_cache": 1, "device_cache": 1})
    spec = SPEC.model_copy(update={"adapters": policy, "scheduling": "step"})
    weights = stack.tiny_model_dir / MODEL
    runner = DiffusionRunner(spec, weights, torch_threads=1)
    loader = AdapterLoader(bucket, {MODEL: weights}, lambda: None)
    loader.start()
    registry = AdapterRegistry(bucket)
    refs = {name: registry.resolve(spec, name) for name in ("tiny-ink", "tiny-neon")}
    params = GenerationParameters(seed=3, num_inference_steps=2, guidance_scale=7.5, width=64, height=64)

    def image(name: str) -> np.ndarray:
        record = refs[name]
        ref = AdapterRef(name=name, version=record.version, scale=1.0, sha256=record.sha256)
        adapters = loader.request(spec, (ref,))
        assert adapters.done.wait(60)
        running = runner.start_items([GenerationItem("a cabin", 3, adapters=adapters)], params)
        while not all(r.finished for r in running):
            runner.denoise_step(running)
        return runner.decode(running)[0]

    try:
        first = {name: image(name) for name in refs}
        assert np.abs(first["tiny-ink"] - first["tiny-neon"]).max() > 0.02
        for name in ("tiny-ink", "tiny-neon"):
            assert np.array_equal(image(name), first[name]), name
        assert loader.loads == 4  # every alternation reloaded: the cache held one adapter
    finally:
        loader.stop()
