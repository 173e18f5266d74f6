"""SDXL and FLUX.1 ControlNets chosen per request and batched across requests, against diffusers' own ControlNet
pipelines (`StableDiffusionXLControlNetPipeline`, `FluxControlNetPipeline`; several ControlNets: their multi models)
on tiny random-weight ControlNets built offline from each family's tiny denoiser (emulators/tiny_controls.py).

The SD 1.5 contract (tests/unit/test_controlnet_rows.py) for the other families: a request alone equals the pipeline
within 1/255 in both schedulings (and the ControlNet visibly steers it: the oracle can tell); in a running set mixing
two ControlNets at two scales and windows with a request without any, each image equals the same request alone, and
the request without control is exactly the base model's image (the same running set with no control anywhere)."""

from __future__ import annotations

import numpy as np
import pytest

from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_controlnet_rows import STEPS, TOLERANCE, items_of, params, stepped
from tests.unit.test_model_families import differences, input_image

CATALOG = local_catalog(test_fixtures=True)
SIZE = 64  # test_controlnet_rows' `params` size
MODELS = ("sdxl-txt2img", "flux-schnell", "sd35-txt2img")
EDGES = [("edges", 0.8, 0.0, 1.0)]
MULTI = [("edges", 0.7, 0.0, 0.5), ("depth", 1.3, 0.25, 1.0)]


@pytest.fixture(scope="module", params=MODELS)
def family(request, tmp_path_factory) -> dict:
    """A family's tiny pipeline (the reference), two tiny ControlNets of its denoiser loaded as the worker loads them
    (`loader._build`), two control images, and a stepping runner."""
    from emulators.tiny_controls import build_controlnet, control_files
    from model_worker.controls.loader import ControlWeights, _build
    from model_worker.model.pipeline import DiffusionRunner

    name = request.param
    spec = CATALOG.get(name)
    root = tmp_path_factory.mktemp(name)
    directory, reference = tiny_pipelines(root, {name: spec})[name]
    if spec.family.name == "sd3":
        reference = two_block_sd3(directory)
    controls = {}
    for control, seed in (("edges", 1), ("depth", 2)):
        model, _ = _build("controlnet", control_files(build_controlnet(directory, root / control, seed)))
        controls[control] = ControlWeights(control, "controlnet", "1", control * 8, 0, model)
    stepper = DiffusionRunner(spec.model_copy(update={"scheduling": "step"}), directory, torch_threads=1)
    return {"name": name, "spec": spec, "directory": directory, "reference": reference, "controls": controls,
            "images": {"edges": input_image(21), "depth": input_image(22)}, "stepper": stepper}  # fmt: skip


def two_block_sd3(directory):
    """The tiny SD 3.5 pipeline with a transformer of two joint blocks, and diffusers' pipeline loaded from it: the
    transformer adds ControlNet residuals to every block but its last (`context_pre_only`), so the tiny one-block
    transformer would take none."""
    import diffusers
    import torch

    transformer = diffusers.SD3Transformer2DModel.from_pretrained(directory / "transformer")
    config = {key: value for key, value in transformer.config.items() if not key.startswith("_")}
    torch.manual_seed(7)
    diffusers.SD3Transformer2DModel.from_config({**config, "num_layers": 2}).save_pretrained(
        directory / "transformer", safe_serialization=True
    )
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def guidance_of(family) -> float:
    """A guided request's guidance (FLUX.1 [schnell] takes none)."""
    return 1.0 if family["spec"].guidance_mode == "none" else 5.0


def reference(family, seed: int, guidance: float, uses, images: int = 1) -> list:
    """diffusers' own ControlNet pipeline for the family (a multi-ControlNet model for several), one call per image."""
    import diffusers
    import torch

    from model_worker.controls.controlnets import control_noise_seed

    models = [family["controls"][name].model for name, *_ in uses]
    single = len(models) == 1
    base = family["reference"]
    sd3 = family["spec"].family.name == "sd3"
    if sd3:  # its control latents sampled from torch's generator: seeded as the worker seeds an image's
        pipe = diffusers.StableDiffusion3ControlNetPipeline(**base.components, controlnet=models[0] if single
                                                            else models)  # fmt: skip
        image_argument, kwargs_extra = "control_image", {}
    elif family["spec"].family.name == "sdxl":
        pipe = diffusers.StableDiffusionXLControlNetPipeline(**base.components, controlnet=models[0] if single
                                                             else models, add_watermarker=False)  # fmt: skip
        image_argument, kwargs_extra = "image", {}
    else:  # FLUX.1: the control image as `control_image`, the T5 prompt length the worker uses ([schnell]'s 256)
        multi = models[0] if single else diffusers.FluxMultiControlNetModel(models)
        pipe = diffusers.FluxControlNetPipeline(**base.components, controlnet=multi)
        image_argument = "control_image"
        kwargs_extra = {"max_sequence_length": 256}
    pipe.set_progress_bar_config(disable=True)
    kwargs = {
        image_argument: family["images"][uses[0][0]] if single else [family["images"][name] for name, *_ in uses],
        "controlnet_conditioning_scale": uses[0][1] if single else [scale for _, scale, _, _ in uses],
        "control_guidance_start": uses[0][2] if single else [start for _, _, start, _ in uses],
        "control_guidance_end": uses[0][3] if single else [end for _, _, _, end in uses],
        **kwargs_extra,
    }
    images_out = []
    for i in range(images):
        if sd3:
            torch.manual_seed(control_noise_seed(seed + i))
        images_out.append(pipe(prompt="a lighthouse", num_inference_steps=STEPS, guidance_scale=guidance, width=SIZE,
                               height=SIZE, generator=torch.Generator().manual_seed(seed + i), output_type="np",
                               **kwargs).images[0])  # fmt: skip
    return images_out


def test_a_controlnet_request_alone_equals_the_familys_controlnet_pipeline_in_both_schedulings(family):
    from model_worker.model.pipeline import DiffusionRunner

    guidance = guidance_of(family)
    expected = reference(family, 5, guidance, EDGES, images=2)
    (got,) = stepped(family["stepper"], [(items_of(family, 5, EDGES, images=2), guidance)])
    assert differences(got, expected) <= TOLERANCE
    (base,) = stepped(family["stepper"], [(items_of(family, 5, [], images=2), guidance)])
    assert differences(got, base) > 10  # the tiny ControlNet visibly steers the image: the oracle can tell
    batch = DiffusionRunner(family["spec"].model_copy(update={"scheduling": "request"}), family["directory"],
                            torch_threads=1)  # fmt: skip
    items = items_of(family, 5, EDGES, images=2) + items_of(family, 8, MULTI) + items_of(family, 12, [])
    requested = batch.generate(items, params(guidance), lambda step, total: None)
    assert differences(requested[:2], expected) <= TOLERANCE
    assert differences(requested[2:3], reference(family, 8, guidance, MULTI)) <= TOLERANCE
    assert differences(requested[3:], stepped(family["stepper"], [(items_of(family, 12, []), guidance)])[0]) <= 1


def test_a_mixed_running_set_equals_each_request_alone_and_a_row_without_control_is_the_base_models(family):
    stepper, guided = family["stepper"], guidance_of(family)
    depth = [("depth", 1.2, 0.0, 1.0)]
    mixed = [(items_of(family, 3, EDGES), guided), (items_of(family, 9, depth, images=2), 1.0),
             (items_of(family, 4, MULTI), guided), (items_of(family, 12, []), guided)]  # fmt: skip
    got = stepped(stepper, mixed)
    assert differences(got[2], reference(family, 4, guided, MULTI)) <= TOLERANCE
    for (items, guidance), images in zip(mixed, got, strict=True):
        uses = [(r.name, r.scale, r.start, r.end) for r in items[0].controls.refs] if items[0].controls else []
        (alone,) = stepped(stepper, [(items_of(family, items[0].seed, uses, images=len(items)), guidance)])
        assert differences(images, alone) <= TOLERANCE
    plain = [(items_of(family, items[0].seed, [], images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(stepper, plain)[3][0], got[3][0])


def test_each_familys_controlnet_registers_for_its_base_and_is_refused_for_the_others(tmp_path):
    """Registration's checks against the base's own denoiser (contract/control_files.py): an SDXL ControlNet
    (`ControlNetModel.from_unet` on the tiny SDXL UNet) registers for the SDXL model, a FLUX.1 one
    (`FluxControlNetModel.from_transformer`) for FLUX.1 [schnell] and an SD 3.5 one (`SD3ControlNetModel`) for SD 3.5
    (against their transformers' configs: their weights are sharded); each is refused for the other bases, an SD 1.5
    ControlNet for them all, naming why."""
    import json

    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from contract import naming
    from contract.control_files import ControlFileError, check_control, digest
    from contract.lora_files import bytes_reader, read_header
    from contract.stores.control_registry import ControlRegistry
    from emulators.tiny_controls import build_controlnet, control_files
    from emulators.tiny_pipeline import _sdxl_unet, sd15_unet
    from tests.unit.test_adapter_parts import FakeBucket

    torch.manual_seed(0)
    _sdxl_unet(projection_class_embeddings_input_dim=80, cross_attention_dim=64).save_pretrained(
        tmp_path / "sdxl" / "unet", safe_serialization=True
    )
    sd15_unet().save_pretrained(tmp_path / "sd15" / "unet", safe_serialization=True)
    flux = tmp_path / "flux"  # the tiny FLUX.1 pipeline's transformer (emulators/tiny_pipeline.py `_flux`)
    FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).save_pretrained(flux / "transformer", safe_serialization=True)  # fmt: skip
    sd3 = tmp_path / "sd3"  # the tiny SD 3.5 pipeline's transformer (emulators/tiny_pipeline.py `_sd3`)
    SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=64,
    ).save_pretrained(sd3 / "transformer", safe_serialization=True)  # fmt: skip
    bases = {"sd15": tmp_path / "sd15", "sdxl": tmp_path / "sdxl", "flux": flux, "sd3": sd3}
    files = {name: control_files(build_controlnet(base, tmp_path / f"{name}-edges", seed=3))
             for name, base in bases.items()}  # fmt: skip

    def base_of(name: str) -> tuple[dict, dict]:
        if name in ("flux", "sd3"):
            return json.loads((bases[name] / "transformer" / "config.json").read_text()), {}
        data = (bases[name] / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
        return json.loads((bases[name] / "unet" / "config.json").read_text()), read_header(bytes_reader(data),
                                                                                           len(data))  # fmt: skip

    for name, model, denoiser in (("sdxl", "sdxl-txt2img", "unet"), ("flux", "flux-schnell", "transformer"),
                                  ("sd3", "sd35-txt2img", "transformer")):  # fmt: skip
        spec = CATALOG.get(model)
        objects = {f"{spec.weights_path}/{path.relative_to(bases[name]).as_posix()}": path.read_bytes()
                   for path in (bases[name] / denoiser).iterdir()}  # fmt: skip
        objects.update({naming.control_prefix(spec.name, "edges", "1") + file: data
                        for file, data in files[name].items()})  # fmt: skip
        record = ControlRegistry(FakeBucket(objects)).register(spec, "edges", "controlnet", "1")
        assert (record.kind, record.sha256) == ("controlnet", digest(files[name]))
    refusals = {("sdxl", "sd15"): "does not match the base UNet's", ("sd15", "sdxl"): "does not match the base UNet's",
                ("flux", "sd15"): "is not ControlNetModel", ("sd15", "flux"): "is not FluxControlNetModel",
                ("flux", "sdxl"): "is not ControlNetModel", ("sdxl", "flux"): "is not FluxControlNetModel",
                ("sd3", "sd15"): "is not ControlNetModel", ("sd15", "sd3"): "is not SD3ControlNetModel",
                ("sd3", "flux"): "is not FluxControlNetModel",
                ("flux", "sd3"): "is not SD3ControlNetModel"}  # fmt: skip
    for (control, base), reason in refusals.items():
        with pytest.raises(ControlFileError, match=reason):
            check_control("controlnet", files[control], *base_of(base))
    # A FLUX.1 ControlNet of another transformer width: its config says so.
    config = json.loads(files["flux"]["config.json"])
    other = {**files["flux"], "config.json": json.dumps({**config, "num_attention_heads": 4}).encode()}
    with pytest.raises(ControlFileError, match="num_attention_heads 4 does not match the base transformer's 2"):
        check_control("controlnet", other, *base_of("flux"))
    # An SD 3.5 ControlNet of another width, or one whose per-block projections are not the transformer's width.
    config = json.loads(files["sd3"]["config.json"])
    other = {**files["sd3"], "config.json": json.dumps({**config, "num_attention_heads": 8}).encode()}
    with pytest.raises(ControlFileError, match="num_attention_heads 8 does not match the base transformer's 4"):
        check_control("controlnet", other, *base_of("sd3"))
    narrow = {**base_of("sd3")[0], "attention_head_dim": 4}
    claims = {**files["sd3"], "config.json": json.dumps({**config, "attention_head_dim": 4}).encode()}
    with pytest.raises(ControlFileError, match="pos_embed_input.proj.weight is 32x4x2x2, the base transformer needs"):
        check_control("controlnet", claims, narrow, {})


# ControlNet Union: one model, a control mode per request (SDXL's ControlNetUnionModel; FLUX.1's FluxControlNetModel
# with `num_mode`), tiny random-weight ones (emulators/tiny_controls.py `build_union_controlnet`).


@pytest.fixture(scope="module")
def union(family, tmp_path_factory):
    if family["spec"].family.name == "sd3":
        pytest.skip("SD 3.5 has no ControlNet Union")
    from emulators.tiny_controls import build_union_controlnet, control_files
    from model_worker.controls.loader import ControlWeights, _build

    folder = build_union_controlnet(family["directory"], tmp_path_factory.mktemp("union") / "union", 4)
    model, _ = _build("controlnet", control_files(folder))
    return ControlWeights("union", "controlnet", "1", "u" * 8, 0, model)


def union_items(family, union, seed: int, mode: int, scale: float = 0.9, images: int = 1) -> list:
    from contract.generation import ControlRef
    from model_worker.controls.loader import ControlSet
    from model_worker.model.runners import GenerationItem

    ref = ControlRef(name="union", kind="controlnet", version="1", sha256="u" * 8, scale=scale, mode=mode)
    controls = ControlSet((ref,), loaded=[union])
    controls.done.set()
    return [GenerationItem(prompt="a lighthouse", seed=seed + i, controls=controls,
                           control_images=(family["images"]["edges"],)) for i in range(images)]  # fmt: skip


def union_reference(family, union, seed: int, guidance: float, mode: int, scale: float = 0.9, images: int = 1):
    """diffusers' Union pipeline for the family (SDXL's own; FLUX.1's ControlNet pipeline with `control_mode`)."""
    import diffusers
    import torch

    base, image = family["reference"], family["images"]["edges"]
    if family["spec"].family.name == "sdxl":
        pipe = diffusers.StableDiffusionXLControlNetUnionPipeline(**base.components, controlnet=union.model,
                                                                  add_watermarker=False)  # fmt: skip
        kwargs = {"control_image": [image], "control_mode": [mode]}
    else:
        pipe = diffusers.FluxControlNetPipeline(**base.components, controlnet=union.model)
        kwargs = {"control_image": image, "control_mode": mode, "max_sequence_length": 256}
    pipe.set_progress_bar_config(disable=True)
    return [pipe(prompt="a lighthouse", num_inference_steps=STEPS, guidance_scale=guidance, width=SIZE, height=SIZE,
                 generator=torch.Generator().manual_seed(seed + i), controlnet_conditioning_scale=scale,
                 output_type="np", **kwargs).images[0] for i in range(images)]  # fmt: skip


def test_a_union_request_equals_the_union_pipeline_and_modes_mix_in_one_call(family, union):
    from model_worker.model.pipeline import DiffusionRunner

    stepper, guidance = family["stepper"], guidance_of(family)
    expected = {mode: union_reference(family, union, 5, guidance, mode) for mode in (1, 3)}
    # The mode matters (SDXL's tiny Union: 20/255; FLUX.1's only 0.4/255, its mode one token beside 256 text tokens in
    # a tiny random attention): each image below is ten times closer to its own mode's than the two modes are apart.
    apart = differences(expected[1], expected[3])
    assert apart > 0.1
    (alone,) = stepped(stepper, [(union_items(family, union, 5, 1), guidance)])
    assert differences(alone, expected[1]) <= min(TOLERANCE, apart / 10)
    batch = DiffusionRunner(family["spec"].model_copy(update={"scheduling": "request"}), family["directory"],
                            torch_threads=1)  # fmt: skip
    requested = batch.generate(union_items(family, union, 5, 1) + union_items(family, union, 5, 3), params(guidance),
                               lambda step, total: None)  # fmt: skip
    assert differences(requested, expected[1] + expected[3]) <= min(TOLERANCE, apart / 10)
    # Two modes, a plain ControlNet and none in one running set: each image its request's alone.
    mixed = [(union_items(family, union, 5, 1), guidance), (union_items(family, union, 5, 3), guidance),
             (items_of(family, 9, EDGES), guidance), (items_of(family, 12, []), guidance)]  # fmt: skip
    got = stepped(stepper, mixed)
    assert max(differences(got[0], expected[1]), differences(got[1], expected[3])) <= min(TOLERANCE, apart / 10)
    assert differences(got[2], stepped(stepper, [(items_of(family, 9, EDGES), guidance)])[0]) <= TOLERANCE
    plain = [(items_of(family, seed, []), guidance) for seed in (5, 5, 9, 12)]  # the same set without control
    assert np.array_equal(got[3][0], stepped(stepper, plain)[3][0])


def test_a_union_registers_with_its_modes_and_a_requests_mode_is_checked_against_them(family, tmp_path):
    """Registration accepts a Union for its base (SDXL's ControlNetUnionModel, FLUX.1's FluxControlNetModel with
    `num_mode`) and records how many modes it has; a request's `mode` is then a 422 naming it when the ControlNet is
    not a Union, when a Union gets none, or when the mode is not one of its own."""
    if family["spec"].family.name == "sd3":
        pytest.skip("SD 3.5 has no ControlNet Union")
    import json

    from api_server.core.errors import ApiError
    from api_server.predict.controls import check_mode
    from contract.control_files import base_denoiser_files, check_control, union_modes
    from contract.generation import ControlIn
    from contract.lora_files import bytes_reader, read_header
    from contract.stores.control_registry import ControlRecord
    from emulators.tiny_controls import build_union_controlnet, control_files

    directory = family["directory"]
    config_file, weights_file = base_denoiser_files(family["spec"].family.name)
    header = {}
    if weights_file is not None:
        data = (directory / weights_file).read_bytes()
        header = read_header(bytes_reader(data), len(data))
    files = control_files(build_union_controlnet(directory, tmp_path / "union", 4))
    check_control("controlnet", files, json.loads((directory / config_file).read_text()), header)
    modes = union_modes("controlnet", files)
    assert modes == (6 if family["spec"].family.name == "sdxl" else 4)

    def field_of(mode: int | None, record_modes: int | None) -> str | None:
        record = ControlRecord(name="union", kind="controlnet", version="1", sha256="u", bytes=1, tensors=1,
                               modes=record_modes)  # fmt: skip
        try:
            check_mode(ControlIn(name="union", image="x", mode=mode), record, "parameters.controls.0.mode")
        except ApiError as refused:
            assert refused.status == 422
            return refused.field
        return None

    assert field_of(1, modes) is None and field_of(None, None) is None
    for mode, record_modes in ((1, None), (None, modes), (modes, modes)):
        assert field_of(mode, record_modes) == "parameters.controls.0.mode"


@pytest.mark.parametrize("family", ["flux-schnell"], indirect=True)
def test_a_flux_controlnet_that_embeds_guidance_takes_each_rows_guidance(family, tmp_path):
    """InstantX's FLUX.1 ControlNets embed the guidance scale (made for [dev]), whatever the base takes: in a running
    set each row's ControlNet gets its own request's guidance, as FluxControlNetPipeline gives it for that request."""
    import diffusers
    import torch

    from emulators.tiny_controls import build_flux_controlnet, control_files
    from model_worker.controls.loader import ControlWeights, _build

    folder = build_flux_controlnet(family["directory"], tmp_path / "guided", 5, guidance_embeds=True)
    model, _ = _build("controlnet", control_files(folder))
    family["controls"]["guided"] = ControlWeights("guided", "controlnet", "1", "guided" * 2, 0, model)
    family["images"]["guided"] = family["images"]["edges"]
    uses = [("guided", 0.8, 0.0, 1.0)]
    pipe = diffusers.FluxControlNetPipeline(**family["reference"].components, controlnet=model)
    pipe.set_progress_bar_config(disable=True)
    expected = {guidance: pipe(prompt="a lighthouse", control_image=family["images"]["edges"], num_inference_steps=STEPS,
                               guidance_scale=guidance, width=SIZE, height=SIZE, controlnet_conditioning_scale=0.8,
                               generator=torch.Generator().manual_seed(3), max_sequence_length=256,
                               output_type="np").images[0] for guidance in (2.0, 9.0)}  # fmt: skip
    apart = differences([expected[2.0]], [expected[9.0]])
    assert apart > 0.1
    got = stepped(family["stepper"], [(items_of(family, 3, uses), 2.0), (items_of(family, 3, uses), 9.0)])
    assert max(differences(got[0], [expected[2.0]]), differences(got[1], [expected[9.0]])) <= min(TOLERANCE, apart / 10)


@pytest.mark.parametrize("family", ["flux-schnell", "sd35-txt2img"], indirect=True)
def test_a_compiled_transformer_serves_controlnets_without_compiling_after_its_warm_up(
    family, request, monkeypatch, tmp_path
):
    """torch.compile with the eager backend (Dynamo's tracing and guards, without code generation) at one batch
    bucket: the warm-up traces the transformer's base call and, apart, its call with zero residuals for every block;
    a base request (no zeros made: they would hold as much memory as the residuals), a ControlNet request, two
    ControlNets, (FLUX.1) a Union in a mode, an image prompt (its IP-Adapter copied into the transformer's one
    IP-Adapter slot, made before compiling: the local catalog's `image_prompt_slots`) and the base again add no graph;
    the ControlNet image is still the pipeline's and the image prompt's the eager model's (which
    test_ip_adapter_families holds to diffusers' own)."""
    import torch
    from torch._dynamo.utils import counters

    from model_worker.controls import flux_controlnets, sd3_controlnets
    from model_worker.model.pipeline import DiffusionRunner

    zeros = []
    for module, name in ((flux_controlnets, "zero_flux_residuals"), (sd3_controlnets, "zero_sd3_residuals")):
        made = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, made=made: zeros.append(1) or made(*args))

    spec, guidance = family["spec"], guidance_of(family)
    spec = spec.model_copy(update={"max_batch_size": 1, "scheduling": "step",
                                   "defaults": spec.defaults.model_copy(update={"width": SIZE, "height": SIZE})})  # fmt: skip
    torch._dynamo.reset()
    try:
        compiled = DiffusionRunner(
            spec, family["directory"], torch_threads=1, compile_unet=True, compile_backend="eager"
        )
        compiled.warm_up()
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0 and zeros, "the warm-up traced no ControlNet call"
        zeros.clear()
        (base,) = stepped(compiled, [(items_of(family, 5, []), guidance)])
        assert not zeros, "a call without ControlNets made zero residuals"
        (controlled,) = stepped(compiled, [(items_of(family, 5, EDGES), guidance)])
        stepped(compiled, [(items_of(family, 8, MULTI), guidance)])
        flux = family["spec"].family.name == "flux"
        if flux:
            stepped(compiled, [(union_items(family, request.getfixturevalue("union"), 5, 3), guidance)])
            (prompted,) = stepped(compiled, [(image_prompt_items(family, tmp_path, 5), guidance)])
        (again,) = stepped(compiled, [(items_of(family, 5, []), guidance)])
        assert counters["stats"]["unique_graphs"] == graphs, "a control model compiled the transformer again"
        assert differences(controlled, reference(family, 5, guidance, EDGES)) <= TOLERANCE
        assert np.array_equal(np.asarray(again), np.asarray(base))
        if flux:
            (eager,) = stepped(family["stepper"], [(image_prompt_items(family, tmp_path, 5), guidance)])
            assert differences(prompted, eager) <= TOLERANCE and differences(prompted, base) > 2
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["sd35-txt2img"], indirect=True)
def test_a_stability_sd35_controlnet_without_text_or_position_embedding_equals_the_pipeline(family, tmp_path):
    """Stability's SD 3.5 Large ControlNets embed no text (`joint_attention_dim` null: its blocks see the image alone),
    take the transformer's position embedding (`use_pos_embed` false: the pipeline gives it theirs) and the pooled
    text with the VAE's shift: the worker gives them the same (loaded apart from the pipeline's copy, which the
    pipeline itself mutates), alone within 1/255 of StableDiffusion3ControlNetPipeline."""
    import diffusers
    import torch

    from emulators.tiny_controls import control_files
    from model_worker.controls.controlnets import control_noise_seed
    from model_worker.controls.loader import ControlWeights, _build

    transformer = family["reference"].transformer
    config = {key: value for key, value in transformer.config.items() if not key.startswith("_")}
    torch.manual_seed(9)
    controlnet = diffusers.SD3ControlNetModel.from_config(
        {**config, "joint_attention_dim": None, "use_pos_embed": False, "pos_embed_type": None,
         "force_zeros_for_pooled_projection": False, "extra_conditioning_channels": 0}
    )  # fmt: skip
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "pos_embed_input")):
                parameter.copy_(0.5 * torch.randn(parameter.shape) / parameter[0].numel() ** 0.5)
    controlnet.save_pretrained(tmp_path / "stability", safe_serialization=True)
    files = control_files(tmp_path / "stability")
    worker_model, _ = _build("controlnet", files)
    family["controls"]["stability"] = ControlWeights("stability", "controlnet", "1", "st" * 4, 0, worker_model)
    family["images"]["stability"] = family["images"]["edges"]
    uses = [("stability", 0.9, 0.0, 1.0)]
    (got,) = stepped(family["stepper"], [(items_of(family, 6, uses), 5.0)])
    pipe = diffusers.StableDiffusion3ControlNetPipeline(**family["reference"].components,
                                                        controlnet=_build("controlnet", files)[0])  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(control_noise_seed(6))
    expected = pipe(prompt="a lighthouse", control_image=family["images"]["edges"], num_inference_steps=STEPS,
                    guidance_scale=5.0, width=SIZE, height=SIZE, controlnet_conditioning_scale=0.9,
                    generator=torch.Generator().manual_seed(6), output_type="np").images  # fmt: skip
    assert differences(got, list(expected)) <= TOLERANCE
    (base,) = stepped(family["stepper"], [(items_of(family, 6, []), 5.0)])
    assert differences(got, base) > 2  # it steers the image: the oracle can tell


def image_prompt_items(family, tmp_path, seed: int) -> list:
    """A request with an image prompt of the tiny IP-Adapter `make up` registers (built once per test)."""
    from contract.generation import ControlRef
    from emulators.tiny_controls import build_ip_adapter, control_files
    from model_worker.controls.loader import ControlSet, ControlWeights, _build
    from model_worker.model.runners import GenerationItem

    if "style" not in family["controls"]:
        encoder, state_dict = _build("ip_adapter", control_files(build_ip_adapter(family["directory"], tmp_path, 12)))
        family["controls"]["style"] = ControlWeights("style", "ip_adapter", "1", "s" * 8, 0, encoder, state_dict)
    ref = ControlRef(name="style", kind="ip_adapter", version="1", sha256="s" * 8, scale=0.8)
    loaded = ControlSet((ref,), loaded=[family["controls"]["style"]])
    loaded.done.set()
    return [GenerationItem(prompt="a lighthouse", seed=seed, controls=loaded, control_images=(input_image(23),))]
