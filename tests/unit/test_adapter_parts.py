"""LoRA adapter parts without a stack: the file checks, the request parameters, and the pool holding a
request aside while its adapters load."""

from __future__ import annotations

import dataclasses
import json
import struct
import time

import pytest

from api_server.schemas import parse_body
from contract.generation import AdapterRef
from contract.lora_files import (
    AdapterFileError,
    bytes_reader,
    check_file_names,
    check_finite,
    check_targets,
    lora_targets,
    read_header,
)
from contract.settings import Settings
from model_worker.adapters import AdapterSet
from model_worker.pool import RequestPool
from tests.unit.test_worker_stages import pending

REF = AdapterRef(name="ink", version="1", scale=0.8, sha256="0" * 64)
MODULE = "down_blocks.0.attn.to_q"


def safetensors(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """A safetensors file of zeros: {name: (dtype, shape)}."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = {"F32": 4, "F16": 2}[dtype] * (shape[0] * shape[1] if len(shape) == 2 else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def targets_of(data: bytes):
    return lora_targets(read_header(bytes_reader(data), len(data)))


LORA = safetensors({f"unet.{MODULE}.lora_A.weight": ("F32", [4, 32]), f"unet.{MODULE}.lora_B.weight": ("F32", [16, 4])})
BASE = {"unet": {f"{MODULE}.weight": {"dtype": "F32", "shape": [16, 32], "data_offsets": [0, 2048]}}}


def test_a_lora_file_is_checked_from_its_header_against_the_base_shapes():
    targets = targets_of(LORA)
    assert [(t.module, t.rank, t.in_features, t.out_features) for t in targets] == [(MODULE, 4, 32, 16)]
    assert check_targets(targets, BASE, max_rank=8) == 4
    with pytest.raises(AdapterFileError, match="rank 4 exceeds 2"):
        check_targets(targets, BASE, max_rank=2)
    with pytest.raises(AdapterFileError, match="no such module"):
        check_targets(targets, {"unet": {}}, max_rank=8)
    other = {"unet": {f"{MODULE}.weight": {**BASE["unet"][f"{MODULE}.weight"], "shape": [16, 64]}}}
    with pytest.raises(AdapterFileError, match="does not match"):
        check_targets(targets, other, max_rank=8)


def test_malformed_lora_files_are_refused_by_name():
    with pytest.raises(AdapterFileError, match="truncated"):
        targets_of(LORA[:-10])
    with pytest.raises(AdapterFileError, match="not a safetensors file"):
        targets_of(b"\x80\x04\x95" + bytes(40))  # a pickle's first bytes
    with pytest.raises(AdapterFileError, match="must both be present"):
        targets_of(safetensors({f"unet.{MODULE}.lora_A.weight": ("F32", [4, 32])}))
    with pytest.raises(AdapterFileError, match="not a diffusers/PEFT LoRA tensor"):
        targets_of(safetensors({"model.layer.weight": ("F32", [4, 4])}))
    with pytest.raises(AdapterFileError, match="pickle"):
        check_file_names(["pytorch_lora_weights.safetensors", "adapter_model.bin"])
    with pytest.raises(AdapterFileError, match="only pytorch_lora_weights.safetensors"):
        check_file_names(["lora.safetensors"])


def test_the_request_names_adapters_with_strict_scales():
    body = parse_body({"instances": [{"prompt": "x"}], "parameters": {"adapters": [{"name": "ink", "scale": 0.5}]}})
    assert [(a.name, a.scale) for a in body.parameters.adapters] == [("ink", 0.5)]
    assert (
        parse_body({"instances": [{"prompt": "x"}], "parameters": {"adapters": [{"name": "ink"}]}})
        .parameters.adapters[0]
        .scale
        == 1.0
    )


def test_the_load_delay_hook_is_read_per_adapter_name():
    settings = Settings.from_env({"MAAS_ADAPTER_LOAD_DELAY": "slow-probe=6, other=0.5"})
    assert settings.adapter_load_delay == {"slow-probe": 6.0, "other": 0.5}
    assert Settings.from_env({}).adapter_load_delay == {}


def with_adapters(request, adapters: AdapterSet):
    params = request.request.parameters.model_copy(update={"adapters": adapters.refs})
    request.request = request.request.model_copy(update={"parameters": params})
    request.items = [dataclasses.replace(item, adapters=adapters) for item in request.items]
    return request


def test_a_request_waiting_for_its_adapters_blocks_nobody_and_runs_once_they_are_ready():
    pool = RequestPool(capacity=8)
    now = time.time()
    loading = AdapterSet((REF,))
    pool.add(with_adapters(pending("adapter", received_at=now - 2), loading))
    pool.add(pending("base", received_at=now - 1))
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["base"]
    batch, _ = pool.take_batch(timeout=0.05)
    assert batch == []  # still loading: nothing to run, and the device was not woken for it
    loading.done.set()
    pool.wake()
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["adapter"]


def test_requests_with_different_adapter_sets_never_share_a_call():
    ready = AdapterSet((REF,))
    ready.done.set()
    other = AdapterSet((REF.model_copy(update={"scale": 0.5}),))
    other.done.set()
    base, ink, ink_half = pending("b"), with_adapters(pending("i"), ready), with_adapters(pending("h"), other)
    assert len({base.batch_key, ink.batch_key, ink_half.batch_key}) == 3


class Blob:
    def __init__(self, bucket: FakeBucket, name: str) -> None:
        self.bucket, self.name = bucket, name

    @property
    def size(self) -> int:
        return len(self.bucket.objects[self.name])

    def download_as_bytes(self, start: int | None = None, end: int | None = None) -> bytes:
        from google.api_core import exceptions

        if self.name not in self.bucket.objects:
            raise exceptions.NotFound(self.name)
        data = self.bucket.objects[self.name]
        self.bucket.reads.append(self.name)
        return data if start is None else data[start : end + 1]

    def upload_from_string(self, data, content_type: str | None = None) -> None:
        self.bucket.objects[self.name] = data.encode() if isinstance(data, str) else data


class FakeBucket:
    """The few Bucket calls the registry makes, over a dict (the GCS emulator path is in tests/integration)."""

    name = "models"

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects, self.reads = dict(objects), []
        self.client = self

    def list_blobs(self, _bucket, prefix: str):
        return [Blob(self, name) for name in sorted(self.objects) if name.startswith(prefix)]

    def blob(self, name: str) -> Blob:
        return Blob(self, name)

    def get_blob(self, name: str) -> Blob | None:
        return Blob(self, name) if name in self.objects else None


def test_a_catalog_listed_adapter_resolves_without_registration_and_is_checked_once():
    from contract.adapter_registry import AdapterRegistry
    from emulators.stack import local_catalog

    spec = local_catalog().get("sd15-txt2img")
    spec = spec.model_copy(update={"adapters": spec.adapters.model_copy(update={"listed": {"house-style": "3"}})})
    weights = spec.weights_path
    lora = "adapters/sd15-txt2img/house-style/3/pytorch_lora_weights.safetensors"
    bucket = FakeBucket({
        f"{weights}/unet/diffusion_pytorch_model.safetensors": safetensors({f"{MODULE}.weight": ("F32", [16, 32])}),
        lora: LORA,
    })  # fmt: skip
    registry = AdapterRegistry(bucket)
    record = registry.resolve(spec, "house-style")
    assert (record.version, record.source, record.rank) == ("3", "catalog", 4)
    assert [r.name for r in registry.list(spec)] == ["house-style"]
    registry._known.clear()  # past the refresh: the record is read again, the file is not
    assert registry.resolve(spec, "house-style") == record
    assert bucket.reads.count(lora) == 1
    assert registry.resolve(spec, "not-listed") is None


# --- non-finite weights --------------------------------------------------------------------------


def lora_with(dtype, value: float) -> bytes:
    """A LoRA file whose lora_B holds one `value` among finite numbers, in `dtype`."""
    import torch
    from safetensors.torch import save

    b = torch.linspace(-3.0, 3.0, 64).reshape(16, 4)
    b[5, 2] = value
    return save(
        {f"unet.{MODULE}.lora_A.weight": torch.ones(4, 32, dtype=dtype), f"unet.{MODULE}.lora_B.weight": b.to(dtype)}
    )


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(dtype_name, value):
    import torch

    data = lora_with(getattr(torch, dtype_name), value)
    header = read_header(bytes_reader(data), len(data))
    with pytest.raises(AdapterFileError, match=rf"unet\.{MODULE}\.lora_B\.weight holds NaN or infinite values"):
        check_finite(header, data)


@pytest.mark.parametrize("dtype_name", ["float64", "float32", "float16", "bfloat16", "float8_e5m2", "float8_e4m3fn"])
def test_finite_extremes_pass_and_a_non_finite_scalar_of_any_float_dtype_is_found(dtype_name):
    import torch
    from safetensors.torch import save

    dtype = getattr(torch, dtype_name)
    info = torch.finfo(dtype)
    values = [info.max, -info.max, info.tiny, info.smallest_normal / 4, -0.0, 0.0, 1.0, -1.5]
    extremes = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert torch.isfinite(extremes.double()).all()  # the extremes really are finite in `dtype`
    fine = save({"extremes": extremes, "alpha": torch.tensor(4.0).to(dtype)})
    check_finite(read_header(bytes_reader(fine), len(fine)), fine)
    broken = save({"extremes": extremes, "alpha": torch.tensor(float("nan")).to(dtype)})
    with pytest.raises(AdapterFileError, match="alpha holds NaN"):
        check_finite(read_header(bytes_reader(broken), len(broken)), broken)


def test_an_adapter_registered_before_the_check_is_refused_at_the_workers_first_load(tmp_path):
    import hashlib

    import torch

    from contract import naming
    from emulators.stack import local_catalog
    from model_worker.adapters import AdapterLoader

    spec = local_catalog().get("sd15-txt2img")
    data = lora_with(torch.float32, float("nan"))
    base = safetensors({f"{MODULE}.weight": ("F32", [16, 32])})
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(base)
    bucket = FakeBucket({naming.adapter_prefix(spec.name, "nan-style", "1") + naming.ADAPTER_FILE: data})
    loader = AdapterLoader(bucket, {spec.queue: tmp_path}, lambda: None)
    loader.start()
    try:
        ref = AdapterRef(name="nan-style", version="1", scale=1.0, sha256=hashlib.sha256(data).hexdigest())
        adapters = loader.request(spec, (ref,))
        assert adapters.done.wait(30)
    finally:
        loader.stop()
    # The runner's ValueError is what the device loop answers as bad_input, this request alone.
    with pytest.raises(ValueError, match=r"nan-style@1: unet\..*lora_B\.weight holds NaN or infinite values"):
        adapters.weights()
    assert loader.loads == 0  # nothing cached: the next request for it is refused again, not served black


# --- activation on the real tiny pipeline ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny SD 1.5 pipeline `make up` builds, its runner, and its adapter `tiny-ink` as loaded weights."""
    import hashlib

    import torch

    from contract import naming
    from emulators.stack import local_catalog
    from model_worker.adapters import AdapterLoader
    from model_worker.pipeline import DiffusionRunner
    from model_worker.tiny_pipeline import build_adapter, build_pipeline

    torch.set_num_threads(1)
    spec = local_catalog().get("sd15-txt2img").model_copy(update={"scheduling": "request"})
    root = tmp_path_factory.mktemp("tiny")
    weights = build_pipeline(root / spec.name, spec.pipeline)
    data = build_adapter(weights, root / "ink.safetensors", seed=1, rank=4).read_bytes()
    bucket = FakeBucket({naming.adapter_prefix(spec.name, "tiny-ink", "1") + naming.ADAPTER_FILE: data})
    loader = AdapterLoader(bucket, {spec.queue: weights}, lambda: None)
    loader.start()
    ref = AdapterRef(name="tiny-ink", version="1", scale=0.8, sha256=hashlib.sha256(data).hexdigest())
    ink = loader.request(spec, (ref,))
    assert ink.done.wait(60)
    loader.stop()
    return DiffusionRunner(spec, weights, torch_threads=1), ink


def image(runner, adapters=None):
    from contract.messages import GenerationParameters
    from model_worker.runners import GenerationItem

    params = GenerationParameters(seed=5, num_inference_steps=2, guidance_scale=7.5, width=64, height=64)
    return runner.generate([GenerationItem("a lighthouse", 5, adapters=adapters)], params, lambda step, total: None)[0]


def hooks_attached(runner) -> int:
    pipeline = runner._pipeline
    return sum(len(m._forward_hooks) for part in (pipeline.unet, pipeline.text_encoder) for m in part.modules())


@pytest.mark.parametrize(
    ("name", "target", "why"),
    [
        ("missing-module", ("unet", "down_blocks.0.attentions.0.no_such_module"), "which does not exist"),
        ("embedding", ("text_encoder", "embeddings.token_embedding"), r"\(Embedding\): not a Linear module"),
    ],
)
def test_an_activation_that_fails_part_way_leaves_the_base_model_behind(tiny, name, target, why):
    import numpy as np
    import torch

    from model_worker.adapters import LoraWeights

    runner, ink = tiny
    base, inked = image(runner), image(runner, ink)
    assert np.abs(inked - base).max() > 0.02, "the adapter did not change the image"
    # The request's second adapter has one target that cannot be hooked, after targets that can: the old code
    # had attached the first adapter's hooks (and the second's others) when it failed.
    [(ink_weights, _)] = ink.loaded
    targets = {**ink_weights.targets, target: (torch.zeros(4, 32), torch.zeros(32, 4), 1.0)}
    broken = LoraWeights(name, "1", targets, 0)
    both = AdapterSet((*ink.refs, REF.model_copy(update={"name": name})), loaded=[*ink.loaded, (broken, 1.0)])
    both.done.set()
    with pytest.raises(ValueError, match=rf"adapter {name}@1 targets {target[0]}\.{target[1]},? {why}"):
        image(runner, both)
    assert np.array_equal(image(runner), base), "the base request after the failure ran with part of an adapter"
    assert hooks_attached(runner) == 0
    assert np.array_equal(image(runner, ink), inked)
    assert np.array_equal(image(runner), base)
