"""Control models (ControlNets, IP-Adapters) registered like adapters: checked against the base model's own UNet
before any byte runs, hostile files refused with their reason, listed; the worker's host cache sized in bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from contract import naming
from contract.control_files import ControlFileError, check_control, digest
from emulators.stack import local_catalog
from emulators.tiny_controls import build_controlnet, build_ip_adapter, control_files
from tests.unit.test_adapter_parts import FakeBucket

SPEC = local_catalog().get("sd15-txt2img")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """A tiny SD 1.5 UNet's folder (its pipeline's layout) and its ControlNet's and IP-Adapter's files (built once for the module)."""
    import torch

    from emulators.tiny_pipeline import sd15_unet

    root = tmp_path_factory.mktemp("controls")
    pipeline = root / "sd15"
    torch.manual_seed(0)
    sd15_unet().save_pretrained(pipeline / "unet", safe_serialization=True)
    return {
        "pipeline": pipeline,
        "controlnet": control_files(build_controlnet(pipeline, root / "controlnet", seed=1)),
        "ip_adapter": control_files(build_ip_adapter(pipeline, root / "ip_adapter", seed=2)),
    }


def base_of(pipeline: Path) -> tuple[dict, dict]:
    from contract.lora_files import bytes_reader, read_header

    data = (pipeline / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    return json.loads((pipeline / "unet" / "config.json").read_text()), read_header(bytes_reader(data), len(data))


def bucket_with(pipeline: Path, name: str, files: dict[str, bytes], version: str = "1") -> FakeBucket:
    root = SPEC.weights_path
    objects = {f"{root}/unet/{file}": (pipeline / "unet" / file).read_bytes()
               for file in ("config.json", "diffusion_pytorch_model.safetensors")}  # fmt: skip
    prefix = naming.control_prefix(SPEC.name, name, version)
    objects.update({prefix + file: data for file, data in files.items()})
    return FakeBucket(objects)


def retensored(data: bytes, change) -> bytes:
    """The safetensors file with its tensors changed by `change(dict) -> dict` (torch's own writer)."""
    from safetensors.torch import load, save

    return save(change(load(data)))


def refusal(built, kind: str, files: dict[str, bytes]) -> str:
    with pytest.raises(ControlFileError) as refused:
        check_control(kind, files, *base_of(built["pipeline"]))
    return str(refused.value)


def test_a_tiny_controlnet_and_ip_adapter_register_are_listed_and_resolve_with_their_digest(built):
    from contract.stores.control_registry import ControlRegistry

    bucket = bucket_with(built["pipeline"], "edges", built["controlnet"])
    prefix = naming.control_prefix(SPEC.name, "style", "2")
    bucket.objects.update({prefix + file: data for file, data in built["ip_adapter"].items()})
    registry = ControlRegistry(bucket)
    edges = registry.register(SPEC, "edges", "controlnet", "1")
    style = registry.register(SPEC, "style", "ip_adapter", "2")
    assert (edges.kind, edges.version, edges.sha256) == ("controlnet", "1", digest(built["controlnet"]))
    assert (style.kind, style.version, style.bytes) == ("ip_adapter", "2", sum(map(len, built["ip_adapter"].values())))
    assert [record.name for record in registry.list(SPEC)] == ["edges", "style"]
    registry._known.clear()  # another process reads the records from the bucket
    assert registry.resolve(SPEC, "edges") == edges
    assert registry.resolve(SPEC, "nothing") is None
    # The records live under the API's one writable prefix, apart from the model's adapters.
    assert all(name.startswith("adapters/_controls/sd15-txt2img/") for name in bucket.objects if "registration" in name)


def test_a_control_of_a_kind_the_family_or_model_does_not_take_is_refused(built):
    from contract.stores.control_registry import ControlRegistry

    registry = ControlRegistry(bucket_with(built["pipeline"], "edges", built["controlnet"]))
    with pytest.raises(ControlFileError, match="takes no control models"):
        registry.check(SPEC.model_copy(update={"controls": None}), "edges", "controlnet", "1")
    with pytest.raises(ControlFileError, match="sd15 models take controlnet, ip_adapter, not 'union'"):
        registry.check(SPEC, "edges", "union", "1")
    # An IP-Adapter's files registered as a ControlNet: the files are the wrong ones.
    with pytest.raises(ControlFileError, match="ip_adapter version holds ip_adapter.safetensors"):
        registry.check(SPEC, "edges", "ip_adapter", "1")


def test_hostile_controlnet_files_are_refused_with_their_reason(built):
    weights = "diffusion_pytorch_model.safetensors"
    files = built["controlnet"]
    nan = retensored(files[weights], lambda t: {**t, "controlnet_mid_block.weight": t["controlnet_mid_block.weight"]
                                                * float("nan")})  # fmt: skip
    assert "controlnet_mid_block.weight holds NaN or infinite values" in refusal(built, "controlnet",
                                                                                  {**files, weights: nan})  # fmt: skip
    # Two tensors claiming the same bytes (a header written by hand).
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}  # fmt: skip
    raw = json.dumps(header).encode()
    overlapping = struct.pack("<Q", len(raw)) + raw + bytes(24)
    assert "overlap" in refusal(built, "controlnet", {**files, weights: overlapping})
    # A tensor of the UNet's encoder in another shape: a ControlNet for another model.
    import torch

    wrong = retensored(files[weights], lambda t: {**t, "conv_in.weight": torch.zeros(64, 4, 3, 3)})
    assert "conv_in.weight is 64x4x3x3, the base UNet's is 32x4x3x3" in refusal(built, "controlnet",
                                                                                {**files, weights: wrong})  # fmt: skip
    short = retensored(files[weights], lambda t: {k: v for k, v in t.items() if k != "controlnet_down_blocks.3.weight"})
    assert "controlnet_down_blocks.3.weight is missing" in refusal(built, "controlnet", {**files, weights: short})
    config = json.loads(files["config.json"])
    other = json.dumps({**config, "cross_attention_dim": 64}).encode()
    assert "cross_attention_dim 64 does not match the base UNet's 32" in refusal(built, "controlnet",
                                                                                {**files, "config.json": other})  # fmt: skip
    assert "pickle-format files are refused" in refusal(
        built, "controlnet", {**files, "diffusion_pytorch_model.bin": b""}
    )
    assert "holds config.json, diffusion_pytorch_model.safetensors only; found extra.txt" in refusal(
        built, "controlnet", {**files, "extra.txt": b""}
    )


def test_an_inpainting_models_controlnets_are_of_its_latents_not_its_nine_input_channels(built, tmp_path):
    """An inpainting UNet (9 input channels) takes SD 1.5's own ControlNets (4: the latents, as diffusers'
    StableDiffusionControlNetInpaintPipeline feeds them); one made of the 9-channel UNet is refused."""
    import torch
    from diffusers import ControlNetModel

    from emulators.tiny_pipeline import sd15_unet

    inpainting = tmp_path / "sd15-inpaint"
    torch.manual_seed(0)
    unet = sd15_unet(in_channels=9)
    unet.save_pretrained(inpainting / "unet", safe_serialization=True)
    summary = check_control("controlnet", built["controlnet"], *base_of(inpainting))
    assert summary.sha256 == digest(built["controlnet"])
    # The tiny one `make up` registers for sd15-inpaint: built of the inpainting UNet's latent channels.
    check_control("controlnet", control_files(build_controlnet(inpainting, tmp_path / "tiny", seed=1)),
                  *base_of(inpainting))  # fmt: skip
    ControlNetModel.from_unet(unet).save_pretrained(tmp_path / "nine", safe_serialization=True)
    nine = control_files(tmp_path / "nine")
    with pytest.raises(ControlFileError, match="in_channels 9 does not match the base UNet's 4"):
        check_control("controlnet", nine, *base_of(inpainting))
    # The plain model's ControlNets stay of its own 4 channels.
    assert "in_channels 9 does not match the base UNet's 4" in refusal(built, "controlnet", nine)


def test_a_version_past_the_models_control_budget_is_a_413_with_the_numbers(built):
    """Registration through the API checks the version's size on the GPU (its tensors in the serving dtype) against
    the model's control budget over `max_controls_per_request`; within it, the version registers."""
    from api_server.core.errors import ApiError
    from api_server.predict.controls import ControlService
    from contract.control_files import check_control
    from contract.memory_plan import control_budget
    from contract.stores.control_registry import ControlRegistry

    parameters = check_control("controlnet", built["controlnet"], *base_of(built["pipeline"])).parameters
    device = parameters * 2  # float16, SD 1.5's serving dtype
    budgets = iter([(2 * device - 1, "a test's"), (2 * device, "a test's")])
    service = ControlService(ControlRegistry(bucket_with(built["pipeline"], "edges", built["controlnet"])),
                             lambda spec: next(budgets))  # fmt: skip
    with pytest.raises(ApiError) as refused:
        service.register(SPEC, "edges", "controlnet", "1")
    assert (refused.value.status, refused.value.field) == (413, "file")
    assert (f"edges@1 takes {device} bytes on the GPU ({parameters} parameters in float16); sd15-txt2img runs up to "
            f"2 control models at once within its control budget of {2 * device - 1} bytes (a test's): at most "
            f"{device - 1} bytes each") in refused.value.message  # fmt: skip
    assert service.listing(SPEC) == []  # nothing recorded
    record = service.register(SPEC, "edges", "controlnet", "1")
    assert record.parameters == parameters
    # The local catalog's sd15-txt2img: what its worker group's plan leaves (hundreds of MB), room for the tiny version.
    catalog = local_catalog()
    budget, where = control_budget(catalog.deployment_plans()[SPEC.deployment], SPEC)
    assert budget > 10**8 and "memory plan leaves" in where


def test_hostile_ip_adapter_files_are_refused_with_their_reason(built):
    import torch

    files = built["ip_adapter"]
    main = "ip_adapter.safetensors"
    inf = retensored(files[main], lambda t: {**t, "ip_adapter.1.to_k_ip.weight": t["ip_adapter.1.to_k_ip.weight"]
                                             / 0.0})  # fmt: skip
    assert "ip_adapter.1.to_k_ip.weight holds NaN or infinite values" in refusal(built, "ip_adapter",
                                                                                 {**files, main: inf})  # fmt: skip
    narrow = retensored(files[main], lambda t: {**t, "ip_adapter.3.to_v_ip.weight": torch.zeros(32, 32)})
    assert "ip_adapter.3.to_v_ip.weight is 32x32; the base UNet's cross-attention there needs 64x32" in refusal(
        built, "ip_adapter", {**files, main: narrow}
    )
    fewer = retensored(files[main], lambda t: {k: v for k, v in t.items() if not k.startswith("ip_adapter.11.")})
    assert "5 ip_adapter layers; the base UNet has 6 cross-attention layers" in refusal(built, "ip_adapter",
                                                                                       {**files, main: fewer})  # fmt: skip
    plus = retensored(files[main], lambda t: {**t, "image_proj.latents": torch.zeros(1, 4, 32)})
    plus = retensored(plus, lambda t: {k: v for k, v in t.items() if k != "image_proj.proj.weight"})
    assert "an IP-Adapter Plus projection" in refusal(built, "ip_adapter", {**files, main: plus})
    encoder = json.loads(files["image_encoder/config.json"])
    other = json.dumps({**encoder, "projection_dim": 16}).encode()
    assert "projection_dim 16 is not the 32" in refusal(
        built, "ip_adapter", {**files, "image_encoder/config.json": other}
    )


def test_a_version_is_refused_past_the_catalogs_byte_limit_before_it_is_read(built):
    from contract.stores.control_registry import ControlRegistry

    bucket = bucket_with(built["pipeline"], "edges", built["controlnet"])
    small = SPEC.model_copy(update={"controls": SPEC.controls.model_copy(update={"max_bytes": 1000})})
    with pytest.raises(ControlFileError, match="exceeds the limit of 1000"):
        ControlRegistry(bucket).check(small, "edges", "controlnet", "1")
    assert not [name for name in bucket.reads if name.startswith("adapters/")]


# --- the worker's cache --------------------------------------------------------------------------


def loaded(built, host_cache_bytes: int, *names: str, bucket: FakeBucket | None = None):
    """The worker's loader over a bucket holding the tiny ControlNet as `edges` and the IP-Adapter as `style`; each
    of `names` loaded in turn (one request each)."""
    from contract.stores.control_registry import ControlRecord
    from model_worker.controls.loader import ControlLoader

    bucket = bucket or bucket_with(built["pipeline"], "edges", built["controlnet"])
    prefix = naming.control_prefix(SPEC.name, "style", "1")
    bucket.objects.update({prefix + file: data for file, data in built["ip_adapter"].items()})
    kinds = {"edges": "controlnet", "style": "ip_adapter"}
    loader = ControlLoader(bucket, {SPEC.queue: built["pipeline"]}, lambda: None, host_cache_bytes)
    loader.start()
    sets = []
    try:
        for name in names:
            files = built[kinds[name]]
            record = ControlRecord(name=name, kind=kinds[name], version="1", sha256=digest(files),
                                   bytes=sum(map(len, files.values())), tensors=0)  # fmt: skip
            sets.append(loader.request(SPEC, (record,)))
            assert sets[-1].done.wait(60)
    finally:
        loader.stop()
    return loader, sets


def test_the_worker_builds_diffusers_models_off_the_device_thread_within_its_byte_budget(built):
    from diffusers import ControlNetModel
    from transformers import CLIPVisionModelWithProjection

    both = sum(map(len, built["controlnet"].values())) + sum(map(len, built["ip_adapter"].values()))
    loader, (edges, style, again) = loaded(built, both, "edges", "style", "edges")
    assert isinstance(edges.weights()[0].model, ControlNetModel)
    assert isinstance(style.weights()[0].model, CLIPVisionModelWithProjection)
    assert set(style.weights()[0].state_dict) == {"image_proj", "ip_adapter"}
    assert again.weights()[0] is edges.weights()[0] and loader.loads == 2  # the second request read nothing
    assert loader.cached_bytes == both
    # A budget of one: the least recently used goes, the request still gets its model.
    loader, (edges, style) = loaded(built, both - 1, "edges", "style")
    assert [name for name, _, _ in loader.cached(SPEC)] == ["style"] and edges.weights()


def test_a_file_changed_after_registration_fails_its_request_alone(built):
    weights = "diffusion_pytorch_model.safetensors"
    bucket = bucket_with(built["pipeline"], "edges", built["controlnet"])
    prefix = naming.control_prefix(SPEC.name, "edges", "1")
    bucket.objects[prefix + weights] = retensored(built["controlnet"][weights], lambda t: t | {
        "controlnet_mid_block.weight": t["controlnet_mid_block.weight"] + 1})  # fmt: skip
    _, (edges, style) = loaded(built, 10**9, "edges", "style", bucket=bucket)
    with pytest.raises(ValueError, match="edges@1: the files changed since they were registered"):
        edges.weights()
    assert style.weights()


# --- a request's controls, resolved by the API ------------------------------------------------------------------


def png(size: int = 16, color=(200, 30, 30)) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_requests_controls_resolve_to_registered_versions_and_each_bad_input_is_a_422_naming_its_field(built):
    from api_server.core.errors import ApiError
    from api_server.predict.controls import ControlService
    from contract.generation import ControlIn
    from contract.stores.control_registry import ControlRegistry

    bucket = bucket_with(built["pipeline"], "edges", built["controlnet"])
    bucket.objects.update({naming.control_prefix(SPEC.name, "style", "1") + file: data
                           for file, data in built["ip_adapter"].items()})  # fmt: skip
    registry = ControlRegistry(bucket)
    registry.register(SPEC, "edges", "controlnet", "1")
    registry.register(SPEC, "style", "ip_adapter", "1")
    service = ControlService(registry)
    refs, images = service.resolve(SPEC, [ControlIn(name="edges", image=png(), scale=0.5, start=0.1, end=0.9,
                                                    preprocess="canny")])  # fmt: skip
    assert (refs[0].name, refs[0].version, refs[0].sha256) == ("edges", "1", digest(built["controlnet"]))
    assert (refs[0].scale, refs[0].start, refs[0].end, refs[0].preprocess) == (0.5, 0.1, 0.9, "canny")
    assert len(images) == 1 and refs[0].image_sha256

    def field_of(spec, *controls: dict) -> str:
        with pytest.raises(ApiError) as refused:
            service.resolve(spec, [ControlIn(**{"name": "edges", "image": png(), **c}) for c in controls])
        assert refused.value.status == 422
        return refused.value.field

    assert field_of(SPEC, {"name": "unknown"}) == "parameters.controls.0.name"
    assert field_of(SPEC, {"name": "style"}) == "parameters.controls.0.name"  # an IP-Adapter, not a ControlNet
    assert field_of(SPEC, {}, {}) == "parameters.controls.1.name"  # named twice
    assert field_of(SPEC, {}, {}, {}) == "parameters.controls"  # more than the catalog allows
    assert field_of(SPEC, {"scale": 2.5}) == "parameters.controls.0.scale"
    assert field_of(SPEC, {"start": 0.8, "end": 0.2}) == "parameters.controls.0.start"
    assert field_of(SPEC, {"image": "bm90IGFuIGltYWdl"}) == "parameters.controls.0.image"  # "not an image"
    assert field_of(SPEC, {"image": png(4096)}) == "parameters.controls.0.image"  # past the pixel limit
    other = local_catalog().get("z-image-turbo")  # a family that serves none
    assert field_of(other, {}) == "parameters.controls"


def test_a_requests_image_prompts_resolve_to_ip_adapters_and_each_bad_input_is_a_422_naming_its_field(built):
    from api_server.core.errors import ApiError
    from api_server.predict.controls import ControlService
    from contract.generation import ImagePromptIn
    from contract.stores.control_registry import ControlRegistry

    bucket = bucket_with(built["pipeline"], "edges", built["controlnet"])
    bucket.objects.update({naming.control_prefix(SPEC.name, "style", "1") + file: data
                           for file, data in built["ip_adapter"].items()})  # fmt: skip
    registry = ControlRegistry(bucket)
    registry.register(SPEC, "edges", "controlnet", "1")
    registry.register(SPEC, "style", "ip_adapter", "1")
    service = ControlService(registry)
    refs, images = service.resolve_image_prompts(SPEC, [ImagePromptIn(name="style", image=png(), scale=0.6)], 0)
    assert (refs[0].name, refs[0].kind, refs[0].version) == ("style", "ip_adapter", "1")
    assert (refs[0].sha256, refs[0].scale) == (digest(built["ip_adapter"]), 0.6)
    assert len(images) == 1 and refs[0].image_sha256  # the image's digest: in the cache key with the parameters

    def field_of(spec, *prompts: dict, controls: int = 0) -> str:
        with pytest.raises(ApiError) as refused:
            service.resolve_image_prompts(spec, [ImagePromptIn(**{"name": "style", "image": png(), **p})
                                                 for p in prompts], controls)  # fmt: skip
        assert refused.value.status == 422
        return refused.value.field

    assert field_of(SPEC, {"name": "unknown"}) == "parameters.image_prompts.0.name"
    assert field_of(SPEC, {"name": "edges"}) == "parameters.image_prompts.0.name"  # a ControlNet, not an IP-Adapter
    two = SPEC.model_copy(update={"controls": SPEC.controls.model_copy(update={"max_image_prompts_per_request": 2})})
    assert field_of(two, {}, {}) == "parameters.image_prompts.1.name"  # named twice
    assert field_of(SPEC, {}, {"name": "other"}) == "parameters.image_prompts"  # past the catalog's image prompts
    assert field_of(SPEC, {}, controls=2) == "parameters.image_prompts"  # with the ControlNets, past the catalog's
    assert field_of(SPEC, {"scale": 2.5}) == "parameters.image_prompts.0.scale"
    assert field_of(SPEC, {"image": "bm90IGFuIGltYWdl"}) == "parameters.image_prompts.0.image"  # "not an image"
    assert field_of(local_catalog().get("sd35-txt2img"), {}) == "parameters.image_prompts"  # a family with none


def test_an_unknown_preprocessor_or_window_out_of_range_is_refused_by_the_request_schema():
    from pydantic import ValidationError

    from contract.generation import ControlIn

    for bad in ({"preprocess": "depth"}, {"start": -0.1}, {"end": 1.5}, {"low_threshold": 300}):
        with pytest.raises(ValidationError) as refused:
            ControlIn(**{"name": "edges", "image": png(), **bad})
        assert refused.value.errors()[0]["loc"][0] == next(iter(bad))


def test_canny_preprocessing_gives_white_edges_on_black():
    import base64

    import numpy as np

    from contract.generation import ControlRef
    from model_worker.controls.images import control_image

    ref = ControlRef(name="edges", kind="controlnet", version="1", sha256="0", scale=1.0, preprocess="canny")
    from PIL import Image

    square = Image.new("RGB", (32, 32))
    square.paste((255, 255, 255), (8, 8, 24, 24))
    import io

    buffer = io.BytesIO()
    square.save(buffer, format="PNG")
    edges = np.asarray(control_image(buffer.getvalue(), ref, 64 * 64))
    assert edges.shape == (32, 32, 3) and set(np.unique(edges)) == {0, 255}
    assert edges[16, 16].tolist() == [0, 0, 0] and edges[0, 0].tolist() == [0, 0, 0]  # inside and far off the square
    assert edges[6:10, 16].max() == 255 and edges[16, 6:10].max() == 255  # its border
    plain = np.asarray(control_image(base64.b64decode(png()), ref.model_copy(update={"preprocess": None}), 64 * 64))
    assert plain[0, 0].tolist() == [200, 30, 30]


def test_adapters_and_control_models_are_looked_up_alike_a_missing_one_a_422_an_unreadable_registry_a_503():
    from google.api_core import exceptions

    from api_server.core.errors import ApiError
    from api_server.predict.adapters import AdapterService
    from api_server.predict.controls import ControlService
    from contract.generation import AdapterIn, ImagePromptIn

    class Registry:
        def __init__(self, failing: bool) -> None:
            self.failing = failing

        def resolve(self, spec, name):
            if self.failing:
                raise exceptions.ServiceUnavailable("bucket down")
            return None

    def refusal(service, ask) -> ApiError:
        with pytest.raises(ApiError) as refused:
            ask(service)
        return refused.value

    def adapter(service):
        return service.resolve(SPEC, [AdapterIn(name="ink", scale=1.0)])

    def prompt(service):
        return service.resolve_image_prompts(SPEC, [ImagePromptIn(name="style", image=png())], 0)

    for service, ask, field, listing in ((AdapterService, adapter, "parameters.adapters.0.name", "adapters"),
                                         (ControlService, prompt, "parameters.image_prompts.0.name", "controls")):  # fmt: skip
        missing = refusal(service(Registry(failing=False)), ask)
        assert (missing.status, missing.field) == (422, field)
        assert f"is registered for sd15-txt2img; GET /v1/models/sd15-txt2img/{listing} lists them" in missing.message
        down = refusal(service(Registry(failing=True)), ask)
        assert down.status == 503 and down.message.startswith(f"{listing[:-1]} registry unavailable")
