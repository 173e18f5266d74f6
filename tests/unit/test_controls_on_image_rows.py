"""SD 1.5 ControlNets and image prompts on image-to-image and inpaint rows, against diffusers'
`StableDiffusionControlNetImg2ImgPipeline` and `StableDiffusionControlNetInpaintPipeline` (with `load_ip_adapter` for
image prompts) on the tiny models: a request alone equals the pipeline within 1/255 in both schedulings; in a
running set mixing a ControlNet, a ControlNet with an image prompt, an image prompt and neither (guided and unguided),
each image equals its request alone and the request with neither is exactly the same running set's without any."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from contract.generation import ControlRef
from contract.messages import GenerationParameters
from emulators.stack import local_catalog
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_inpaint_family import box_mask
from tests.unit.test_model_families import differences, input_image

CATALOG = local_catalog(test_fixtures=True)
SIZE, STEPS = 64, 4
TOLERANCE = 1  # of 255: the brief's bound on the oracle


@dataclass(frozen=True)
class Task:
    model: str
    controlnet_pipeline: str
    strength: float
    masked: bool = False

    @property
    def spec(self):
        return CATALOG.get(self.model)


TASKS = {
    "image-to-image": Task("sd15-img2img", "StableDiffusionControlNetImg2ImgPipeline", strength=0.75),
    "inpaint": Task("sd15-inpaint", "StableDiffusionControlNetInpaintPipeline", strength=1.0, masked=True),
}
EDGES = [("edges", 0.8, 0.0, 0.75)]  # its window ends before the last of the image's (strength-cut) steps
STYLE = 0.7


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Both tiny pipelines (the references), a tiny ControlNet of SD 1.5's 4-channel UNet (the inpainting UNet's
    ControlNets take its latents alone) and a tiny IP-Adapter, loaded as the worker loads them."""
    from diffusers import ControlNetModel

    from emulators.tiny_controls import build_controlnet, build_ip_adapter, control_files
    from model_worker.controls.loader import ControlWeights, _build

    root = tmp_path_factory.mktemp("image-rows")
    pipelines = tiny_pipelines(root, {name: task.spec for name, task in TASKS.items()})
    plain = pipelines["image-to-image"][0]
    edges = build_controlnet(plain, root / "edges", 1)
    style = build_ip_adapter(plain, root / "style", 12)
    encoder, state_dict = _build("ip_adapter", control_files(style))
    weights = {
        "edges": ControlWeights("edges", "controlnet", "1", "e" * 8, 0, ControlNetModel.from_pretrained(edges)),
        "style": ControlWeights("style", "ip_adapter", "1", "s" * 8, 0, encoder, state_dict),
    }
    return {"pipelines": pipelines, "weights": weights, "style": style,
            "images": {"edges": input_image(21), "style": input_image(23)}}  # fmt: skip


def items_of(built, task: Task, seed: int, controls=(), style: float | None = None, images: int = 1) -> list:
    """A request's items: its input image (and mask), ControlNets (name, scale, start, end), then an image prompt."""
    from model_worker.controls.loader import ControlSet
    from model_worker.model.runners import GenerationItem

    refs = tuple(ControlRef(name=name, kind="controlnet", version="1", sha256="e" * 8, scale=scale, start=start,
                            end=end) for name, scale, start, end in controls)  # fmt: skip
    names = [name for name, *_ in controls]
    if style is not None:
        refs += (ControlRef(name="style", kind="ip_adapter", version="1", sha256="s" * 8, scale=style),)
        names.append("style")
    loaded = None
    if refs:
        loaded = ControlSet(refs, loaded=[built["weights"][name] for name in names])
        loaded.done.set()
    return [GenerationItem(prompt="a lighthouse", seed=seed + i, image=input_image(seed + 10 * i),
                           mask=box_mask(8, 8 + 8 * i, 48, 40) if task.masked else None, controls=loaded,
                           control_images=tuple(built["images"][name] for name in names))
            for i in range(images)]  # fmt: skip


def params(task: Task, guidance: float) -> GenerationParameters:
    return GenerationParameters(seed=0, num_inference_steps=STEPS, guidance_scale=guidance, width=SIZE, height=SIZE,
                                strength=task.strength)  # fmt: skip


def runner(built, name: str, scheduling: str):
    from model_worker.model.pipeline import DiffusionRunner

    spec = TASKS[name].spec.model_copy(update={"scheduling": scheduling})
    return DiffusionRunner(spec, built["pipelines"][name][0], torch_threads=1)


@pytest.fixture(scope="module")
def steppers(built) -> dict:
    return {name: runner(built, name, "step") for name in TASKS}


def stepped(stepper, task: Task, requests: list[tuple[list, float]]) -> list[list]:
    """The first request starts alone, the others join after its first step and share every call from then on."""
    running = [stepper.start_items(requests[0][0], params(task, requests[0][1]))]
    stepper.denoise_step(running[0])
    running += [stepper.start_items(items, params(task, guidance)) for items, guidance in requests[1:]]
    outputs: dict[int, list] = {}
    while len(outputs) < len(running):
        stepper.denoise_step([r for index, group in enumerate(running) if index not in outputs for r in group])
        for index, group in enumerate(running):
            if index not in outputs and all(r.finished for r in group):
                outputs[index] = stepper.decode(group)
    return [outputs[index] for index in range(len(running))]


def reference(built, name: str, items: list, guidance: float) -> list:
    """diffusers' ControlNet pipeline for the task over the tiny pipeline's components, one call per image; with the
    image prompt's IP-Adapter loaded (`load_ip_adapter` + `set_ip_adapter_scale`) when the request has one."""
    import diffusers
    import torch

    task, base = TASKS[name], built["pipelines"][name][1]
    refs = items[0].controls.refs
    nets = [ref for ref in refs if ref.kind == "controlnet"]
    prompt = next((ref for ref in refs if ref.kind == "ip_adapter"), None)
    (net,) = nets
    pipe = getattr(diffusers, task.controlnet_pipeline)(**base.components, controlnet=built["weights"]["edges"].model)
    pipe.set_progress_bar_config(disable=True)
    extra = {}
    if prompt is not None:
        pipe.load_ip_adapter(str(built["style"]), subfolder="", weight_name="ip_adapter.safetensors")
        pipe.set_ip_adapter_scale(prompt.scale)
        extra["ip_adapter_image"] = built["images"]["style"]
    try:
        return [pipe(prompt=item.prompt, image=item.image, control_image=built["images"]["edges"],
                     **({"mask_image": item.mask} if task.masked else {}), strength=task.strength, height=SIZE,
                     width=SIZE, num_inference_steps=STEPS, guidance_scale=guidance,
                     controlnet_conditioning_scale=net.scale, control_guidance_start=net.start,
                     control_guidance_end=net.end, generator=torch.Generator().manual_seed(item.seed),
                     output_type="np", **extra).images[0] for item in items]  # fmt: skip
    finally:
        if prompt is not None:
            pipe.unload_ip_adapter()


@pytest.mark.parametrize("scheduling", ["step", "request"])
@pytest.mark.parametrize("name", list(TASKS))
def test_controls_alone_equal_diffusers_controlnet_pipeline_for_the_task(built, steppers, name, scheduling):
    task = TASKS[name]
    serve = steppers[name] if scheduling == "step" else runner(built, name, scheduling)

    def served(items, guidance):
        if scheduling == "step":
            return stepped(serve, task, [(items, guidance)])[0]
        return serve.generate(items, params(task, guidance), lambda step, total: None)

    controlled = items_of(built, task, 5, EDGES, images=2)
    got = served(controlled, 6.0)
    assert differences(got, reference(built, name, controlled, 6.0)) <= TOLERANCE
    both = items_of(built, task, 7, EDGES, style=STYLE)
    prompted = served(both, 6.0)
    assert differences(prompted, reference(built, name, both, 6.0)) <= TOLERANCE
    # The oracle can tell: the ControlNet, and the image prompt beside it, visibly steer the image.
    assert differences(got, served(items_of(built, task, 5, images=2), 6.0)) > 10
    assert differences(prompted, served(items_of(built, task, 7, EDGES), 6.0)) > 2


@pytest.mark.parametrize("name", list(TASKS))
def test_a_mixed_running_set_of_controlled_image_rows_equals_each_alone(built, steppers, name):
    task, stepper = TASKS[name], steppers[name]
    mixed = [(items_of(built, task, 3, EDGES), 6.0), (items_of(built, task, 9, EDGES, style=1.3, images=2), 1.0),
             (items_of(built, task, 12), 6.0), (items_of(built, task, 4, style=STYLE), 6.0)]  # fmt: skip
    got = stepped(stepper, task, mixed)
    for (items, guidance), images in zip(mixed, got, strict=True):
        (alone,) = stepped(stepper, task, [(items, guidance)])
        assert differences(images, alone) <= TOLERANCE
    # The same running set without any control: the request with neither gets exactly the same image.
    plain = [(items_of(built, task, items[0].seed, images=len(items)), guidance) for items, guidance in mixed]
    assert np.array_equal(stepped(stepper, task, plain)[2][0], got[2][0])
