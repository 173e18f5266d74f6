"""LoRA adapters for every family against diffusers' own LoRA loading: a request's image with adapters, made by
the worker's device loop, equals the pipeline's after `load_lora_weights` and `set_adapters`.

For SD 1.5, SDXL, FLUX.1 and SD 3.5 (tiny random-weight pipelines, as the local stack serves them), in both
schedulings: one adapter at a scale, two composed, scale 0 (the base image); files in the kohya layout (with
alpha, SDXL's in the original UNet's block names too), with LoCon conv layers, and FLUX.1's BFL names; an
activation that fails part-way (diffusers' load, or its `set_adapters`) leaves the base model behind. A compiled
model's hotswap slots: wired on an eager model (PEFT, kohya LoCon and mixed-rank files, a swap that fails
part-way; every family's denoiser), and on a model compiled with torch.compile's eager backend, which serves a base request, an adapter,
a switch to another, two at once and the base model again without compiling after its warm-up.
Adapters reach the runner through the worker's own loader (digest, header check against the base weights).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from contract import naming
from contract.generation import AdapterRef
from contract.lora_files import BASE_FILES, bytes_reader, read_header
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_adapter_parts import FakeBucket, with_adapters
from tests.unit.test_model_families import (
    DEV,
    KLEIN,
    QWEN,
    SD15,
    SD35,
    SDXL,
    ZIMAGE,
    assert_close,
    reference_images,
)
from tests.unit.test_step_scheduler import Worker, request

POLICY = SD15.adapters
FAMILIES = {name: spec.model_copy(update={"adapters": POLICY}) for name, spec in
            {"sd15": SD15, "sdxl": SDXL, "flux-dev": DEV, "sd35": SD35, "z-image-turbo": ZIMAGE,
             "flux2-klein": KLEIN, "qwen-image": QWEN}.items()}  # fmt: skip
# The 2026 families: diffusers loads their LoRAs into the transformer only, in diffusers' PEFT layout here.
NEW_FAMILIES = ("z-image-turbo", "flux2-klein", "qwen-image")
SIZE = 64
# The tiny FLUX.2 [klein]'s image barely moves under an adapter of the others' size (3/255): a stronger one's does.
STRENGTH = {"flux2-klein": 4.0}
# An adapter visibly changes the image: at least this much somewhere (out of 255).
VISIBLE = 10


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """Per family: its tiny pipeline's directory and the diffusers pipeline loaded from it (the reference)."""
    return tiny_pipelines(tmp_path_factory.mktemp("adapter-families"), FAMILIES)


def peft_file(directory: Path, seed: int, rank: int) -> bytes:
    """The `make up` adapter builder's file (diffusers' PEFT layout): attention projections of every component."""
    from emulators.tiny_pipeline import build_adapter

    out = directory.parent / f"{directory.name}-peft-{seed}-{rank}.safetensors"
    components = FAMILIES[directory.name].family.lora_components
    strength = STRENGTH.get(directory.name, 1.0)
    return build_adapter(directory, out, seed, rank, strength, components).read_bytes()


def base_weights(directory: Path, component: str) -> dict[str, list[int]]:
    file = directory / BASE_FILES[component]
    data = file.read_bytes()
    header = read_header(bytes_reader(data), len(data))
    return {name.removesuffix(".weight"): entry["shape"] for name, entry in header.items() if name.endswith(".weight")}


def sgm_name(module: str, layers_per_block: int) -> str:
    """A diffusers UNet module as kohya names it in SDXL's original (SGM) UNet: `input_blocks_4_1_...`."""
    per_block, resnet = layers_per_block + 1, {"conv1": "in_layers_2", "conv2": "out_layers_3",
                                               "time_emb_proj": "emb_layers_1", "conv_shortcut": "skip_connection"}  # fmt: skip
    parts = module.split(".")
    if parts[0] == "mid_block":
        index = {("resnets", "0"): 0, ("attentions", "0"): 1, ("resnets", "1"): 2}[(parts[1], parts[2])]
        head, rest = f"middle_block_{index}", parts[3:]
    elif parts[2] == "downsamplers":
        return f"input_blocks_{(int(parts[1]) + 1) * per_block}_0_op"
    else:
        block, inner, layer = int(parts[1]), parts[2], int(parts[3])
        index = block * per_block + layer + (1 if parts[0] == "down_blocks" else 0)
        kind = "input_blocks" if parts[0] == "down_blocks" else "output_blocks"
        head, rest = f"{kind}_{index}_{('resnets', 'attentions').index(inner)}", parts[4:]
    if rest and rest[0] in resnet:
        rest = [resnet[rest[0]], *rest[1:]]
    return "_".join([head, *rest])


def kohya_file(directory: Path, family: str, seed: int, conv: bool = False, sgm: bool = False) -> bytes:
    """A kohya-layout file (`lora_unet_*`, `lora_te*_*`, with alpha) for the tiny pipeline; `conv`: LoCon, its
    ResNet convolutions (and downsamplers) too; `sgm`: SDXL's UNet names in the original UNet's blocks, as kohya
    writes them. FLUX's denoiser part uses the BFL names (fused q/k/v), as kohya writes them."""
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(seed)
    tensors: dict = {}

    def pair(name: str, down_shape: list[int], up_shape: list[int], alpha: float) -> None:
        fan_in = int(np.prod(down_shape[1:]))
        tensors[f"{name}.lora_down.weight"] = torch.randn(*down_shape, generator=generator) / fan_in**0.5
        tensors[f"{name}.lora_up.weight"] = torch.randn(*up_shape, generator=generator) / up_shape[1] ** 0.5
        tensors[f"{name}.alpha"] = torch.tensor(alpha)

    rank = 4
    if family.startswith("flux"):
        weights = base_weights(directory, "transformer")
        inner = weights["transformer_blocks.0.attn.to_q"][1]
        mlp = weights["single_transformer_blocks.0.proj_mlp"][0]
        pair("lora_unet_double_blocks_0_img_attn_qkv", [rank, inner], [3 * inner, rank], 2.0)
        pair("lora_unet_double_blocks_0_txt_attn_qkv", [rank, inner], [3 * inner, rank], 2.0)
        pair("lora_unet_double_blocks_0_img_attn_proj", [rank, inner], [inner, rank], 2.0)
        # (single blocks' `linear1`, q/k/v and the MLP input fused, diffusers splits at FLUX.1's real widths only)
        pair("lora_unet_single_blocks_0_linear2", [rank, inner + mlp], [inner, rank], 2.0)
        encoders = {"lora_te1": "text_encoder"}
    else:
        unet = base_weights(directory, "unet")
        layers_per_block = len({m.split(".")[3] for m in unet if m.startswith("down_blocks.0.resnets.")})

        def name(module: str) -> str:
            return "lora_unet_" + (sgm_name(module, layers_per_block) if sgm else module.replace(".", "_"))

        for module, shape in sorted(unet.items()):
            if module.endswith((".to_q", ".to_k", ".to_v", ".to_out.0", ".proj_in")) and len(shape) == 2:
                pair(name(module), [rank, shape[1]], [shape[0], rank], 2.0)
            elif conv and (
                (".resnets." in module and module.endswith((".conv1", ".conv2"))) or ".downsamplers." in module
            ):
                out_channels, in_channels, *kernel = shape
                pair(name(module), [rank, in_channels, *kernel], [out_channels, rank, 1, 1], 8.0)
        encoders = {"lora_te": "text_encoder"} if family == "sd15" else {"lora_te1": "text_encoder",
                                                                          "lora_te2": "text_encoder_2"}  # fmt: skip
    for prefix, component in encoders.items():
        for module, shape in sorted(base_weights(directory, component).items()):
            if module.endswith(("_proj", ".fc1", ".fc2")) and ".layers." in module:
                name = f"{prefix}_text_model_" + module.removeprefix("text_model.").replace(".", "_")
                pair(name, [rank, shape[1]], [shape[0], rank], 3.0)
    return save(tensors)


def loaded(family: str, pipelines, files: dict[str, bytes], scales: dict[str, float]):
    """The request's AdapterSet as the worker's loader makes it: digest, header check against the base weights."""
    from model_worker.adapters.loader import AdapterLoader

    spec = FAMILIES[family]
    objects = {naming.adapter_prefix(spec.name, name, "1") + naming.ADAPTER_FILE: data for name, data in files.items()}
    loader = AdapterLoader(FakeBucket(objects), {spec.queue: pipelines[family][0]}, lambda: None)
    loader.start()
    try:
        refs = tuple(AdapterRef(name=name, version="1", scale=scale, sha256=hashlib.sha256(files[name]).hexdigest())
                     for name, scale in scales.items())  # fmt: skip
        adapters = loader.request(spec, refs)
        assert adapters.done.wait(60)
    finally:
        loader.stop()
    adapters.weights()  # raises when a file was refused
    return adapters


def reference_with(pipelines, family: str, pending, files: dict[str, bytes], scales: dict[str, float]) -> list:
    """diffusers' own images: `load_lora_weights` of each file, `set_adapters(names, scales)`, then unloaded."""
    from safetensors.torch import load

    reference = pipelines[family][1]
    for name in scales:
        reference.load_lora_weights(load(files[name]), adapter_name=name)
    try:
        reference.set_adapters(list(scales), list(scales.values()))
        return reference_images({family: pipelines[family]}, family, pending)
    finally:
        reference.delete_adapters(list(scales))


def served(pipelines, family: str, scheduling: str, runner=None, adapters=None, seed: int = 7, images: int = 2):
    """A request of `images` images through the worker's device loop, and the runner (reused across calls)."""
    from model_worker.model.pipeline import DiffusionRunner

    spec = FAMILIES[family].model_copy(update={"scheduling": scheduling})
    runner = runner or DiffusionRunner(spec, pipelines[family][0], torch_threads=1)
    guidance = 0.0 if spec.guidance_mode == "none" else 3.5
    # The request id is the prompt: the same in both schedulings, so both equal the same reference images.
    pending = request(f"{family}-{seed}", spec, steps=3, guidance=guidance, seed=seed, images=images)
    pending.request.parameters.width = pending.request.parameters.height = SIZE
    if adapters is not None:
        pending = with_adapters(pending, adapters)
    with Worker({spec.queue: runner}) as worker:
        worker.pool.add(pending)
        worker.outcomes.wait(1)
    assert set(worker.outcomes.images) == {pending.request_id}, worker.outcomes.answered
    return worker.outcomes.images[pending.request_id], pending, runner


def differs(a: list, b: list) -> float:
    return max(
        np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max() * 255 for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_and_two_adapters_and_scale_zero_equal_diffusers_own_lora_loading_in_both_schedulings(pipelines, family):
    directory = pipelines[family][0]
    files = {"ink": peft_file(directory, 1, 4), "neon": peft_file(directory, 2, 8)}
    cases = [{"ink": 0.8}, {"ink": 0.8, "neon": -0.5}, {"ink": 0.0}]
    references: dict[int, list] = {}  # diffusers' images, made once: both schedulings serve the same requests
    for scheduling in ("step", "request"):
        base, pending, runner = served(pipelines, family, scheduling)
        if -1 not in references:
            references[-1] = reference_images({family: pipelines[family]}, family, pending)
        assert_close(base, references[-1])
        for case, scales in enumerate(cases):
            adapters = loaded(family, pipelines, files, scales)
            images, pending, _ = served(pipelines, family, scheduling, runner, adapters)
            if case not in references:
                references[case] = reference_with(pipelines, family, pending, files, scales)
            assert_close(images, references[case])
            if any(scales.values()):
                assert differs(images, base) > VISIBLE, f"{scales} did not change the image"
            else:
                assert_close(images, base)
        again, _, _ = served(pipelines, family, scheduling, runner)  # after adapters: the base model again
        assert np.array_equal(np.asarray(again), np.asarray(base))


@pytest.mark.parametrize(
    ("family", "conv", "sgm"),
    [("sd15", False, False), ("sd15", True, False), ("sdxl", False, False), ("sdxl", True, True),
     ("flux-dev", False, False)],
)  # fmt: skip
def test_kohya_and_locon_files_load_and_equal_diffusers(pipelines, family, conv, sgm):
    files = {"kohya": kohya_file(pipelines[family][0], family, seed=3, conv=conv, sgm=sgm)}
    base, _, runner = served(pipelines, family, "request")
    adapters = loaded(family, pipelines, files, {"kohya": 0.7})
    images, pending, _ = served(pipelines, family, "request", runner, adapters)
    assert differs(images, base) > VISIBLE
    assert_close(images, reference_with(pipelines, family, pending, files, {"kohya": 0.7}))
    # Every layer the file names is on the pipeline (a silently skipped one would pass the comparison above).
    layers = sum(
        1
        for component in FAMILIES[family].family.lora_components
        for module in getattr(runner._pipeline, component).modules()
        if "adapter_0" in getattr(module, "lora_A", {})
    )
    pairs = sum(1 for key in adapters.loaded[0][0].tensors if key.endswith(".lora_down.weight"))
    fused = {"sd15": 0, "sdxl": 0, "flux-dev": 2 + 2}[family]  # BFL qkv: 3 modules each
    assert layers == pairs + fused


def test_a_load_that_fails_part_way_or_a_failed_set_adapters_leaves_the_base_model(pipelines, monkeypatch):
    directory = pipelines["sd15"][0]
    files = {"ink": peft_file(directory, 1, 4), "neon": peft_file(directory, 2, 8)}
    base, _, runner = served(pipelines, "sd15", "request")
    inked, _, _ = served(pipelines, "sd15", "request", runner, loaded("sd15", pipelines, files, {"ink": 0.8}))
    pipeline = runner._pipeline

    def failing(*args, **kwargs):
        raise RuntimeError("the device ran out of memory")

    # diffusers loads neon's UNet layers, then fails in the text encoder's: neon must not stay half loaded.
    monkeypatch.setattr(pipeline, "load_lora_into_text_encoder", failing)
    both = loaded("sd15", pipelines, files, {"ink": 0.8, "neon": 0.5})
    with pytest.raises(ValueError, match="adapter neon@1 could not be loaded: the device ran out of memory"):
        runner.generate(served_items(both), params(), lambda step, total: None)
    assert pipeline.get_list_adapters() == {"unet": ["adapter_0"], "text_encoder": ["adapter_0"]}
    again, _, _ = served(pipelines, "sd15", "request", runner)
    assert np.array_equal(np.asarray(again), np.asarray(base)), "the next base request ran with part of an adapter"
    monkeypatch.undo()

    monkeypatch.setattr(pipeline, "set_adapters", failing)
    with pytest.raises(ValueError, match="adapters ink@1 could not be activated"):
        runner.generate(served_items(loaded("sd15", pipelines, files, {"ink": 0.8})), params(), lambda s, t: None)
    again, _, _ = served(pipelines, "sd15", "request", runner)
    assert np.array_equal(np.asarray(again), np.asarray(base))
    monkeypatch.undo()
    ink_again, _, _ = served(pipelines, "sd15", "request", runner, loaded("sd15", pipelines, files, {"ink": 0.8}))
    assert np.array_equal(np.asarray(ink_again), np.asarray(inked))


def params():
    from contract.messages import GenerationParameters

    return GenerationParameters(seed=5, num_inference_steps=2, guidance_scale=7.5, width=SIZE, height=SIZE)


def served_items(adapters) -> list:
    from model_worker.model.runners import GenerationItem

    return [GenerationItem("a lighthouse", 5, adapters=adapters)]


def denoiser_only(data: bytes, component: str = "unet") -> bytes:
    """The file's denoiser part (a compiled model refuses text-encoder layers); kohya names it `lora_unet_` in
    every family."""
    from safetensors.torch import load, save

    return save({k: v for k, v in load(data).items() if k.startswith((f"{component}.", "lora_unet_"))})


def mixed_ranks(data: bytes, rank: int = 8, modules: int = 3) -> bytes:
    """A kohya file with its first `modules` pairs redrawn at `rank` (one alpha for all: scalings differ per layer)."""
    import torch
    from safetensors.torch import load, save

    tensors = load(data)
    generator = torch.Generator().manual_seed(11)
    for name in sorted({key.split(".")[0] for key in tensors if key.endswith(".lora_down.weight")})[:modules]:
        down, up = tensors[f"{name}.lora_down.weight"], tensors[f"{name}.lora_up.weight"]
        tensors[f"{name}.lora_down.weight"] = torch.randn(rank, *down.shape[1:], generator=generator) / 4
        tensors[f"{name}.lora_up.weight"] = torch.randn(up.shape[0], rank, *up.shape[2:], generator=generator) / 2
    return save(tensors)


def test_a_compiled_models_slots_swap_adapters_in_place_and_equal_diffusers(pipelines, monkeypatch):
    """The hotswap wiring on an eager model: every slot is made up front on every Linear and Conv2d layer (zeros:
    the base image, exactly), an adapter is swapped into its slot's existing modules, every slot stays active with
    its scale written into PEFT's scaling tensors (so nothing a compiled graph was traced with changes), each
    layer's scaling is the file's own (kohya alphas and ranks that differ per layer), and each image is
    diffusers' own for the set. A swap that fails part-way leaves the slot empty and the base model."""
    import diffusers
    import torch
    from peft.utils import hotswap

    from model_worker.adapters.lora import LoraSets, Slots

    directory, _ = pipelines["sd15"]
    files = {name: denoiser_only(peft_file(directory, seed, rank)) for name, seed, rank in (("ink", 1, 4), ("neon", 2, 8),
                                                                                        ("dots", 3, 4))}  # fmt: skip
    files["locon"] = denoiser_only(kohya_file(directory, "sd15", seed=4, conv=True))  # alpha 8 on convs, 2 elsewhere
    files["mixed"] = mixed_ranks(denoiser_only(kohya_file(directory, "sd15", seed=5)))  # ranks 8 and 4, one alpha
    pipeline = diffusers.StableDiffusionPipeline.from_pretrained(directory)
    pipeline.set_progress_bar_config(disable=True)

    def image():
        pending = request("hot", FAMILIES["sd15"], steps=2, guidance=7.5, seed=5)  # one prompt for every image
        pending.request.parameters.width = pending.request.parameters.height = SIZE
        return pending, pipeline(**reference_kwargs(pending)).images

    def weights(name: str):
        return loaded("sd15", pipelines, files, {name: 1.0}).loaded[0][0]

    _, base = image()  # the plain pipeline, before any slot
    targets = sum(1 for m in pipeline.unet.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    sets = LoraSets(pipeline, ("unet", "text_encoder"), device_cache=4, slots=Slots(2, POLICY.max_rank, "unet"))
    assert pipeline.get_list_adapters() == {"unet": ["slot_0", "slot_1"]}
    layers = [m for m in pipeline.unet.modules() if "slot_0" in getattr(m, "lora_A", {})]
    assert len(layers) == targets, "a Linear or Conv2d layer has no slot (an adapter on it could not swap in)"
    modules = {(id(m), slot): (id(m.lora_A[slot]), id(m.lora_B[slot])) for m in layers for slot in m.lora_A}
    assert np.array_equal(image()[1], base), "the empty slots changed the base image"
    for names, scales in ((["ink"], [0.8]), (["neon"], [0.8]), (["ink", "dots"], [0.8, -0.6]), (["neon"], [0.0]),
                          (["dots", "ink"], [0.5, 0.5]), (["locon"], [0.7]), (["mixed", "neon"], [0.9, 0.4]),
                          ([], [])):  # fmt: skip
        sets.activate([(weights(name), scale) for name, scale in zip(names, scales, strict=True)])
        now = {(id(m), slot): (id(m.lora_A[slot]), id(m.lora_B[slot])) for m in layers for slot in m.lora_A}
        assert now == modules, "a swap made new LoRA modules (a compiled model would recompile)"
        assert all(isinstance(m.scaling[s], torch.Tensor) for m in layers for s in m.scaling), "a scaling is a float"
        assert all(m.active_adapters == ["slot_0", "slot_1"] and not m.disable_adapters for m in layers)
        pending, got = image()
        if any(scales):
            chosen = {name: files[name] for name in names}
            assert_close(got, reference_with(pipelines, "sd15", pending, chosen, dict(zip(names, scales, strict=True))))
        else:
            assert np.array_equal(got, base)
    [(with_text, _)] = loaded("sd15", pipelines, {"inked-text": peft_file(directory, 1, 4)}, {"inked-text": 0.8}).loaded
    with pytest.raises(ValueError, match="changes a text encoder: a compiled model serves adapters that change the "):
        sets.activate([(with_text, 0.8)])
    assert np.array_equal(image()[1], base)

    swap = hotswap.hotswap_adapter_from_state_dict

    def fails_part_way(model, state_dict, adapter_name, *args, **kwargs):
        swap(model, state_dict, adapter_name, *args, **kwargs)  # the slot now holds the new weights ...
        if adapter_name == "slot_1":
            raise RuntimeError("the device ran out of memory")  # ... and the load fails after them

    monkeypatch.setattr(hotswap, "hotswap_adapter_from_state_dict", fails_part_way)
    with pytest.raises(ValueError, match="adapter dots@1 could not be swapped into a compiled model's slot: the dev"):
        sets.activate([(weights("ink"), 0.8), (weights("dots"), 0.5)])
    assert np.array_equal(image()[1], base), "a failed swap left part of an adapter running"
    now = {(id(m), slot): (id(m.lora_A[slot]), id(m.lora_B[slot])) for m in layers for slot in m.lora_A}
    assert now == modules, "diffusers deleted the failed slot's layers"
    assert all(not m.lora_B["slot_1"].weight.any() for m in layers), "the failed slot kept weights"
    monkeypatch.undo()
    sets.activate([(weights("dots"), 0.5)])
    pending, got = image()
    assert_close(got, reference_with(pipelines, "sd15", pending, {"dots": files["dots"]}, {"dots": 0.5}))


@pytest.mark.parametrize("family", ["sdxl", "flux-dev", "sd35", *NEW_FAMILIES])
def test_every_familys_slots_leave_the_base_image_and_swap_adapters_as_diffusers_loads_them(pipelines, family):
    """The slots on the other families' denoisers (SDXL's UNet, FLUX.1's, SD 3.5's and the 2026 families'
    transformers): empty, the base image bit for bit; a PEFT file and a kohya one (LoCon on SDXL, BFL names on
    FLUX.1; a second PEFT file of another rank where the family takes PEFT only), alone and together, diffusers' own
    images; the base model again after them."""
    import diffusers
    import torch
    from safetensors.torch import load

    from model_worker.adapters.lora import LoraSets, Slots

    directory, reference = pipelines[family]
    spec = FAMILIES[family]
    component = "unet" if family == "sdxl" else "transformer"
    peft_only = family == "sd35" or family in NEW_FAMILIES
    second = peft_file(directory, 2, 8) if peft_only else kohya_file(directory, family, 3, conv=family == "sdxl")
    files = {"ink": denoiser_only(peft_file(directory, 1, 4), component), "other": denoiser_only(second, component)}
    left_out = {key: None for c in spec.without for key in (c, c.replace("text_encoder", "tokenizer"))}
    pipeline = getattr(diffusers, spec.pipeline).from_pretrained(directory, **left_out)
    pipeline.set_progress_bar_config(disable=True)
    guidance = 0.0 if spec.guidance_mode == "none" else 3.5

    def image(pipe):
        return pipe(prompt="a lighthouse", num_inference_steps=2, guidance_scale=guidance, width=SIZE, height=SIZE,
                    generator=torch.Generator().manual_seed(5), output_type="np").images  # fmt: skip

    base = image(pipeline)
    sets = LoraSets(pipeline, spec.family.lora_components, device_cache=4, slots=Slots(2, POLICY.max_rank, component))
    assert np.array_equal(image(pipeline), base), "the empty slots changed the base image"
    for scales in ({"ink": 0.8}, {"other": 0.7}, {"ink": 0.8, "other": -0.5}):
        sets.activate(loaded(family, pipelines, files, scales).loaded)
        for name in scales:
            reference.load_lora_weights(load(files[name]), adapter_name=name)
        try:
            reference.set_adapters(list(scales), list(scales.values()))
            assert_close(image(pipeline), image(reference))
        finally:
            reference.delete_adapters(list(scales))
    sets.activate([])
    assert np.array_equal(image(pipeline), base)


def test_a_compiled_model_serves_adapters_without_compiling_after_its_warm_up(pipelines):
    """torch.compile with the eager backend (Dynamo's tracing and guards, as with inductor, without code generation:
    seconds on CPU) at one batch bucket: the warm-up traces the model with its empty slots; then a base request,
    an adapter, a switch to another, two at once and the base model again, each through the worker's device loop,
    add no graph (no recompile), and each image is diffusers' own (the base one with the slots at 0)."""
    import torch
    from torch._dynamo.utils import counters

    from model_worker.model.pipeline import DiffusionRunner

    directory = pipelines["sd15"][0]
    files = {"ink": denoiser_only(peft_file(directory, 1, 4)), "neon": denoiser_only(peft_file(directory, 2, 8))}
    spec = FAMILIES["sd15"]
    spec = spec.model_copy(update={"max_batch_size": 1, "scheduling": "step",
                                   "defaults": spec.defaults.model_copy(update={"width": SIZE, "height": SIZE})})  # fmt: skip
    torch._dynamo.reset()
    try:
        runner = DiffusionRunner(spec, directory, torch_threads=1, compile_unet=True, compile_backend="eager")
        warm = counters["stats"]["unique_graphs"]
        runner.warm_up()
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > warm, "the warm-up compiled nothing"
        base, pending, _ = served(pipelines, "sd15", "step", runner, images=1)
        assert_close(base, reference_images({"sd15": pipelines["sd15"]}, "sd15", pending))
        for scales in ({"ink": 0.8}, {"neon": -0.5}, {"ink": 0.8, "neon": 0.5}):
            adapters = loaded("sd15", pipelines, files, scales)
            images, pending, _ = served(pipelines, "sd15", "step", runner, adapters, images=1)
            assert counters["stats"]["unique_graphs"] == graphs, f"{scales} compiled the model again"
            assert_close(images, reference_with(pipelines, "sd15", pending, files, scales))
            assert differs(images, base) > VISIBLE
        again, _, _ = served(pipelines, "sd15", "step", runner, images=1)
        assert np.array_equal(np.asarray(again), np.asarray(base))
        assert counters["stats"]["unique_graphs"] == graphs, "the base model after adapters compiled again"
    finally:
        torch._dynamo.reset()


def reference_kwargs(pending) -> dict:
    import torch

    params = pending.request.parameters
    [item] = pending.items
    return {"prompt": item.prompt, "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale, "width": params.width, "height": params.height,
            "generator": torch.Generator().manual_seed(item.seed), "output_type": "np"}  # fmt: skip


def test_a_unit_without_adapters_never_runs_on_another_units_lora_layers(pipelines):
    """Two units on the same weights, one without adapters (loaded first) and one with: the worker gives the second
    components of its own (not the first's, which it would fill with LoRA layers), so after the second ran an
    adapter the first still makes the base image, exactly; units that are alike share one copy."""
    from types import SimpleNamespace

    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.serving.service import WorkerService

    directory = pipelines["sd15"][0]
    with_lora = FAMILIES["sd15"]
    plain = with_lora.model_copy(update={"name": "sd15-plain", "adapters": None})
    worker = SimpleNamespace(
        _loaded={},
        settings=SimpleNamespace(torch_compile=False, torch_threads=1),
        _download_and_load=lambda spec: DiffusionRunner(spec, directory, torch_threads=1),
    )
    plain_runner = WorkerService._load_diffusers(worker, plain)
    lora_runner = WorkerService._load_diffusers(worker, with_lora)
    alike = WorkerService._load_diffusers(worker, plain.model_copy(update={"name": "sd15-plain-2"}))
    assert alike._pipeline.unet is plain_runner._pipeline.unet  # alike units share one copy
    base, _, _ = served(pipelines, "sd15", "step", runner=plain_runner)
    adapters = loaded("sd15", pipelines, {"ink": peft_file(directory, 1, 4)}, {"ink": 1.0})
    inked, _, _ = served(pipelines, "sd15", "step", runner=lora_runner, adapters=adapters)
    assert differs(inked, base) > VISIBLE
    again, _, _ = served(pipelines, "sd15", "step", runner=plain_runner)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(again, base, strict=True)), (
        "the unit without adapters ran with another unit's adapter"
    )
    with pytest.raises(ValueError, match="cannot share sd15-plain's components"):
        DiffusionRunner(with_lora, directory, torch_threads=1, share=plain_runner)


def registry_over(pipelines, family: str, files: dict[str, bytes]):
    """The admin registration's registry over a bucket holding the family's tiny base weights and `files` (name ->
    the adapter's file, version 1)."""
    from contract.stores.adapter_registry import AdapterRegistry

    spec = FAMILIES[family]
    directory = pipelines[family][0]
    objects = {f"{spec.weights_path.rstrip('/')}/{path}": (directory / path).read_bytes()
               for path in BASE_FILES.values() if (directory / path).exists()}  # fmt: skip
    objects |= {naming.adapter_prefix(spec.name, name, "1") + naming.ADAPTER_FILE: data for name, data in files.items()}
    return spec, AdapterRegistry(FakeBucket(objects))


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_lora_for_another_family_or_in_a_layout_it_does_not_take_is_refused_at_registration(pipelines, family):
    """Registration checks the file against the family's own base transformer: its own adapter is taken (with its
    rank and targets); another 2026 family's, an SD 1.5 one (a UNet and a text encoder), one with text-encoder
    layers (diffusers loads none into these families' encoders) and a kohya-layout one are refused, each naming why."""
    from safetensors.torch import load, save

    from contract.lora_files import AdapterFileError

    own = peft_file(pipelines[family][0], 1, 4)
    other = next(name for name in NEW_FAMILIES if name != family)
    parts = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}
    kohya = {"lora_unet_" + key.removeprefix("transformer.")[: -len(part) - 1].replace(".", "_") + f".{kohya_part}": value
             for key, value in load(own).items() for part, kohya_part in parts.items() if key.endswith(part)}  # fmt: skip
    tensors = load(own)
    module = next(key for key in tensors if key.endswith(".lora_A.weight")).removesuffix(".lora_A.weight")
    with_text = tensors | {f"text_encoder.layers.0.self_attn.q_proj.{part}.weight": tensors[f"{module}.{part}.weight"].clone()
                           for part in ("lora_A", "lora_B")}  # fmt: skip
    files = {
        "own": own,
        "other-family": peft_file(pipelines[other][0], 1, 4),
        "sd15": peft_file(pipelines["sd15"][0], 1, 4),
        "text-encoder": save(with_text),
        "kohya": save(kohya),
    }
    spec, registry = registry_over(pipelines, family, files)
    record = registry.register(spec, "own", "1")
    assert (record.rank, record.targets) == (4, sum(1 for key in load(own) if key.endswith("lora_A.weight")))
    reasons = {
        "other-family": "no such module in the base model|does not match the base model",
        "sd15": "the base model has no (text_encoder|unet) .a LoRA for another family",
        "text-encoder": "the base model has no text_encoder .a LoRA for another family",
        "kohya": "a kohya-layout file; this model takes adapters in diffusers' PEFT layout only",
    }
    for name, reason in reasons.items():
        with pytest.raises(AdapterFileError, match=reason):
            registry.register(spec, name, "1")


def test_a_step_cached_model_serves_adapters_with_each_images_own_cache(pipelines):
    """Issue 54 with LoRA: the adapter set is the batch key's, the step cache each image's. A cached FLUX.1 image
    under an adapter equals diffusers' pipeline with the LoRA loaded and its First-Block-Cache hook; the base request
    after it equals the hook's base image (no residual or adapter carried over)."""
    from diffusers.hooks import FirstBlockCacheConfig

    from contract.model_spec import ModelSpec
    from model_worker.model.pipeline import DiffusionRunner

    family, threshold = "flux-dev", 0.5
    directory, reference = pipelines[family]
    cached = ModelSpec.model_validate(
        {
            **FAMILIES[family].model_dump(),
            "scheduling": "step",
            "step_cache": {"kind": "first_block", "threshold": threshold},
        }
    )
    runner = DiffusionRunner(cached, directory, torch_threads=1)
    files, scales = {"ink": peft_file(directory, 1, 4)}, {"ink": 0.8}
    rows = runner._denoiser.tail_calls.rows
    images, pending, _ = served(pipelines, family, "step", runner, loaded(family, pipelines, files, scales), images=1)
    assert runner._denoiser.tail_calls.rows - rows < 3  # of its 3 steps, some skipped the remaining blocks
    base, base_pending, _ = served(pipelines, family, "step", runner, images=1)
    reference.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        expected = reference_with(pipelines, family, pending, files, scales)
        reference.transformer.disable_cache()  # fresh: no residual of the adapter's call
        reference.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        expected_base = reference_images({family: pipelines[family]}, family, base_pending)
    finally:
        reference.transformer.disable_cache()
    assert_close(images, expected)
    assert_close(base, expected_base)
    assert differs(images, base) > VISIBLE  # the adapter reached the cached call
