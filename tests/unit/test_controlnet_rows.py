"""SD 1.5 ControlNets chosen per request and batched across requests, against diffusers'
`StableDiffusionControlNetPipeline` (one ControlNet, and multi-ControlNet with windows) on tiny random-weight
ControlNets built offline (`ControlNetModel.from_unet` on the tiny UNet): a request alone equals the pipeline in both
schedulings; in a running set mixing two ControlNets, two scales, guided and unguided rows and a row with none, each
image equals the same request alone, and the row without control is exactly the base model's (torch.equal)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from contract.generation import ControlRef
from contract.messages import GenerationParameters
from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_model_families import differences, input_image

SD15 = local_catalog(test_fixtures=True).get("sd15-txt2img")
SIZE, STEPS = 64, 4
TOLERANCE = 1  # of 255: the brief's bound on the ControlNet oracle


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> dict:
    """The tiny SD 1.5 pipeline (the reference), two tiny ControlNets of its UNet, loaded as the worker loads them,
    and two control images."""
    from diffusers import ControlNetModel

    from emulators.tiny_controls import build_controlnet
    from model_worker.controls.loader import ControlWeights

    root = tmp_path_factory.mktemp("controlnets")
    directory, reference = tiny_pipelines(root, {"sd15": SD15})["sd15"]
    controls = {}
    for name, seed in (("edges", 1), ("depth", 2)):
        folder = build_controlnet(directory, root / name, seed)
        controls[name] = ControlWeights(name, "controlnet", "1", name * 8, 0, ControlNetModel.from_pretrained(folder))
    return {"directory": directory, "reference": reference, "controls": controls,
            "images": {"edges": input_image(21), "depth": input_image(22)}}  # fmt: skip


def control_set(sd15, uses: list[tuple[str, float, float, float]]):
    """A loaded ControlSet of (name, scale, start, end) uses, and their control images."""
    from model_worker.controls.loader import ControlSet

    refs = tuple(ControlRef(name=name, kind="controlnet", version="1", sha256=name * 8, scale=scale, start=start,
                            end=end) for name, scale, start, end in uses)  # fmt: skip
    controls = ControlSet(refs, loaded=[sd15["controls"][name] for name, *_ in uses])
    controls.done.set()
    return controls, tuple(sd15["images"][name] for name, *_ in uses)


def items_of(sd15, seed: int, uses, images: int = 1):
    from model_worker.model.runners import GenerationItem

    controls, control_images = control_set(sd15, uses) if uses else (None, ())
    return [GenerationItem(prompt="a lighthouse", seed=seed + i, controls=controls, control_images=control_images)
            for i in range(images)]  # fmt: skip


def params(guidance: float, seed: int = 0) -> GenerationParameters:
    return GenerationParameters(seed=seed, num_inference_steps=STEPS, guidance_scale=guidance, width=SIZE, height=SIZE)


def runner(sd15, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    return DiffusionRunner(SD15.model_copy(update={"scheduling": scheduling}), sd15["directory"], torch_threads=1)


@pytest.fixture(scope="module")
def stepper(sd15):
    return runner(sd15, "step")


def stepped(stepper, requests: list[tuple[list, float]], join_after: int = 1) -> list[list]:
    """Serves requests as the device loop does: the first starts alone, the others join after `join_after` of its
    steps and share every call from then on; each request's images, in order."""
    first_items, first_guidance = requests[0]
    running = [stepper.start_items(first_items, params(first_guidance))]
    for _ in range(join_after):
        stepper.denoise_step(running[0])
    running += [stepper.start_items(items, params(guidance)) for items, guidance in requests[1:]]
    outputs: dict[int, list] = {}
    while len(outputs) < len(running):
        live = [r for index, group in enumerate(running) if index not in outputs for r in group]
        stepper.denoise_step(live)
        for index, group in enumerate(running):
            if index not in outputs and all(r.finished for r in group):
                outputs[index] = stepper.decode(group)
    return [outputs[index] for index in range(len(running))]


def reference(sd15, seed: int, guidance: float, uses, images: int = 1) -> list:
    """diffusers' own ControlNet pipeline (a MultiControlNetModel for several), one call per image."""
    import torch
    from diffusers import StableDiffusionControlNetPipeline

    models = [sd15["controls"][name].model for name, *_ in uses]
    pipe = StableDiffusionControlNetPipeline(**sd15["reference"].components, controlnet=models[0] if len(models) == 1
                                             else models)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    single = len(uses) == 1
    kwargs = {
        "image": sd15["images"][uses[0][0]] if single else [sd15["images"][name] for name, *_ in uses],
        "controlnet_conditioning_scale": uses[0][1] if single else [scale for _, scale, _, _ in uses],
        "control_guidance_start": uses[0][2] if single else [start for _, _, start, _ in uses],
        "control_guidance_end": uses[0][3] if single else [end for _, _, _, end in uses],
    }
    return [pipe(prompt="a lighthouse", num_inference_steps=STEPS, guidance_scale=guidance, width=SIZE, height=SIZE,
                 generator=torch.Generator().manual_seed(seed + i), output_type="np", **kwargs).images[0]
            for i in range(images)]  # fmt: skip


EDGES = [("edges", 0.8, 0.0, 1.0)]
MULTI = [("edges", 0.7, 0.0, 0.5), ("depth", 1.3, 0.25, 1.0)]


def test_a_controlnet_request_alone_equals_the_controlnet_pipeline_and_is_steered_by_it(sd15, stepper):
    (got,) = stepped(stepper, [(items_of(sd15, 5, EDGES, images=2), 6.0)])
    assert differences(got, reference(sd15, 5, 6.0, EDGES, images=2)) <= TOLERANCE
    (base,) = stepped(stepper, [(items_of(sd15, 5, [], images=2), 6.0)])
    assert differences(got, base) > 10  # the tiny ControlNet visibly steers the image: the oracle can tell


def test_multi_controlnet_with_windows_equals_the_pipeline(sd15, stepper):
    (got,) = stepped(stepper, [(items_of(sd15, 8, MULTI), 5.0)])
    assert differences(got, reference(sd15, 8, 5.0, MULTI)) <= TOLERANCE
    # The windows matter: the same two models over the whole schedule make another image.
    whole = [(name, scale, 0.0, 1.0) for name, scale, _, _ in MULTI]
    assert differences(got, reference(sd15, 8, 5.0, whole)) > 2


def test_a_mixed_running_set_equals_each_request_alone_and_a_row_without_control_is_the_base_models(sd15, stepper):
    depth = [("depth", 1.2, 0.0, 1.0)]
    mixed = [(items_of(sd15, 3, EDGES), 6.0), (items_of(sd15, 9, depth, images=2), 1.0),
             (items_of(sd15, 4, MULTI), 6.0), (items_of(sd15, 12, []), 6.0)]  # fmt: skip
    got = stepped(stepper, mixed)
    for (items, guidance), images in zip(mixed, got, strict=True):
        uses = (
            [(ref.name, ref.scale, ref.start, ref.end) for ref in items[0].controls.refs] if items[0].controls else []
        )
        (alone,) = stepped(stepper, [(items_of(sd15, items[0].seed, uses, images=len(items)), guidance)])
        assert differences(images, alone) <= TOLERANCE
    # The same running set with no control anywhere: the uncontrolled request's image is exactly the same.
    plain = [(items_of(sd15, items[0].seed, [], images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(stepper, plain)[3][0], got[3][0])


def test_a_call_without_any_control_passes_no_residuals_to_the_unet(sd15, stepper):
    """The base model's call itself: the UNet gets no residual arguments when no row has a ControlNet."""
    seen: list[set] = []
    unet = stepper._pipeline.unet
    original = unet.forward
    lock = threading.Lock()

    def recording(*args, **kwargs):
        with lock:
            seen.append({key for key in kwargs if "residual" in key})
        return original(*args, **kwargs)

    unet.forward = recording
    try:
        stepped(stepper, [(items_of(sd15, 1, []), 6.0)])
        assert seen and not any(seen)
        seen.clear()
        stepped(stepper, [(items_of(sd15, 1, EDGES), 6.0)])
        assert all(keys == {"down_block_additional_residuals", "mid_block_additional_residual"} for keys in seen)
    finally:
        del unet.forward


def test_scheduling_request_runs_diffusers_controlnet_pipelines_one_per_control_set(sd15):
    """A request-scheduled batch mixing a ControlNet, multi-ControlNet and none: each image the pipeline's own."""
    batch = runner(sd15, "request")
    items = items_of(sd15, 5, EDGES) + items_of(sd15, 8, MULTI) + items_of(sd15, 12, [])
    got = batch.generate(items, params(5.0), lambda step, total: None)
    expected = reference(sd15, 5, 5.0, EDGES) + reference(sd15, 8, 5.0, MULTI)
    assert differences(got[:2], expected) <= TOLERANCE
    plain = batch.generate(items_of(sd15, 12, []), params(5.0), lambda step, total: None)
    assert differences(got[2:], plain) <= TOLERANCE


@pytest.fixture(scope="module")
def compiled(sd15, styled):
    """The tiny SD 1.5 model compiled with torch.compile's eager backend (Dynamo's tracing and guards, without code
    generation) at one batch bucket, with one IP-Adapter slot of the tiny IP-Adapter's shape, after its warm-up (the
    UNet traced with zero ControlNet residuals and the slot's zero image prompt): what the compiled tests share."""
    import torch

    from contract.model_spec import ImagePromptSlots
    from model_worker.model.pipeline import DiffusionRunner

    controls = SD15.controls.model_copy(update={"image_prompt_slots": ImagePromptSlots(embedding_width=32)})
    spec = SD15.model_copy(update={"max_batch_size": 1, "scheduling": "step", "controls": controls,
                                   "defaults": SD15.defaults.model_copy(update={"width": SIZE, "height": SIZE})})  # fmt: skip
    torch._dynamo.reset()
    runner = DiffusionRunner(spec, sd15["directory"], torch_threads=1, compile_unet=True, compile_backend="eager")
    runner.warm_up()
    yield runner
    torch._dynamo.reset()


def test_a_compiled_model_serves_a_controlnet_without_compiling_after_its_warm_up(sd15, compiled):
    """A base request, a ControlNet request, a multi-ControlNet one and the base again add no graph, and the ControlNet
    image is still the pipeline's."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    (base,) = stepped(compiled, [(items_of(sd15, 5, []), 6.0)])
    (controlled,) = stepped(compiled, [(items_of(sd15, 5, EDGES), 6.0)])
    stepped(compiled, [(items_of(sd15, 8, MULTI), 5.0)])
    (again,) = stepped(compiled, [(items_of(sd15, 5, []), 6.0)])
    assert counters["stats"]["unique_graphs"] == graphs, "a ControlNet compiled the UNet again"
    assert differences(controlled, reference(sd15, 5, 6.0, EDGES)) <= TOLERANCE
    assert np.array_equal(np.asarray(again), np.asarray(base))


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_controls_never_split_a_batch_and_a_request_waits_aside_until_its_controlnets_are_loaded(scheduling):
    """The pool's batch key stays model, size and adapter set: requests with other ControlNets, or none, share it;
    a request whose ControlNets are still loading is not ready (it blocks no one) until they are."""
    from dataclasses import replace

    from model_worker.controls.loader import ControlSet
    from tests.unit.test_step_scheduler import request

    spec = SD15.model_copy(update={"scheduling": scheduling})
    edges = ControlRef(name="edges", kind="controlnet", version="1", sha256="e", scale=0.8)
    depth = ControlRef(name="depth", kind="controlnet", version="1", sha256="d", scale=1.2, start=0.2)
    keys = set()
    for index, refs in enumerate(((), (edges,), (edges, depth))):
        pending = request(f"r{index}", spec)
        pending.request.parameters.controls = refs
        keys.add(pending.batch_key)
    assert len(keys) == 1
    loading = ControlSet((edges,))
    pending = request("loading", spec)
    pending.items = [replace(item, controls=loading) for item in pending.items]
    assert not pending.ready
    loading.done.set()
    assert pending.ready


# IP-Adapters (image prompts): the tiny plain IP-Adapter and its image encoder `make up` registers
# (emulators/tiny_controls.py), loaded as the worker loads them, against diffusers' `load_ip_adapter` +
# `set_ip_adapter_scale` on a pipeline of its own (loading changes the UNet's processors).


@pytest.fixture(scope="module")
def styled(sd15, tmp_path_factory) -> dict:
    import diffusers

    from emulators.tiny_controls import build_ip_adapter, control_files
    from model_worker.controls.loader import ControlWeights, _build

    root = tmp_path_factory.mktemp("ip-adapter")
    for name, seed in (("style", 12), ("style2", 13)):  # the second: two IP-Adapters over one compiled slot
        encoder, state_dict = _build(
            "ip_adapter", control_files(build_ip_adapter(sd15["directory"], root / name, seed))
        )
        sd15["controls"][name] = ControlWeights(name, "ip_adapter", "1", name[0] * 8, 0, encoder, state_dict)
    sd15["images"]["style"] = sd15["images"]["style2"] = input_image(23)
    reference = diffusers.StableDiffusionPipeline.from_pretrained(sd15["directory"], safety_checker=None)
    reference.load_ip_adapter(str(root / "style"), subfolder="", weight_name="ip_adapter.safetensors")
    reference.set_progress_bar_config(disable=True)
    return {"reference": reference}


def prompted(sd15, seed: int, scale: float, images: int = 1, controls=(), name: str = "style"):
    """Items whose requests carry the image prompt of the IP-Adapter `name` at `scale` (after any ControlNets in
    `controls`)."""
    from model_worker.controls.loader import ControlSet
    from model_worker.model.runners import GenerationItem

    refs = tuple(ControlRef(name=control, kind="controlnet", version="1", sha256=control * 8, scale=s, start=a, end=b)
                 for control, s, a, b in controls)  # fmt: skip
    refs += (ControlRef(name=name, kind="ip_adapter", version="1", sha256=name[0] * 8, scale=scale),)
    names = [control for control, *_ in controls] + [name]
    loaded = ControlSet(refs, loaded=[sd15["controls"][name] for name in names])
    loaded.done.set()
    return [GenerationItem(prompt="a lighthouse", seed=seed + i, controls=loaded,
                           control_images=tuple(sd15["images"][name] for name in names))
            for i in range(images)]  # fmt: skip


def ip_reference(sd15, styled, seed: int, guidance: float, scale: float, images: int = 1) -> list:
    import torch

    pipe = styled["reference"]
    pipe.set_ip_adapter_scale(scale)
    return [pipe(prompt="a lighthouse", ip_adapter_image=sd15["images"]["style"], num_inference_steps=STEPS,
                 guidance_scale=guidance, width=SIZE, height=SIZE, generator=torch.Generator().manual_seed(seed + i),
                 output_type="np").images[0] for i in range(images)]  # fmt: skip


def test_an_image_prompt_alone_equals_diffusers_ip_adapter_pipeline_and_is_steered_by_it(sd15, styled, stepper):
    (got,) = stepped(stepper, [(prompted(sd15, 5, 0.7, images=2), 6.0)])
    assert differences(got, ip_reference(sd15, styled, 5, 6.0, 0.7, images=2)) <= TOLERANCE
    (base,) = stepped(stepper, [(items_of(sd15, 5, [], images=2), 6.0)])
    assert differences(got, base) > 10  # the tiny IP-Adapter visibly steers the image: the oracle can tell


def test_a_mixed_running_set_with_image_prompts_equals_each_alone_and_a_row_without_is_the_base_models(
    sd15, styled, stepper
):
    mixed = [(prompted(sd15, 3, 0.7), 6.0), (items_of(sd15, 12, []), 6.0), (items_of(sd15, 4, EDGES), 6.0),
             (prompted(sd15, 9, 1.4, images=2, controls=EDGES), 1.0)]  # fmt: skip
    got = stepped(stepper, mixed)
    alone = [stepped(stepper, [(prompted(sd15, 3, 0.7), 6.0)])[0], stepped(stepper, [(items_of(sd15, 12, []), 6.0)])[0],
             stepped(stepper, [(items_of(sd15, 4, EDGES), 6.0)])[0],
             stepped(stepper, [(prompted(sd15, 9, 1.4, images=2, controls=EDGES), 1.0)])[0]]  # fmt: skip
    for images, expected in zip(got, alone, strict=True):
        assert differences(images, expected) <= TOLERANCE
    # The same running set with no image prompt or control anywhere (the UNet's base processors): the request
    # without either gets exactly the same image, though its rows went through the IP-Adapter processors above.
    plain = [(items_of(sd15, items[0].seed, [], images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(stepper, plain)[1][0], got[1][0])
    assert differences(got[0], ip_reference(sd15, styled, 3, 6.0, 0.7)) <= TOLERANCE


def test_scheduling_request_runs_the_ip_adapter_pipeline_per_image_prompt_set(sd15, styled):
    """A request-scheduled batch mixing an image prompt, an image prompt with a ControlNet and none: each image the
    pipeline's own, the one without exactly the base pipeline's (the UNet's base processors restored)."""
    batch = runner(sd15, "request")
    plain = batch.generate(items_of(sd15, 12, []), params(5.0), lambda step, total: None)
    items = prompted(sd15, 5, 0.7) + prompted(sd15, 8, 0.7, controls=EDGES) + items_of(sd15, 12, [])
    got = batch.generate(items, params(5.0), lambda step, total: None)
    assert differences(got[:1], ip_reference(sd15, styled, 5, 5.0, 0.7)) <= TOLERANCE
    assert differences(got[1:2], got[:1]) > 2  # its ControlNet acts too
    assert np.array_equal(np.asarray(got[2]), np.asarray(plain[0]))


def test_a_compiled_model_serves_image_prompts_without_compiling_after_its_warm_up(sd15, styled, compiled):
    """A base request, an image prompt (its IP-Adapter copied into the slot in place: the slot's tensors keep their
    storage), another IP-Adapter in the same slot, the first again and the base again add no graph; the image
    prompt's image is diffusers' `load_ip_adapter` pipeline's, the same after the other IP-Adapter held the slot,
    and the base image is the same before and after."""
    from torch._dynamo.utils import counters

    unet = compiled._pipeline.unet
    slots = [unet.get_submodule(name.removesuffix(".processor")).processor.to_k_ip[0].weight
             for name in unet.attn_processors if name.endswith("attn2.processor")]  # fmt: skip
    storage = [slot.data_ptr() for slot in slots]
    graphs = counters["stats"]["unique_graphs"]
    (base,) = stepped(compiled, [(items_of(sd15, 5, []), 6.0)])
    (first,) = stepped(compiled, [(prompted(sd15, 5, 0.7), 6.0)])
    (other,) = stepped(compiled, [(prompted(sd15, 5, 0.7, name="style2"), 6.0)])
    (back,) = stepped(compiled, [(prompted(sd15, 5, 0.7), 6.0)])
    (again,) = stepped(compiled, [(items_of(sd15, 5, []), 6.0)])
    assert counters["stats"]["unique_graphs"] == graphs, "an image prompt compiled the UNet again"
    assert differences(first, ip_reference(sd15, styled, 5, 6.0, 0.7)) <= TOLERANCE
    assert np.array_equal(np.asarray(back), np.asarray(first)) and differences(other, first) > 2
    assert np.array_equal(np.asarray(again), np.asarray(base))
    assert [slot.data_ptr() for slot in slots] == storage and slots[0].abs().sum() > 0


def test_a_compiled_model_refuses_an_ip_adapter_that_does_not_fit_its_slots(sd15, compiled):
    """An IP-Adapter of other image embeddings (48 wide against the slots' 32) fails its request when it starts, naming
    it and the slots' shape, before any of it runs, and so do more IP-Adapters than slots; the model serves the next
    request."""
    import torch

    from model_worker.controls.loader import ControlSet, ControlWeights
    from model_worker.model.runners import GenerationItem

    style = sd15["controls"]["style"]
    state_dict = {"image_proj": {**style.state_dict["image_proj"]}, "ip_adapter": style.state_dict["ip_adapter"]}
    state_dict["image_proj"]["proj.weight"] = torch.zeros(state_dict["image_proj"]["proj.weight"].shape[0], 48)
    sd15["controls"]["wide"] = ControlWeights("wide", "ip_adapter", "1", "w" * 8, 0, style.model, state_dict)
    sd15["images"]["wide"] = sd15["images"]["style"]
    with pytest.raises(ValueError, match=r"wide: the IP-Adapter takes 48-wide image embeddings to 4 image tokens; "
                                         r"sd15-txt2img is compiled with IP-Adapter slots of 32-wide embeddings"):  # fmt: skip
        compiled.start_items(prompted(sd15, 5, 0.7, name="wide"), params(6.0))
    refs = tuple(ControlRef(name=name, kind="ip_adapter", version="1", sha256=name[0] * 8, scale=0.7)
                 for name in ("style", "style2"))  # fmt: skip
    both = ControlSet(refs, loaded=[sd15["controls"]["style"], sd15["controls"]["style2"]])
    both.done.set()
    two = [GenerationItem(prompt="a lighthouse", seed=5, controls=both, control_images=(sd15["images"]["style"],) * 2)]
    with pytest.raises(ValueError, match=r"sd15-txt2img is compiled with 1 IP-Adapter slots: at most that many"):
        compiled.start_items(two, params(6.0))  # the API refuses more than max_image_prompts_per_request before
    assert stepped(compiled, [(items_of(sd15, 5, []), 6.0)])


def test_more_ip_adapters_than_slots_in_a_running_set_take_a_pass_each_and_each_image_is_as_alone(
    sd15, styled, stepper
):
    """The slots' arithmetic, eagerly (slots made without compiling): with one slot, a running set of two IP-Adapters
    and a request without any calls the UNet once per IP-Adapter; each image prompt's image equals its request alone
    (diffusers' pipeline for the first), the request without one exactly the base model's."""
    from contract.model_spec import ImagePromptSlots
    from model_worker.model.pipeline import DiffusionRunner

    controls = SD15.controls.model_copy(update={"image_prompt_slots": ImagePromptSlots(embedding_width=32)})
    slotted = DiffusionRunner(SD15.model_copy(update={"scheduling": "step", "controls": controls}), sd15["directory"],
                              torch_threads=1)  # fmt: skip
    slotted._denoiser.make_slots()
    mixed = [(prompted(sd15, 3, 0.7), 6.0), (items_of(sd15, 12, []), 6.0),
             (prompted(sd15, 9, 1.3, images=2, name="style2"), 1.0)]  # fmt: skip
    calls = []
    unet = slotted._pipeline.unet
    original = unet.forward
    unet.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        got = stepped(slotted, mixed)
    finally:
        del unet.forward
    steps = STEPS + 1  # PNDM's: one more than asked
    assert len(calls) == 1 + 2 * (steps - 1) + 1  # the first request's first step alone, two passes while it runs
    assert differences(got[0], ip_reference(sd15, styled, 3, 6.0, 0.7)) <= TOLERANCE
    alone = stepped(stepper, [(prompted(sd15, 9, 1.3, images=2, name="style2"), 1.0)])[0]
    assert differences(got[2], alone) <= TOLERANCE and differences(got[2][:1], got[0]) > 2
    plain = [(items_of(sd15, items[0].seed, [], images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(slotted, plain)[1][0], got[1][0])
