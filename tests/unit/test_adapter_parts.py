"""LoRA adapter parts without a stack: the file checks, the request parameters, and the pool holding a
request aside while its adapters load."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import time

import pytest

from api_server.predict.schemas import parse_body
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
from model_worker.adapters.loader import AdapterLoader, AdapterSet
from model_worker.held.pool import RequestPool
from tests.unit.test_worker_stages import pending

REF = AdapterRef(name="ink", version="1", scale=0.8, sha256="0" * 64)
MODULE = "down_blocks.0.attn.to_q"


def safetensors(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """A safetensors file of zeros: {name: (dtype, shape)}."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = {"F32": 4, "F16": 2}[dtype] * math.prod(shape)
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
    assert [(t.module, t.rank, t.down, t.up) for t in targets] == [(MODULE, 4, (4, 32), (16, 4))]
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
    with pytest.raises(AdapterFileError, match="both halves"):
        targets_of(safetensors({f"unet.{MODULE}.lora_A.weight": ("F32", [4, 32])}))
    with pytest.raises(AdapterFileError, match="not a LoRA tensor diffusers loads"):
        targets_of(safetensors({"model.layer.weight": ("F32", [4, 4])}))
    with pytest.raises(AdapterFileError, match="carries no .alpha"):  # diffusers refuses it in this layout
        targets_of(safetensors({**dict.fromkeys([f"unet.{MODULE}.alpha"], ("F32", [])),
                                f"unet.{MODULE}.lora_A.weight": ("F32", [4, 32])}))  # fmt: skip
    with pytest.raises(AdapterFileError, match="mixes"):
        targets_of(safetensors({f"unet.{MODULE}.lora_A.weight": ("F32", [4, 32]),
                                f"unet.{MODULE}.lora_B.weight": ("F32", [16, 4]),
                                "lora_unet_x.lora_down.weight": ("F32", [4, 32]),
                                "lora_unet_x.lora_up.weight": ("F32", [16, 4])}))  # fmt: skip
    with pytest.raises(AdapterFileError, match="pickle"):
        check_file_names(["pytorch_lora_weights.safetensors", "adapter_model.bin"])
    with pytest.raises(AdapterFileError, match="only pytorch_lora_weights.safetensors"):
        check_file_names(["lora.safetensors"])


def base_entry(*shape: int) -> dict:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]}


SD_BASE = {
    "unet": {
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight": base_entry(32, 32),
        "down_blocks.0.resnets.0.conv1.weight": base_entry(32, 32, 3, 3),
    },
    "text_encoder": {"text_model.encoder.layers.0.self_attn.q_proj.weight": base_entry(32, 32)},
}
FLUX_BASE = {
    "transformer": {
        **{f"transformer_blocks.0.attn.to_{p}.weight": base_entry(32, 32) for p in "qkv"},
        **{f"single_transformer_blocks.0.attn.to_{p}.weight": base_entry(32, 32) for p in "qkv"},
        "single_transformer_blocks.0.proj_mlp.weight": base_entry(128, 32),
    },
    "text_encoder": {"encoder.layers.0.self_attn.q_proj.weight": base_entry(32, 32)},
}


def kohya(pairs: dict[str, tuple[list[int], list[int]]], alpha: bool = True) -> bytes:
    tensors = {}
    for name, (down, up) in pairs.items():
        tensors[f"{name}.lora_down.weight"] = ("F32", down)
        tensors[f"{name}.lora_up.weight"] = ("F32", up)
        if alpha:
            tensors[f"{name}.alpha"] = ("F32", [])
    return safetensors(tensors)


def test_kohya_and_locon_names_resolve_to_the_base_modules_diffusers_converts_them_to():
    data = kohya({
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q": ([4, 32], [32, 4]),
        "lora_unet_down_blocks_0_resnets_0_conv1": ([4, 32, 3, 3], [32, 4, 1, 1]),  # LoCon: a conv layer
        "lora_te_text_model_encoder_layers_0_self_attn_q_proj": ([8, 32], [32, 8]),
    })  # fmt: skip
    targets = targets_of(data)
    assert {(t.component, t.layout, t.rank) for t in targets} == {("unet", "kohya", 4), ("text_encoder", "kohya", 8)}
    assert check_targets(targets, SD_BASE, max_rank=8) == 8
    # A text encoder's `text_model.` prefix is optional on either side (transformers 5 flattens CLIPTextModel).
    flat = {**SD_BASE, "text_encoder": {"encoder.layers.0.self_attn.q_proj.weight": base_entry(32, 32)}}
    assert check_targets(targets, flat, max_rank=8) == 8
    wrong_kernel = kohya({"lora_unet_down_blocks_0_resnets_0_conv1": ([4, 32, 1, 1], [32, 4, 1, 1])})
    with pytest.raises(AdapterFileError, match=r"lora_unet_down_blocks_0_resnets_0_conv1: shape 32x32x1x1 does not "
                                               r"match the base model's 32x32x3x3"):  # fmt: skip
        check_targets(targets_of(wrong_kernel), SD_BASE, max_rank=8)
    with pytest.raises(AdapterFileError, match="do not make a LoRA pair"):
        targets_of(kohya({"lora_unet_x": ([4, 32, 3, 3], [32, 4, 3, 3])}))
    with pytest.raises(AdapterFileError, match="lora_unet_down_blocks_9_attn: no such module"):
        check_targets(targets_of(kohya({"lora_unet_down_blocks_9_attn": ([4, 32], [32, 4])})), SD_BASE, 8)


def test_flux_bfl_names_resolve_to_the_split_projections_and_a_file_for_another_family_is_refused():
    data = kohya({
        "lora_unet_double_blocks_0_img_attn_qkv": ([4, 32], [96, 4]),  # to_q, to_k, to_v side by side
        "lora_unet_single_blocks_0_linear1": ([4, 32], [224, 4]),  # q, k, v and the MLP input
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj": ([4, 32], [32, 4]),
    })  # fmt: skip
    assert check_targets(targets_of(data), FLUX_BASE, max_rank=4) == 4
    short = kohya({"lora_unet_double_blocks_0_img_attn_qkv": ([4, 32], [64, 4])})
    with pytest.raises(AdapterFileError, match=r"does not match the base model's 32x32 \+ 32x32 \+ 32x32"):
        check_targets(targets_of(short), FLUX_BASE, max_rank=4)
    with pytest.raises(AdapterFileError, match="no such module"):
        check_targets(targets_of(kohya({"lora_unet_double_blocks_0_nothing": ([4, 32], [32, 4])})), FLUX_BASE, 4)
    # An SD 1.5 file on FLUX, and a FLUX file on SD 1.5: each names a component the other family lacks.
    with pytest.raises(AdapterFileError, match="the base model has no unet"):
        check_targets(targets_of(LORA), FLUX_BASE, max_rank=8)
    flux_peft = safetensors({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": ("F32", [4, 32]),
                             "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": ("F32", [32, 4])})  # fmt: skip
    assert check_targets(targets_of(flux_peft), FLUX_BASE, max_rank=4) == 4
    with pytest.raises(AdapterFileError, match="the base model has no transformer .a LoRA for another family"):
        check_targets(targets_of(flux_peft), SD_BASE, max_rank=4)


def test_headers_that_claim_too_much_are_refused_before_anything_is_read():
    import struct

    huge = json.dumps({"w": {"dtype": "F32", "shape": [65536, 32768], "data_offsets": [0, 8 * 2**30]}}).encode()
    claims_8gb = struct.pack("<Q", len(huge)) + huge + bytes(64)
    with pytest.raises(AdapterFileError, match="truncated or inconsistent safetensors file at 'w'"):
        read_header(bytes_reader(claims_8gb), len(claims_8gb))
    padding = b" " * (100 * 2**20)
    big_header = struct.pack("<Q", len(padding) + 2) + b"{}" + padding
    reads: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        reads.append((start, end))
        return big_header[start : end + 1]

    with pytest.raises(AdapterFileError, match="bad header length"):
        read_header(read, len(big_header))
    assert reads == [(0, 7)]  # the 100 MB header itself was never read


def test_the_request_names_adapters_with_strict_scales():
    body = parse_body({"instances": [{"prompt": "x"}], "parameters": {"adapters": [{"name": "ink", "scale": 0.5}]}})
    assert [(a.name, a.scale) for a in body.parameters.adapters] == [("ink", 0.5)]
    assert (
        parse_body({"instances": [{"prompt": "x"}], "parameters": {"adapters": [{"name": "ink"}]}})
        .parameters.adapters[0]
        .scale
        == 1.0
    )


def test_the_load_delay_hook_is_read_per_adapter_name_and_refused_in_production():
    settings = Settings.from_env({"MAAS_ADAPTER_LOAD_DELAY": "slow-probe=6, other=0.5"})
    assert settings.adapter_load_delay == {"slow-probe": 6.0, "other": 0.5}
    assert Settings.from_env({}).adapter_load_delay == {}
    with pytest.raises(ValueError, match="MAAS_ADAPTER_LOAD_DELAY is a local-stack fault hook"):
        Settings.from_env({"MAAS_ENV": "production", "MAAS_ADAPTER_LOAD_DELAY": "slow-probe=6"})


def test_the_local_stacks_slow_adapter_reads_delay_only_the_first_read_of_the_named_adapters_file(monkeypatch):
    """The fault hook wraps the bucket (model_worker/serving/fault_hooks.py): the worker's loader has no test hook of its
    own."""
    import inspect

    from contract import naming
    from model_worker.adapters.loader import AdapterLoader
    from model_worker.serving import fault_hooks as faults

    assert "delay" not in inspect.signature(AdapterLoader).parameters
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    slow_file = naming.adapter_prefix("m", "slow-probe", "2") + naming.ADAPTER_FILE
    bucket = faults.SlowAdapterReads(FakeBucket({slow_file: b"x", "m/unet/slow-probe": b"y"}), {"slow-probe": 6.0})
    assert bucket.get_blob("m/unet/slow-probe") is not None and slept == []  # not an adapter's file: no delay
    assert bucket.get_blob(slow_file).download_as_bytes() == b"x" and slept == [6.0]
    assert bucket.get_blob(slow_file) is not None and slept == [6.0]  # the first read only
    assert bucket.name == "models"  # everything else is the bucket's own


def test_a_held_synthetic_call_waits_after_its_first_step_until_its_gate_opens(tmp_path):
    """The local stack's `MAAS_HOLD_DIR` hook: a test sees a running request by order, not by outpacing a timer."""
    import threading

    from model_worker.model.runners import GenerationItem, SyntheticRunner
    from model_worker.serving import fault_hooks as faults
    from tests.unit.test_progress_steps import SLEEP, params

    runner = faults.HeldCalls(SyntheticRunner(SLEEP), str(tmp_path))
    assert runner.accelerator == "synthetic" and runner.spec is SLEEP  # everything else is the runner's own
    steps: list[int] = []
    stepped, done = threading.Event(), threading.Event()

    def on_step(step: int, total: int) -> None:
        steps.append(step)
        stepped.set()

    call = threading.Thread(
        target=lambda: (runner.generate([GenerationItem("!hold gate-1", 1)], params(4), on_step), done.set())
    )
    call.start()
    assert stepped.wait(10) and steps == [4]  # progress reported (the runner has a single tick) ...
    assert not done.wait(0.3)  # ... then held
    (tmp_path / "gate-1").touch()
    assert done.wait(10)
    call.join()
    plain: list[int] = []
    runner.generate(
        [GenerationItem("!hold", 2), GenerationItem("!hold ../x", 3)], params(4), lambda s, t: plain.append(s)
    )
    assert plain == [4]  # no gate name (or not a plain one): not held
    assert Settings.from_env({"MAAS_HOLD_DIR": str(tmp_path)}).hold_dir == str(tmp_path)
    with pytest.raises(ValueError, match="MAAS_HOLD_DIR is a local-stack fault hook"):
        Settings.from_env({"MAAS_ENV": "production", "MAAS_HOLD_DIR": str(tmp_path)})


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
    from contract.stores.adapter_registry import AdapterRegistry
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


def loaded_by_the_worker(spec, name: str, data: bytes, base_dir) -> tuple[AdapterSet, AdapterLoader]:
    """`data` registered as `name` version 1 and loaded by the worker's own loader against the base in `base_dir`;
    the set with the (stopped) loader that loaded it."""
    import hashlib

    from contract import naming

    bucket = FakeBucket({naming.adapter_prefix(spec.name, name, "1") + naming.ADAPTER_FILE: data})
    loader = AdapterLoader(bucket, {spec.queue: base_dir}, lambda: None)
    loader.start()
    try:
        ref = AdapterRef(name=name, version="1", scale=1.0, sha256=hashlib.sha256(data).hexdigest())
        adapters = loader.request(spec, (ref,))
        assert adapters.done.wait(30)
    finally:
        loader.stop()
    return adapters, loader


def test_an_adapter_registered_before_the_check_is_refused_at_the_workers_first_load(tmp_path):
    import torch

    from emulators.stack import local_catalog

    spec = local_catalog().get("sd15-txt2img")
    data = lora_with(torch.float32, float("nan"))
    base = safetensors({f"{MODULE}.weight": ("F32", [16, 32])})
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(base)
    adapters, loader = loaded_by_the_worker(spec, "nan-style", data, tmp_path)
    # The runner's ValueError is what the device loop answers as bad_input, this request alone.
    with pytest.raises(ValueError, match=r"nan-style@1: unet\..*lora_B\.weight holds NaN or infinite values"):
        adapters.weights()
    assert loader.loads == 0  # nothing cached: the next request for it is refused again, not served black


def test_a_sharded_base_component_is_read_from_every_shard_its_index_names(tmp_path):
    """FLUX.1's transformer ships in shards: the worker (local files) and the registry (the bucket) merge them."""
    from contract.lora_files import base_headers
    from contract.stores.adapter_registry import AdapterRegistry
    from emulators.stack import local_catalog
    from model_worker.adapters.loader import _file_opener

    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": {"transformer_blocks.0.attn.to_q.weight": [32, 32]},
        "diffusion_pytorch_model-00002-of-00002.safetensors": {"single_transformer_blocks.0.proj_mlp.weight": [128, 32]},
    }  # fmt: skip
    files = {f"transformer/{shard}": safetensors({name: ("F32", shape) for name, shape in weights.items()})
             for shard, weights in shards.items()}  # fmt: skip
    index = {"metadata": {}, "weight_map": {name: shard for shard, weights in shards.items() for name in weights}}
    files["transformer/diffusion_pytorch_model.safetensors.index.json"] = json.dumps(index).encode()
    for path, data in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    lora = safetensors({
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": ("F32", [4, 32]),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": ("F32", [32, 4]),
        "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": ("F32", [4, 32]),
        "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": ("F32", [128, 4]),
    })  # fmt: skip
    local = base_headers(("transformer", "text_encoder"), _file_opener(tmp_path))
    assert set(local) == {"transformer"} and len(local["transformer"]) == 2
    assert check_targets(targets_of(lora), local, max_rank=8) == 4

    flux = local_catalog().get("flux-schnell")
    spec = flux.model_copy(update={"weights_path": "flux/1", "adapters": local_catalog().get("sd15-txt2img").adapters})
    bucket = FakeBucket({f"flux/1/{path}": data for path, data in files.items()})
    assert AdapterRegistry(bucket)._base_headers(spec) == local
    del bucket.objects["flux/1/transformer/diffusion_pytorch_model-00002-of-00002.safetensors"]
    with pytest.raises(AdapterFileError, match="00002-of-00002.safetensors, named by the base model's weight index, "):
        AdapterRegistry(bucket)._base_headers(spec)
