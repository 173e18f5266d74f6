"""Flows in the catalog (contract/flows.py): what is refused at load, each with its message, the request contract
the API validates against, and the plans `plan_stages` resolves a request into."""

from __future__ import annotations

import pytest
import yaml

from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.flows import FlowError, plan_stages, total_steps

# An SDXL image-to-image model beside models.yaml's, for the base + refiner handoff.
REFINER = {
    **yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())["models"]["sdxl-txt2img"],
    "task": "image-to-image",
    "pipeline": "StableDiffusionXLImg2ImgPipeline",
    "weights_path": "sdxl-refiner/1",
    "adapters": None,
    "controls": None,
}
HIRES = {
    "stages": [
        {"name": "base", "model": "sd15-txt2img", "fixes": {"num_inference_steps": 8},
         "resize": {"scale": 2, "space": "pixel"}},
        {"name": "hires", "model": "sd15-img2img", "fixes": {"strength": 0.5}},
    ]
}  # fmt: skip
# A draft, then SD 1.5's inpainting model repainting it under the request's mask (issue 51).
REPAINT = {"stages": [{"name": "draft", "model": "sd15-txt2img"}, {"name": "repaint", "model": "sd15-inpaint"}]}
REFINED = {
    "stages": [
        {"name": "base", "model": "sdxl-txt2img", "output": "latent", "handoff": {"denoising_end": 0.8}},
        {"name": "refiner", "model": "sdxl-refiner", "handoff": {"denoising_start": 0.8}},
    ]
}


def catalog(tmp_path, flows: dict) -> ModelCatalog:
    overlay = tmp_path / "flows.yaml"
    overlay.write_text(yaml.safe_dump({"models": {"sdxl-refiner": REFINER}, "flows": flows}))
    return ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)


def with_stage(flow: dict, index: int, **changes) -> dict:
    stages = [dict(stage) for stage in flow["stages"]]
    stages[index].update(changes)
    return {**flow, "stages": stages}


def test_the_two_flows_load_with_their_request_contracts(tmp_path):
    loaded = catalog(tmp_path, {"sd15-hires": HIRES, "sdxl-refined": REFINED})
    hires = loaded.flow("sd15-hires").request_contract
    # The first stage's defaults; its sizes bounded so that twice them fits sd15-img2img's 1024.
    assert (hires.task, hires.defaults.width, hires.limits.max_width, hires.size_multiple) == (
        "text-to-image", 512, 512, 8,
    )  # fmt: skip
    assert "strength" not in hires.takes and {"prompt", "seed", "width", "adapters"} <= set(hires.takes)
    assert set(hires.adapters) == {"base", "hires"}
    # Control models too: a hires pass holds the same layout (a later stage takes them when its model serves them).
    assert all("controls" in loaded.flow("sd15-hires").takes(stage) for stage in ("base", "hires"))
    assert "controls" not in loaded.flow("sdxl-refined").takes("refiner")
    assert hires.max_instances_per_request == 4
    assert not loaded.flow_runs_in_one_worker(loaded.flow("sd15-hires"))  # two deployments in models.yaml
    refined = loaded.flow("sdxl-refined").request_contract
    assert (refined.limits.max_width, refined.size_multiple) == (1024, 8)  # SDXL at most 1024² on an L4 (memory plan)


@pytest.mark.parametrize(
    ("flows", "message"),
    [
        ({"sd15-hires": with_stage(HIRES, 1, model="sd15-upscaler")},
         "flow sd15-hires: stage 'hires': model 'sd15-upscaler' is not a served model"),
        ({"sd15-txt2img": HIRES}, "flow sd15-txt2img: a model has that name"),
        ({"sd15-hires": with_stage(HIRES, 1, name="base")},
         "flow sd15-hires: stage 'base': the name is used twice"),
        ({"loop": with_stage(HIRES, 1, model="loop")},
         "flow loop: stage 'hires': loop is a flow; flows do not nest"),
        ({"sd15-hires": with_stage(HIRES, 1, output="latent")},
         "flow sd15-hires: stage 'hires': the last stage's output is the flow's answer: `output: image`, not latent"),
        ({"sd15-hires": with_stage(HIRES, 1, model="sd15-txt2img", fixes={})},
         "flow sd15-hires: stage 'hires': sd15-txt2img (StableDiffusionPipeline, text-to-image) is text-to-image and "
         "cannot take the previous stage's image"),
        # SD 1.5's latent into SDXL's refiner: both 4 channels, another VAE and scaling.
        ({"mixed": {"stages": [{"name": "base", "model": "sd15-txt2img", "output": "latent"},
                               {"name": "refiner", "model": "sdxl-refiner"}]}},
         "flow mixed: stage 'base': a latent handoff from sd15-txt2img (StableDiffusionPipeline, text-to-image) to "
         "sdxl-refiner (StableDiffusionXLImg2ImgPipeline, image-to-image) crosses latent spaces"),
        # x1.5 of FLUX-sized... of 520: 780 is no multiple of 8 (sd15's default made 520 for the case).
        ({"odd": with_stage(HIRES, 0, fixes={"width": 520}, resize={"scale": 1.5, "space": "pixel"})},
         "flow odd: stage 'hires': the flow's default width 520 becomes 780 after the resizes, which sd15-img2img "
         "does not accept (a multiple of 8, at most 1024)"),
        ({"big": with_stage(HIRES, 0, fixes={"width": 768})},
         "flow big: stage 'hires': the flow's default width 768 becomes 1536 after the resizes"),
        ({"sdxl-refined": with_stage(REFINED, 1, handoff={"denoising_start": 0.7})},
         "flow sdxl-refined: stage 'refiner': denoising_start 0.7 must equal the previous stage's denoising_end (0.8)"),
        ({"sdxl-refined": with_stage(REFINED, 1, handoff=None)},
         "flow sdxl-refined: stage 'refiner': the previous stage stops at denoising_end 0.8, so this stage needs "
         "`handoff: {denoising_start: 0.8}`"),
        ({"sd15-hires": with_stage(HIRES, 0, handoff={"denoising_end": 0.8}, output="latent", resize=None)},
         "flow sd15-hires: stage 'base': sd15-txt2img (StableDiffusionPipeline, text-to-image) does not take "
         "denoising_end/denoising_start"),
        ({"sd15-hires": with_stage(HIRES, 0, resize={"scale": 2, "space": "latent"})},
         "flow sd15-hires: stage 'base': a latent-space resize needs `output: latent`"),
        ({"sd15-hires": with_stage(HIRES, 0, resize={"scale": 3, "space": "pixel"})},
         "flow sd15-hires: stages.0.resize.scale: Input should be 1.5 or 2"),
        ({"sd15-hires": with_stage(HIRES, 1, takes=["prompt", "width"])},
         "flow sd15-hires: stage 'hires': takes or fixes ['width']; a later stage's input and size are the previous "
         "stage's output"),
        ({"sd15-hires": with_stage(HIRES, 1, takes=["prompt", "strength"])},
         "flow sd15-hires: stage 'hires': both fixes and takes ['strength']"),
        ({"sd15-hires": with_stage(HIRES, 1, fixes={"strength": 2.0})},
         "flow sd15-hires: stage 'hires': fixes strength: Input should be less than or equal to 1"),
        ({"sd15-hires": with_stage(HIRES, 1, fixes={"num_inference_steps": 99})},
         "flow sd15-hires: stage 'hires': fixes num_inference_steps 99; sd15-img2img runs 1 to 50"),
        ({"sd15-hires": with_stage(HIRES, 1, fixes={"sharpness": 1})},
         "flow sd15-hires: stage 'hires': fixes ['sharpness'], which are not generation parameters"),
        ({"sdxl-refined": with_stage(REFINED, 1, takes=["prompt", "controls"])},
         "flow sdxl-refined: stage 'refiner': takes controls, but sdxl-refiner serves none"),
        ({"sd15-hires": with_stage(HIRES, 1, fixes={"strength": 0.5, "controls": []})},
         "flow sd15-hires: stage 'hires': controls are the request's (registered per model): `takes` them"),
        ({"sd15-hires": {"stages": HIRES["stages"][:1]}},
         "flow sd15-hires: stages: List should have at least 2 items"),
        # An inpaint stage repaints under the request's mask: one that does not take it has nothing to repaint under,
        # a stage of another task cannot take one, and the image it repaints is pixels, never a latent.
        ({"repaint": with_stage(REPAINT, 1, takes=["prompt", "seed"])},
         "flow repaint: stage 'repaint': sd15-inpaint (StableDiffusionInpaintPipeline, inpaint) repaints under the "
         "request's mask, so it must take `mask`"),
        ({"sd15-hires": with_stage(HIRES, 1, takes=["prompt", "mask"])},
         "flow sd15-hires: stage 'hires': takes mask, but sd15-img2img (StableDiffusionImg2ImgPipeline, "
         "image-to-image) takes none (inpaint models do)"),
        ({"repaint": with_stage(REPAINT, 0, output="latent")},
         "flow repaint: stage 'draft': sd15-inpaint (StableDiffusionInpaintPipeline, inpaint) repaints an image under "
         "the mask (its masked image is encoded from pixels), so the stage before it hands on `output: image`"),
        ({"repaint": with_stage(REPAINT, 1, fixes={"mask": "x"})},
         "flow repaint: stage 'repaint': fixes ['mask'], which are not generation parameters"),
    ],
)  # fmt: skip
def test_a_flow_that_cannot_run_is_refused_at_load_with_a_message_naming_flow_and_stage(tmp_path, flows, message):
    with pytest.raises(FlowError) as refused:
        catalog(tmp_path, flows)
    assert message in str(refused.value)


def test_plans_merge_model_defaults_the_request_and_the_fixes_and_carry_the_resized_size(tmp_path):
    loaded = catalog(tmp_path, {"sd15-hires": HIRES, "sdxl-refined": REFINED})
    flow = loaded.flow("sd15-hires")
    units = [loaded.get(stage.model) for stage in flow.stages]
    asked = {"seed": 7, "width": 256, "height": 128, "guidance_scale": 3.0, "num_inference_steps": 20, "strength": 0.9}
    base, hires = plan_stages(flow, units, asked)
    # The base's steps are fixed (8, not the asked 20); strength is not the text-to-image stage's.
    assert (base.parameters.num_inference_steps, base.parameters.width, base.parameters.strength) == (8, 256, None)
    # The hires pass: twice the size, its own model's steps (25), the fixed strength, the request's guidance.
    assert (hires.parameters.width, hires.parameters.height) == (512, 256)
    assert (hires.parameters.num_inference_steps, hires.parameters.strength) == (25, 0.5)
    assert (hires.parameters.guidance_scale, hires.parameters.seed) == (3.0, 7)
    assert (base.steps, hires.steps, total_steps([base, hires])) == (8, 12, 20)
    assert (hires.queue, hires.model_version, base.resize.scale) == ("sd15-img2img", "1", 2)
    refined = loaded.flow("sdxl-refined")
    base, refiner = plan_stages(refined, [loaded.get(s.model) for s in refined.stages], {"seed": 1})
    assert (base.steps, refiner.steps) == (24, 6)  # 30 steps cut at 0.8
    assert refiner.handoff.denoising_start == 0.8 and base.output == "latent"


def test_a_plan_refuses_a_unit_of_another_model(tmp_path):
    loaded = catalog(tmp_path, {"sd15-hires": HIRES})
    flow = loaded.flow("sd15-hires")
    with pytest.raises(FlowError, match="unit sd15-txt2img is not a version of sd15-img2img"):
        plan_stages(flow, [loaded.get("sd15-txt2img")] * 2, {"seed": 1})


def test_a_plan_refuses_a_parameter_no_request_carries(tmp_path):
    loaded = catalog(tmp_path, {"sd15-hires": HIRES})
    flow = loaded.flow("sd15-hires")
    with pytest.raises(FlowError, match=r"\['steps'\] are not request parameters"):
        plan_stages(flow, [loaded.get(stage.model) for stage in flow.stages], {"seed": 1, "steps": 4})


def test_a_flow_ending_in_an_edit_plans_the_instruction_stage_without_strength(tmp_path):
    """A FLUX.1 [schnell] draft, then a FLUX.1 Kontext edit of it: the edit stage takes the draft as its image and no
    `strength` (its image is a reference, not a start), so it runs every step it is asked; fixing one is refused."""
    draft_then_edit = {
        "stages": [
            {"name": "draft", "model": "flux-schnell"},
            {
                "name": "edit",
                "model": "flux-kontext",
                "takes": ["prompt", "seed"],
                "fixes": {"num_inference_steps": 20},
            },
        ]
    }
    loaded = catalog(tmp_path, {"draft-edit": draft_then_edit})
    flow = loaded.flow("draft-edit")
    draft, edit = plan_stages(flow, [loaded.get(stage.model) for stage in flow.stages], {"seed": 3, "strength": 0.5})
    assert (edit.parameters.strength, edit.steps, edit.parameters.guidance_scale) == (None, 20, 2.5)
    assert (draft.steps, total_steps([draft, edit])) == (4, 24)
    with pytest.raises(
        ValueError, match=r"stage 'edit': flux-kontext \(FluxKontextPipeline, edit\) takes no `strength`"
    ):
        catalog(tmp_path, {"draft-edit": with_stage(draft_then_edit, 1, fixes={"strength": 0.5})})


def test_an_inpaint_stage_takes_the_requests_mask_first_or_after_a_draft(tmp_path):
    """After a draft, the inpaint stage takes the mask (its image is the draft); first, it takes the request's image
    and mask and runs its strength's share of the steps, as a single inpaint call. The flow's contract names its
    inpaint stages, and a flow without one takes no mask."""
    inpaint_first = {"stages": [{"name": "inpaint", "model": "sd15-inpaint", "fixes": {"strength": 0.5}},
                                {"name": "hires", "model": "sd15-img2img", "fixes": {"strength": 0.5}}]}  # fmt: skip
    loaded = catalog(tmp_path, {"repaint": REPAINT, "inpaint-first": inpaint_first, "sd15-hires": HIRES})
    repaint = loaded.flow("repaint")
    assert "mask" in repaint.takes("repaint") and "mask" not in repaint.takes("draft")
    assert "image" not in repaint.request_contract.takes and repaint.request_contract.mask_stages == ("repaint",)
    draft, stage = plan_stages(repaint, [loaded.get(s.model) for s in repaint.stages], {"seed": 2, "width": 64,
                                                                                       "height": 64})  # fmt: skip
    # The inpaint model's own strength (1: the masked region from noise) and steps; the draft's size.
    assert (stage.parameters.strength, stage.steps, stage.parameters.width) == (1.0, 25, 64)
    first = loaded.flow("inpaint-first")
    assert {"image", "mask"} <= set(first.takes("inpaint")) and first.request_contract.task == "inpaint"
    assert first.request_contract.mask_stages == ("inpaint",)
    planned = plan_stages(first, [loaded.get(s.model) for s in first.stages], {"seed": 2, "num_inference_steps": 10})
    assert planned[0].steps == 5  # strength 0.5 of 10 steps: the request's image is its start
    assert loaded.flow("sd15-hires").request_contract.mask_stages == ()
