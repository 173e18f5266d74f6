"""Flows against their references: the worker's `sdxl-refined` equals diffusers' own base + refiner handoff, and
its `sd15-hires` the same stages run by hand with the same resize, alone and sharing steps with single calls, in
both schedulings (the tiny pipelines the local stack serves, their UNets' timestep made to matter).

The stages go through the worker's own intake (`FlowStages.intake`), pool, device loop and running set; the
next stage is handed on in process (latents on the device). And the oracle can tell: a handoff one step off, or a
resize skipped, misses it by far more than the tolerance.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from contract.flows import plan_stages
from contract.messages import FlowContext, InferenceRequest, RequestInstance
from emulators.stack import local_catalog
from model_worker.flows.stages import FlowStages
from model_worker.flows.state import resize_image
from model_worker.held.pool import HeldMessage
from model_worker.serving.intake import Triage
from tests.unit.family_references import tiny_pipelines
from tests.unit.test_step_scheduler import Hooked, Worker, request

CATALOG = local_catalog(test_fixtures=True)
UNITS = {name: CATALOG.get(name) for name in ("sdxl-txt2img", "sdxl-refiner", "sd15-txt2img", "sd15-img2img")}
PIXEL_TOLERANCE = 3
MUTATION_MARGIN = 3 * PIXEL_TOLERANCE
SIZE = 64
STEPS = {"sdxl-refined": 5, "sd15-hires": 6}  # few steps: a step off moves the image far
# SD 1.5's hires pass runs on the text-to-image weights (the local catalog's shared weights).
WEIGHTS = {"sd15-img2img": "sd15-txt2img"}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    built = tiny_pipelines(tmp_path_factory.mktemp("flows"), {k: v for k, v in UNITS.items() if k not in WEIGHTS})
    import diffusers

    for name, source in WEIGHTS.items():
        reference = getattr(diffusers, UNITS[name].pipeline)(**built[source][1].components)
        reference.set_progress_bar_config(disable=True)
        built[name] = (built[source][0], reference)
    return built


def runners(pipelines, scheduling: str, names) -> dict:
    """The worker's runners for the units (SD 1.5's image-to-image sharing the text-to-image's components)."""
    from model_worker.model.pipeline import DiffusionRunner

    made = {}
    for name in names:
        spec = UNITS[name].model_copy(update={"scheduling": scheduling})
        shared = made.get(WEIGHTS.get(name, ""))
        made[name] = DiffusionRunner(spec, pipelines[name][0], torch_threads=1, share=shared)
    return made


def flow_message(flow: str, request_id: str, seed: int = 5, guidance: float = 4.0):
    spec = CATALOG.flow(flow)
    asked = {
        "seed": seed,
        "width": SIZE,
        "height": SIZE,
        "guidance_scale": guidance,
        "num_inference_steps": STEPS[flow],
    }
    plans = plan_stages(spec, [CATALOG.get(stage.model) for stage in spec.stages], asked)
    body = InferenceRequest(
        request_id=request_id, model=plans[0].model, model_version=plans[0].model_version,
        instances=[RequestInstance(prompt="a lighthouse at dawn")], parameters=plans[0].parameters,
        flow=FlowContext(flow=flow, stages=plans),
    )  # fmt: skip
    return body, HeldMessage("sub", f"ack-{request_id}", {}, body.model_dump_json().encode(), 1, time.time())


def run_flow(runner_map: dict, flow: str, request_id: str = "flow", singles=(), hook=None):
    """The flow's image through the worker (stage after stage in one device loop), with `singles` (single calls)
    in the pool beside it; (outcomes, the hooked runners)."""
    hooked = {name: Hooked(runner) for name, runner in runner_map.items()}
    body, message = flow_message(flow, request_id)
    with Worker({name: hooked[name] for name in hooked}) as worker:
        stages = FlowStages(worker.outcomes, worker.pool, worker.outcomes, {name: UNITS[name] for name in hooked})
        worker.loop._finisher = stages  # the flows' finisher between the device and the recorder
        worker.loop.running._finish = stages.finish
        triage = Triage(None, None, worker.outcomes, None)
        first = stages.intake(UNITS[body.model], message, body, "normal", int((time.time() + 600) * 1000), triage.items)
        if hook is not None:
            hook(hooked, worker)
        worker.pool.add(first)
        for single in singles:
            worker.pool.add(single)
        worker.outcomes.wait(1 + len(singles))
    assert request_id in worker.outcomes.images, worker.outcomes.answered
    return worker.outcomes, hooked


def reference(pipelines, flow: str, seed: int = 5, guidance: float = 4.0, end: float = 0.8) -> np.ndarray:
    """The flow as a client runs it by hand with diffusers (one generator per call, the same seed)."""
    import torch

    prompt, steps = "a lighthouse at dawn", STEPS[flow]
    if flow == "sdxl-refined":
        latents = pipelines["sdxl-txt2img"][1](
            prompt, num_inference_steps=steps, denoising_end=end, output_type="latent", guidance_scale=guidance,
            width=SIZE, height=SIZE, generator=torch.Generator().manual_seed(seed),
        ).images  # fmt: skip
        return pipelines["sdxl-refiner"][1](
            prompt, num_inference_steps=steps, denoising_start=end, image=latents, guidance_scale=guidance,
            generator=torch.Generator().manual_seed(seed), output_type="np",
        ).images[0]  # fmt: skip
    image = pipelines["sd15-txt2img"][1](
        prompt, num_inference_steps=steps, guidance_scale=guidance, width=SIZE, height=SIZE,
        generator=torch.Generator().manual_seed(seed), output_type="np",
    ).images[0]  # fmt: skip
    hires = CATALOG.get("sd15-img2img").defaults.num_inference_steps
    return pipelines["sd15-img2img"][1](
        prompt, image=resize_image(image, 2 * SIZE, 2 * SIZE), strength=0.5, num_inference_steps=hires,
        guidance_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="np",
    ).images[0]  # fmt: skip


def difference(got, expected) -> float:
    """The largest pixel difference (of 255); an image of another size is compared at the expected one's."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if got.shape != expected.shape:
        got = np.asarray(resize_image(got, expected.shape[1], expected.shape[0]), dtype=np.float64) / 255
    return float(np.abs(got - expected).max() * 255)


class References:
    """Each flow's hand-run image, made once."""

    def __init__(self, pipelines) -> None:
        self.pipelines = pipelines
        self._made: dict = {}

    def __call__(self, flow: str) -> np.ndarray:
        if flow not in self._made:
            self._made[flow] = reference(self.pipelines, flow)
        return self._made[flow]


@pytest.fixture(scope="module")
def references(pipelines) -> References:
    return References(pipelines)


FLOW_UNITS = {"sdxl-refined": ("sdxl-txt2img", "sdxl-refiner"), "sd15-hires": ("sd15-txt2img", "sd15-img2img")}


@pytest.mark.parametrize("scheduling", ["step", "request"])
@pytest.mark.parametrize("flow", list(FLOW_UNITS))
def test_a_flow_alone_equals_its_stages_run_by_hand(pipelines, references, flow, scheduling):
    outcomes, _ = run_flow(runners(pipelines, scheduling, FLOW_UNITS[flow]), flow)
    got = outcomes.images["flow"][0]
    assert difference(got, references(flow)) <= PIXEL_TOLERANCE
    fields = outcomes.fields["flow"]
    assert (fields["model"], fields["model_version"]) == (flow, "")
    assert [(r.stage, r.index) for r in fields["stages"]] == [
        (s.name, i) for i, s in enumerate(CATALOG.flow(flow).stages)
    ]


@pytest.mark.parametrize("scheduling", ["step", "request"])
@pytest.mark.parametrize("flow", list(FLOW_UNITS))
def test_a_flow_beside_single_calls_shares_their_steps_and_still_equals_its_reference(
    pipelines, references, flow, scheduling
):
    base, later = FLOW_UNITS[flow]
    singles = [
        request("single-base", UNITS[base], steps=4, guidance=2.0, seed=11),
        request("single-later", UNITS[later], steps=4, guidance=2.0, seed=12, strength=0.6,
                image=resize_image(np.full((SIZE, SIZE, 3), 0.5), SIZE * (2 if flow == "sd15-hires" else 1),
                                   SIZE * (2 if flow == "sd15-hires" else 1))),
    ]  # fmt: skip
    if flow == "sd15-hires":
        singles[1].request.parameters.width = singles[1].request.parameters.height = 2 * SIZE
    outcomes, hooked = run_flow(runners(pipelines, scheduling, FLOW_UNITS[flow]), flow, singles=singles)
    assert set(outcomes.images) == {"flow", "single-base", "single-later"}, outcomes.answered
    if scheduling == "step":  # each stage shared its model's running set with that model's single call
        assert max(hooked[base].sizes) == 2 and max(hooked[later].sizes) == 2, (hooked[base].sizes, hooked[later].sizes)
        assert outcomes.fields["single-later"]["batch_id"] == outcomes.fields["flow"]["stages"][1].batch_id
    assert difference(outcomes.images["flow"][0], references(flow)) <= PIXEL_TOLERANCE


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_a_handoff_one_step_off_fails_the_oracle_by_far(pipelines, references, monkeypatch, scheduling):
    import contract.flows

    plan_stages_ = contract.flows.plan_stages

    def planned_early(flow, units, asked, adapters=None):
        plans = plan_stages_(flow, units, asked, adapters)
        early = round(0.8 - 1 / STEPS["sdxl-refined"], 6)
        plans[0].handoff = plans[0].handoff.model_copy(update={"denoising_end": early})
        plans[1].handoff = plans[1].handoff.model_copy(update={"denoising_start": early})
        return plans

    monkeypatch.setattr(f"{__name__}.plan_stages", planned_early)
    outcomes, _ = run_flow(runners(pipelines, scheduling, FLOW_UNITS["sdxl-refined"]), "sdxl-refined")
    off = difference(outcomes.images["flow"][0], references("sdxl-refined"))
    assert off > MUTATION_MARGIN, f"the oracle passed a handoff one step early: off by {off:.1f}/255"


@pytest.mark.parametrize("scheduling", ["step", "request"])
def test_a_skipped_resize_fails_the_oracle_by_far(pipelines, references, monkeypatch, scheduling):
    import model_worker.flows.state

    monkeypatch.setattr(
        model_worker.flows.state, "resize_image", lambda image, width, height: resize_image(image, SIZE, SIZE)
    )
    outcomes, _ = run_flow(runners(pipelines, scheduling, FLOW_UNITS["sd15-hires"]), "sd15-hires")
    off = difference(outcomes.images["flow"][0], references("sd15-hires"))
    assert off > MUTATION_MARGIN, f"the oracle passed a skipped resize: off by {off:.1f}/255"
