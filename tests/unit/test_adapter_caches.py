"""The worker's adapter caches: the host LRU bounded in bytes as well as in count, and keyed by what was checked (the
serving unit's base weights) and what was registered (the file's digest), on the host and on the device."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from contract import naming
from contract.generation import AdapterRef
from contract.settings import ADAPTER_HOST_CACHE_BYTES, Settings
from emulators.stack import local_catalog
from tests.unit.test_adapter_parts import MODULE, FakeBucket, safetensors

SPEC = local_catalog().get("sd15-txt2img")


def lora(seed: int, rank: int = 4) -> bytes:
    """A LoRA file for the one-module base below, its values drawn from `seed` (same size for the same rank)."""
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(seed)
    return save({
        f"unet.{MODULE}.lora_A.weight": torch.randn(rank, 32, generator=generator),
        f"unet.{MODULE}.lora_B.weight": torch.randn(16, rank, generator=generator),
    })  # fmt: skip


def base_dir(root: Path, columns: int = 32) -> Path:
    """A base model's local weights: one UNet module of 16 x `columns`."""
    (root / "unet").mkdir(parents=True)
    (root / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(
        safetensors({f"{MODULE}.weight": ("F32", [16, columns])})
    )
    return root


def adapter_file(name: str, version: str = "1") -> str:
    return naming.adapter_prefix(SPEC.name, name, version) + naming.ADAPTER_FILE


def ref(name: str, data: bytes, version: str = "1") -> AdapterRef:
    return AdapterRef(name=name, version=version, scale=1.0, sha256=hashlib.sha256(data).hexdigest())


class Loader:
    """The worker's loader on a dict bucket, started and stopped around a test."""

    def __init__(self, bucket: FakeBucket, weights_dirs: dict[str, Path], **options) -> None:
        from model_worker.adapters.loader import AdapterLoader

        self.bucket = bucket
        self.loader = AdapterLoader(bucket, weights_dirs, lambda: None, **options)

    def __enter__(self):
        self.loader.start()
        return self.loader

    def __exit__(self, *_exc) -> None:
        self.loader.stop()


def load(loader, spec, *refs: AdapterRef):
    adapters = loader.request(spec, refs)
    assert adapters.done.wait(30)
    return adapters


def with_host_cache(spec, count: int):
    return spec.model_copy(update={"adapters": spec.adapters.model_copy(update={"host_cache": count})})


# --- bounded in bytes ------------------------------------------------------------------------------


def test_the_budget_is_one_setting_with_a_documented_default():
    assert Settings.from_env({}).adapter_host_cache_bytes == ADAPTER_HOST_CACHE_BYTES == 4 * 1024**3
    assert Settings.from_env({"MAAS_ADAPTER_HOST_CACHE_BYTES": "1048576"}).adapter_host_cache_bytes == 2**20
    with pytest.raises(ValueError, match="must be positive"):
        Settings.from_env({"MAAS_ADAPTER_HOST_CACHE_BYTES": "-1"})
    # SDXL's and FLUX's largest files (the catalog's max_bytes) fit it, so none is loaded again for every request.
    assert max(spec.adapters.max_bytes for spec in local_catalog().units() if spec.adapters) <= ADAPTER_HOST_CACHE_BYTES


def test_the_least_recently_used_adapter_is_dropped_when_the_bytes_run_out_before_the_count_does(tmp_path):
    files = {name: lora(seed) for seed, name in enumerate(("ink", "neon", "dots"))}
    size = len(files["ink"])
    assert {len(data) for data in files.values()} == {size}
    bucket = FakeBucket({adapter_file(name): data for name, data in files.items()})
    spec = with_host_cache(SPEC, 16)  # the count is no limit here: the bytes are
    with Loader(bucket, {spec.queue: base_dir(tmp_path)}, host_cache_bytes=2 * size + size // 2) as loader:
        for name in ("ink", "neon"):
            load(loader, spec, ref(name, files[name])).weights()
        assert loader.cached_bytes == 2 * size
        load(loader, spec, ref("dots", files["dots"])).weights()  # a third does not fit: ink, the oldest, goes
        assert [name for name, _, _ in loader.cached(spec)] == ["neon", "dots"]
        assert loader.cached_bytes == 2 * size and loader.loads == 3
        load(loader, spec, ref("neon", files["neon"])).weights()  # a hit: neon is now the most recently used
        assert loader.loads == 3
        load(loader, spec, ref("ink", files["ink"])).weights()  # read again; dots is the one dropped this time
        assert [name for name, _, _ in loader.cached(spec)] == ["neon", "ink"]
        assert loader.loads == 4 and loader.cached_bytes <= 2 * size + size // 2


def test_one_request_keeps_its_set_even_when_the_cache_holds_less_than_the_set(tmp_path):
    files = {"ink": lora(1), "neon": lora(2)}
    bucket = FakeBucket({adapter_file(name): data for name, data in files.items()})
    size = len(files["ink"])
    with Loader(bucket, {SPEC.queue: base_dir(tmp_path)}, host_cache_bytes=size + size // 2) as loader:
        adapters = load(loader, SPEC, ref("ink", files["ink"]), ref("neon", files["neon"]))
        assert [weights.name for weights, _ in adapters.weights()] == ["ink", "neon"]
        assert [name for name, _, _ in loader.cached(SPEC)] == ["neon"]


def test_the_count_still_bounds_each_model_and_the_bytes_bound_the_whole_worker(tmp_path):
    files = {name: lora(seed) for seed, name in enumerate(("ink", "neon", "dots"))}
    size = len(files["ink"])
    bucket = FakeBucket({adapter_file(name): data for name, data in files.items()})
    one = with_host_cache(SPEC.model_copy(update={"versioned": True, "version": "1"}), 1)
    two = with_host_cache(SPEC.model_copy(update={"versioned": True, "version": "2"}), 16)
    dirs = {one.queue: base_dir(tmp_path / "1"), two.queue: base_dir(tmp_path / "2")}
    with Loader(bucket, dirs, host_cache_bytes=2 * size + size // 2) as loader:
        load(loader, one, ref("ink", files["ink"])).weights()
        load(loader, one, ref("neon", files["neon"])).weights()  # version 1 keeps one
        assert [name for name, _, _ in loader.cached(one)] == ["neon"]
        load(loader, two, ref("ink", files["ink"])).weights()
        load(loader, two, ref("dots", files["dots"])).weights()  # three files do not fit the worker's bytes
        assert loader.cached(one) == [] and [name for name, _, _ in loader.cached(two)] == ["ink", "dots"]


def test_a_file_larger_than_the_whole_cache_is_served_to_its_request_and_not_kept(tmp_path):
    data = lora(1)
    bucket = FakeBucket({adapter_file("ink"): data})
    with Loader(bucket, {SPEC.queue: base_dir(tmp_path)}, host_cache_bytes=len(data) - 1) as loader:
        for _ in range(2):
            [(weights, _)] = load(loader, SPEC, ref("ink", data)).weights()
            assert weights.nbytes == len(data)
        assert loader.loads == 2 and loader.cached_bytes == 0


# --- keyed by the digest and the serving unit ------------------------------------------------------


def test_a_version_re_registered_with_another_file_is_never_served_from_the_old_one(tmp_path):
    from safetensors.torch import load as parse

    old, new = lora(1), lora(2)
    bucket = FakeBucket({adapter_file("ink"): old})
    with Loader(bucket, {SPEC.queue: base_dir(tmp_path)}) as loader:
        [(first, _)] = load(loader, SPEC, ref("ink", old)).weights()
        bucket.objects[adapter_file("ink")] = new  # uploaded over ink@1 and registered again: a new digest
        [(second, _)] = load(loader, SPEC, ref("ink", new)).weights()
        assert loader.loads == 2, "the new file was not read"
        expected = parse(new)
        assert all((second.tensors[key] == expected[key]).all() for key in expected)
        assert first.key != second.key  # and the device keeps them apart (lora.py)
        # A request resolved just before the re-registration (the API re-reads records within seconds) still gets
        # the file its record names, never a mix.
        [(held, _)] = load(loader, SPEC, ref("ink", old)).weights()
        assert held is first
    fresh = Loader(bucket, {SPEC.queue: base_dir(tmp_path / "fresh")})  # a worker that never held it
    with fresh as loader, pytest.raises(ValueError, match="ink@1: the file changed since it was registered"):
        load(loader, SPEC, ref("ink", old)).weights()


def test_each_version_checks_an_adapter_against_its_own_base_weights(tmp_path):
    data = lora(1)
    bucket = FakeBucket({adapter_file("ink"): data})
    one = SPEC.model_copy(update={"versioned": True, "version": "1"})
    two = SPEC.model_copy(update={"versioned": True, "version": "2"})
    assert one.queue != two.queue and one.name == two.name
    dirs = {one.queue: base_dir(tmp_path / "1"), two.queue: base_dir(tmp_path / "2", columns=64)}
    with Loader(bucket, dirs) as loader:
        load(loader, one, ref("ink", data)).weights()
        with pytest.raises(ValueError, match=r"ink@1: .*shape 16x32 does not match the base model's 16x64"):
            load(loader, two, ref("ink", data)).weights()
        assert loader.cached(two) == [] and len(loader.cached(one)) == 1
        load(loader, one, ref("ink", data)).weights()  # still served where it fits, from the cache
        assert loader.loads == 1


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> dict:
    from tests.unit.family_references import tiny_pipelines
    from tests.unit.test_adapter_families import FAMILIES

    return tiny_pipelines(tmp_path_factory.mktemp("adapter-caches"), {"sd15": FAMILIES["sd15"]})


def test_a_re_registered_version_is_put_on_the_device_anew(sd15):
    """The device's resident adapters are keyed by the digest too: a runner that ran ink@1 runs the new ink@1."""
    from tests.unit.test_adapter_families import loaded, peft_file, reference_with, served
    from tests.unit.test_model_families import assert_close

    directory = sd15["sd15"][0]
    old, new = peft_file(directory, 1, 4), peft_file(directory, 2, 4)
    _, _, runner = served(sd15, "sd15", "step")
    images, _, _ = served(sd15, "sd15", "step", runner, loaded("sd15", sd15, {"ink": old}, {"ink": 1.0}))
    again, pending, _ = served(sd15, "sd15", "step", runner, loaded("sd15", sd15, {"ink": new}, {"ink": 1.0}))
    assert_close(again, reference_with(sd15, "sd15", pending, {"ink": new}, {"ink": 1.0}))
    with pytest.raises(AssertionError):
        assert_close(again, images)  # the two files really make different images
