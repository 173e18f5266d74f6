"""SDXL and FLUX.1 IP-Adapters (image prompts) chosen per request and batched across requests, against diffusers' own
`load_ip_adapter` + `set_ip_adapter_scale` on the family's pipeline, with tiny random-weight IP-Adapters and CLIP
image encoders built offline for each family's tiny denoiser (emulators/tiny_controls.py `build_ip_adapter`).

The SD 1.5 contract (tests/unit/test_controlnet_rows.py) for the other families: a request alone equals the pipeline
within 1/255 in both schedulings (and the image prompt visibly steers it: the oracle can tell); in a running set of two
scales and a request without any, each image equals the same request alone, and the request without an image prompt
is exactly the base model's image (the same running set with no image prompt anywhere)."""

from __future__ import annotations

import numpy as np
import pytest

from contract.generation import ControlRef
from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_controlnet_rows import STEPS, TOLERANCE, items_of, params, stepped
from tests.unit.test_model_families import differences, input_image

CATALOG = local_catalog(test_fixtures=True)
SIZE = 64  # test_controlnet_rows' `params` size
MODELS = ("sdxl-txt2img", "flux-schnell")


@pytest.fixture(scope="module", params=MODELS)
def styled(request, tmp_path_factory) -> dict:
    """A family's tiny pipeline, a tiny IP-Adapter of its denoiser loaded as the worker loads it (`loader._build`),
    the reference pipeline with the same IP-Adapter loaded by diffusers (`load_ip_adapter`: loading changes the
    denoiser's processors, so a pipeline of its own), a reference image and a stepping runner."""
    import diffusers

    from emulators.tiny_controls import build_ip_adapter, control_files
    from model_worker.controls.loader import ControlWeights, _build
    from model_worker.model.pipeline import DiffusionRunner

    name = request.param
    spec = CATALOG.get(name)
    root = tmp_path_factory.mktemp(name)
    directory, _ = tiny_pipelines(root, {name: spec})[name]
    folder = build_ip_adapter(directory, root / "style", 12)
    encoder, state_dict = _build("ip_adapter", control_files(folder))
    reference = getattr(diffusers, spec.pipeline).from_pretrained(directory)
    if spec.family.name == "flux":  # its image encoder by path, in the pipeline's dtype (its default: float16)
        reference.load_ip_adapter(str(folder), weight_name="ip_adapter.safetensors", image_encoder_dtype=reference.dtype,
                                  image_encoder_pretrained_model_name_or_path=str(folder / "image_encoder"))  # fmt: skip
    else:
        reference.load_ip_adapter(str(folder), subfolder="", weight_name="ip_adapter.safetensors")
    reference.set_progress_bar_config(disable=True)
    stepper = DiffusionRunner(spec.model_copy(update={"scheduling": "step"}), directory, torch_threads=1)
    return {"spec": spec, "directory": directory, "reference": reference, "stepper": stepper,
            "controls": {"style": ControlWeights("style", "ip_adapter", "1", "s" * 8, 0, encoder, state_dict)},
            "images": {"style": input_image(23)}}  # fmt: skip


def guidance_of(styled) -> float:
    return 1.0 if styled["spec"].guidance_mode == "none" else 5.0


def prompted(styled, seed: int, scale: float, images: int = 1):
    """Items whose requests carry the image prompt `style` at `scale`."""
    from model_worker.controls.loader import ControlSet
    from model_worker.model.runners import GenerationItem

    ref = ControlRef(name="style", kind="ip_adapter", version="1", sha256="s" * 8, scale=scale)
    loaded = ControlSet((ref,), loaded=[styled["controls"]["style"]])
    loaded.done.set()
    return [GenerationItem(prompt="a lighthouse", seed=seed + i, controls=loaded,
                           control_images=(styled["images"]["style"],)) for i in range(images)]  # fmt: skip


def reference(styled, seed: int, guidance: float, scale: float, images: int = 1) -> list:
    """diffusers' pipeline with the IP-Adapter loaded at `scale`, one call per image."""
    import torch

    pipe = styled["reference"]
    pipe.set_ip_adapter_scale(scale)
    extra = {"max_sequence_length": 256} if styled["spec"].family.name == "flux" else {}
    return [pipe(prompt="a lighthouse", ip_adapter_image=styled["images"]["style"], num_inference_steps=STEPS,
                 guidance_scale=guidance, width=SIZE, height=SIZE, generator=torch.Generator().manual_seed(seed + i),
                 output_type="np", **extra).images[0] for i in range(images)]  # fmt: skip


def test_an_image_prompt_alone_equals_the_familys_ip_adapter_pipeline_in_both_schedulings(styled):
    from model_worker.model.pipeline import DiffusionRunner

    guidance = guidance_of(styled)
    expected = reference(styled, 5, guidance, 0.7, images=2)
    (got,) = stepped(styled["stepper"], [(prompted(styled, 5, 0.7, images=2), guidance)])
    assert differences(got, expected) <= TOLERANCE
    (base,) = stepped(styled["stepper"], [(items_of(styled, 5, [], images=2), guidance)])
    assert differences(got, base) > 10  # the tiny IP-Adapter visibly steers the image: the oracle can tell
    batch = DiffusionRunner(styled["spec"].model_copy(update={"scheduling": "request"}), styled["directory"],
                            torch_threads=1)  # fmt: skip
    plain = batch.generate(items_of(styled, 12, []), params(guidance), lambda step, total: None)
    items = prompted(styled, 5, 0.7, images=2) + prompted(styled, 8, 1.3) + items_of(styled, 12, [])
    requested = batch.generate(items, params(guidance), lambda step, total: None)
    assert differences(requested[:2], expected) <= TOLERANCE
    assert differences(requested[2:3], reference(styled, 8, guidance, 1.3)) <= TOLERANCE
    # The image without an image prompt is exactly the base pipeline's (its processors restored).
    assert np.array_equal(np.asarray(requested[3]), np.asarray(plain[0]))


def test_a_mixed_running_set_of_two_scales_equals_each_alone_and_a_row_without_is_the_base_models(styled):
    stepper, guided = styled["stepper"], guidance_of(styled)
    mixed = [(prompted(styled, 3, 0.7), guided), (items_of(styled, 12, []), guided),
             (prompted(styled, 9, 1.4, images=2), 1.0)]  # fmt: skip
    got = stepped(stepper, mixed)
    assert differences(got[0], reference(styled, 3, guided, 0.7)) <= TOLERANCE
    alone = [stepped(stepper, [(prompted(styled, 3, 0.7), guided)])[0],
             stepped(stepper, [(prompted(styled, 9, 1.4, images=2), 1.0)])[0]]  # fmt: skip
    assert differences(got[0], alone[0]) <= TOLERANCE and differences(got[2], alone[1]) <= TOLERANCE
    assert differences(got[0], got[2][:1]) > 2  # the two scales (and seeds) are not one image
    # The same running set with no image prompt anywhere (the base processors): the request without one gets exactly
    # the same image, though its rows went through the IP-Adapter processors above.
    plain = [(items_of(styled, items[0].seed, [], images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(stepper, plain)[1][0], got[1][0])


def test_an_sdxl_ip_adapter_registers_for_sdxl_and_is_refused_for_sd15_by_its_shapes(tmp_path):
    """Registration's checks against the base UNet (contract/control_files.py): the tiny SDXL IP-Adapter registers for
    the SDXL model; against an SD 1.5 UNet its image projection and key/value pairs are the wrong shapes."""
    import json

    import torch

    from contract import naming
    from contract.control_files import ControlFileError, check_control, digest
    from contract.lora_files import bytes_reader, read_header
    from contract.stores.control_registry import ControlRegistry
    from emulators.tiny_controls import build_ip_adapter, control_files
    from emulators.tiny_pipeline import _sdxl_unet, sd15_unet
    from tests.unit.test_adapter_parts import FakeBucket

    torch.manual_seed(0)
    _sdxl_unet(projection_class_embeddings_input_dim=80, cross_attention_dim=64).save_pretrained(
        tmp_path / "sdxl" / "unet", safe_serialization=True
    )
    sd15_unet().save_pretrained(tmp_path / "sd15" / "unet", safe_serialization=True)
    files = control_files(build_ip_adapter(tmp_path / "sdxl", tmp_path / "style", 12))
    spec = CATALOG.get("sdxl-txt2img")
    objects = {
        f"{spec.weights_path}/unet/{path.name}": path.read_bytes() for path in (tmp_path / "sdxl" / "unet").iterdir()
    }
    objects.update({naming.control_prefix(spec.name, "style", "1") + file: data for file, data in files.items()})
    record = ControlRegistry(FakeBucket(objects)).register(spec, "style", "ip_adapter", "1")
    assert (record.kind, record.sha256) == ("ip_adapter", digest(files))
    data = (tmp_path / "sd15" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    sd15 = (
        json.loads((tmp_path / "sd15" / "unet" / "config.json").read_text()),
        read_header(bytes_reader(data), len(data)),
    )
    with pytest.raises(ControlFileError, match=r"image_proj.proj.weight has 256 rows; four image tokens of the base "
                                               r"UNet's cross_attention_dim 32 need 128"):  # fmt: skip
        check_control("ip_adapter", files, *sd15)


def test_a_flux_ip_adapter_registers_for_flux_and_is_refused_for_sdxl_and_the_other_way_round(tmp_path):
    """A FLUX.1 IP-Adapter (XLabs' layout: a key/value pair with biases per double block) is checked against the base
    transformer's config (FLUX.1's weights are sharded): it registers for flux-schnell; it and the SDXL one are each
    refused for the other's base by the image projection's shape, and one for a transformer of more double blocks."""
    import json

    import torch
    from diffusers import FluxTransformer2DModel

    from contract import naming
    from contract.control_files import ControlFileError, check_control, digest
    from contract.lora_files import bytes_reader, read_header
    from contract.stores.control_registry import ControlRegistry
    from emulators.tiny_controls import build_ip_adapter, control_files
    from emulators.tiny_pipeline import _sdxl_unet
    from tests.unit.test_adapter_parts import FakeBucket

    torch.manual_seed(0)
    _sdxl_unet(projection_class_embeddings_input_dim=80, cross_attention_dim=64).save_pretrained(
        tmp_path / "sdxl" / "unet", safe_serialization=True
    )
    flux = tmp_path / "flux"  # the tiny FLUX.1 pipeline's transformer (emulators/tiny_pipeline.py `_flux`)
    FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).save_pretrained(flux / "transformer", safe_serialization=True)  # fmt: skip
    files = {name: control_files(build_ip_adapter(tmp_path / name, tmp_path / f"{name}-style", 12))
             for name in ("sdxl", "flux")}  # fmt: skip
    spec = CATALOG.get("flux-schnell")
    objects = {
        f"{spec.weights_path}/transformer/{path.name}": path.read_bytes() for path in (flux / "transformer").iterdir()
    }
    objects.update(
        {naming.control_prefix(spec.name, "style", "1") + file: data for file, data in files["flux"].items()}
    )
    record = ControlRegistry(FakeBucket(objects)).register(spec, "style", "ip_adapter", "1")
    assert (record.kind, record.sha256) == ("ip_adapter", digest(files["flux"]))
    flux_config = json.loads((flux / "transformer" / "config.json").read_text())
    data = (tmp_path / "sdxl" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    sdxl = (
        json.loads((tmp_path / "sdxl" / "unet" / "config.json").read_text()),
        read_header(bytes_reader(data), len(data)),
    )
    with pytest.raises(ControlFileError, match=r"has 256 rows; 4 image tokens of the base transformer's "
                                               r"joint_attention_dim 32 need 128"):  # fmt: skip
        check_control("ip_adapter", files["sdxl"], flux_config, {})
    with pytest.raises(ControlFileError, match=r"has 128 rows; four image tokens of the base UNet's "
                                               r"cross_attention_dim 64 need 256"):  # fmt: skip
        check_control("ip_adapter", files["flux"], *sdxl)
    with pytest.raises(
        ControlFileError, match=r"ip_adapter.1.to_k_ip.weight is missing; the base transformer's double"
    ):
        check_control("ip_adapter", files["flux"], {**flux_config, "num_layers": 2}, {})


def test_a_compiled_model_refuses_at_registration_an_ip_adapter_that_does_not_fit_its_ip_adapter_slots(tmp_path):
    """flux-schnell (the local catalog's) is compiled with IP-Adapter slots of the tiny IP-Adapter's shape (32-wide
    image embeddings, four tokens): an IP-Adapter of 48-wide ones, sound for its transformer (an eager copy of the
    model registers it), is refused with the slots' shape; and the catalog refuses a compiled model that takes image
    prompts without naming its slots' shape."""
    from diffusers import FluxTransformer2DModel

    from contract import naming
    from contract.control_files import ControlFileError
    from contract.model_spec import ModelSpec
    from contract.stores.control_registry import ControlRegistry
    from emulators.tiny_controls import build_ip_adapter, control_files
    from tests.unit.test_adapter_parts import FakeBucket

    FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).save_pretrained(tmp_path / "flux" / "transformer", safe_serialization=True)  # fmt: skip
    spec = CATALOG.get("flux-schnell")
    objects = {f"{spec.weights_path}/transformer/{path.name}": path.read_bytes()
               for path in (tmp_path / "flux" / "transformer").iterdir()}  # fmt: skip
    files = control_files(build_ip_adapter(tmp_path / "flux", tmp_path / "wide", 12, embedding_width=48))
    objects.update({naming.control_prefix(spec.name, "wide", "1") + file: data for file, data in files.items()})
    registry = ControlRegistry(FakeBucket(objects))
    with pytest.raises(ControlFileError, match=r"the IP-Adapter takes 48-wide image embeddings to 4 image tokens; "
                                               r"flux-schnell is compiled with IP-Adapter slots of 32-wide embeddings "
                                               r"and 4 tokens \(controls.image_prompt_slots\)"):  # fmt: skip
        registry.register(spec, "wide", "ip_adapter", "1")
    assert registry.check(spec.model_copy(update={"compile": None}), "wide", "ip_adapter", "1").kind == "ip_adapter"
    unslotted = spec.model_dump()
    unslotted["controls"]["image_prompt_slots"] = None
    with pytest.raises(ValueError, match=r"flux-schnell: a compiled model that takes image prompts is built with "
                                         r"IP-Adapter slots of one shape; set controls.image_prompt_slots"):  # fmt: skip
        ModelSpec.model_validate(unslotted)


def test_an_image_prompt_with_a_controlnet_equals_the_controlnet_pipeline_and_mixes_with_either_alone(styled):
    """A request with a ControlNet and an image prompt equals diffusers' ControlNet pipeline for the family with the
    IP-Adapter loaded, in both schedulings; in a running set beside a request with the ControlNet alone and one with
    the image prompt alone, each image equals its request alone."""
    import diffusers
    import torch

    from emulators.tiny_controls import build_controlnet, control_files
    from model_worker.controls.loader import ControlSet, ControlWeights, _build
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    if "edges" not in styled["controls"]:
        folder = build_controlnet(styled["directory"], styled["directory"].parent / "edges", 1)
        model, _ = _build("controlnet", control_files(folder))
        styled["controls"]["edges"] = ControlWeights("edges", "controlnet", "1", "e" * 8, 0, model)
        styled["images"]["edges"] = input_image(21)
    edges = ControlRef(name="edges", kind="controlnet", version="1", sha256="e" * 8, scale=0.8)
    style = ControlRef(name="style", kind="ip_adapter", version="1", sha256="s" * 8, scale=0.7)

    def items(seed: int, refs: tuple) -> list:
        loaded = ControlSet(refs, loaded=[styled["controls"][ref.name] for ref in refs])
        loaded.done.set()
        return [GenerationItem(prompt="a lighthouse", seed=seed, controls=loaded,
                               control_images=tuple(styled["images"][ref.name] for ref in refs))]  # fmt: skip

    guidance, flux = guidance_of(styled), styled["spec"].family.name == "flux"
    base = styled["reference"]
    if flux:
        pipe = diffusers.FluxControlNetPipeline(**base.components, controlnet=styled["controls"]["edges"].model)
        extra = {"control_image": styled["images"]["edges"], "max_sequence_length": 256}
    else:
        pipe = diffusers.StableDiffusionXLControlNetPipeline(**base.components, add_watermarker=False,
                                                             controlnet=styled["controls"]["edges"].model)  # fmt: skip
        extra = {"image": styled["images"]["edges"]}
    pipe.set_progress_bar_config(disable=True)
    pipe.set_ip_adapter_scale(0.7)
    expected = pipe(prompt="a lighthouse", ip_adapter_image=styled["images"]["style"], num_inference_steps=STEPS,
                    guidance_scale=guidance, width=SIZE, height=SIZE, generator=torch.Generator().manual_seed(4),
                    controlnet_conditioning_scale=0.8, output_type="np", **extra).images  # fmt: skip
    stepper = styled["stepper"]
    got = stepped(stepper, [(items(4, (edges, style)), guidance), (items(6, (edges,)), guidance),
                            (items(8, (style,)), guidance)])  # fmt: skip
    assert differences(got[0], list(expected)) <= TOLERANCE
    for seed, refs, images in ((6, (edges,), got[1]), (8, (style,), got[2])):
        assert differences(images, stepped(stepper, [(items(seed, refs), guidance)])[0]) <= TOLERANCE
    batch = DiffusionRunner(styled["spec"].model_copy(update={"scheduling": "request"}), styled["directory"],
                            torch_threads=1)  # fmt: skip
    requested = batch.generate(items(4, (edges, style)), params(guidance), lambda step, total: None)
    assert differences(requested, list(expected)) <= TOLERANCE


def test_ip_adapter_slots_serve_a_mixed_running_set_as_diffusers_pipeline_and_the_base_model(styled):
    """The IP-Adapter slots a compiled model is built with (made here without compiling; tests/unit/test_controlnet_rows.py
    and test_controlnet_families.py compile them): one slot of the tiny IP-Adapter's shape serves a running set of two
    scales, guided and unguided, and a request without an image prompt; each image prompt equals the family's
    `load_ip_adapter` pipeline, the request without one is exactly the base model's (the SDXL UNet's image embeddings
    beside its pooled ones in `added_cond_kwargs`; FLUX.1's per-row scales on the processors)."""
    from contract.model_spec import ImagePromptSlots
    from model_worker.model.pipeline import DiffusionRunner

    spec, guidance = styled["spec"], guidance_of(styled)
    controls = spec.controls.model_copy(update={"image_prompt_slots": ImagePromptSlots(embedding_width=32)})
    slotted = DiffusionRunner(spec.model_copy(update={"scheduling": "step", "controls": controls}), styled["directory"],
                              torch_threads=1)  # fmt: skip
    slotted._denoiser.make_slots()
    mixed = [(prompted(styled, 3, 0.7), guidance), (items_of(styled, 12, []), guidance),
             (prompted(styled, 9, 1.4, images=2), 1.0)]  # fmt: skip
    got = stepped(slotted, mixed)
    assert differences(got[0], reference(styled, 3, guidance, 0.7)) <= TOLERANCE
    assert differences(got[2], reference(styled, 9, 1.0, 1.4, images=2)) <= TOLERANCE
    plain = [(items_of(styled, items[0].seed, [], images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(slotted, plain)[1][0], got[1][0])
