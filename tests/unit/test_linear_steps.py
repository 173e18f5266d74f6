"""The step-level scheduler step of a running set against diffusers' own schedulers, and without host reads.

For every scheduler the catalog lets a model step per item, images with different step counts, one joining two
steps after the others, are stepped by `Denoiser.step_items` (vectorised where the scheduler is one formula,
`linear_steps`) and, beside them, each by its own diffusers scheduler called as the pipeline calls it: the latents
must agree at every step. And one step of the running set, its latents and predictions on the `meta` device (which
has no values: any `.item()`, `bool()`, `.tolist()` or copy to the host of them raises), reads nothing back; on a
machine with CUDA the same step runs on the GPU under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import pytest

from bench.scheduler_steps import FLOW_CONFIG, SCHEDULERS, UNET_CONFIG
from model_worker.model.families.base import Denoiser
from model_worker.model.runners import GenerationItem, RunningItem

# Every scheduler the catalog lets a model step per item, all of them stepped for the whole set at once.
VECTORISED = set(SCHEDULERS)
SHAPE = (1, 4, 8, 8)


def new_scheduler(name: str, steps: int, overrides: dict | None = None, begin: int = 0):
    """The image's scheduler as the pipeline sets it; `begin` > 0 starts it there, as image-to-image does."""
    import diffusers

    config = {**(FLOW_CONFIG if name.startswith("FlowMatch") else UNET_CONFIG), **(overrides or {})}
    scheduler = getattr(diffusers, name).from_config(config)
    scheduler.set_timesteps(steps)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(begin)
    return scheduler


def scale(scheduler, x, t):
    """The model's input as the pipeline makes it (flow matching scales nothing)."""
    return scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x


def step_kwargs(scheduler, seed: int) -> dict:
    """The pipeline's `prepare_extra_step_kwargs`: eta 0 and the image's generator where the step takes them."""
    import inspect

    import torch

    accepted = set(inspect.signature(scheduler.step).parameters)
    kwargs = {"eta": 0.0} if "eta" in accepted else {}
    if "generator" in accepted:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return kwargs


def prediction(x, t):
    """A stand-in model: a smooth function of its input and timestep (what matters is that both sides get one)."""
    import torch

    return torch.tanh(x * 0.7 + 0.001 * float(t)) * 0.9


def running_item(name: str, steps: int, seed: int, device: str = "cpu", overrides=None, begin=0) -> RunningItem:
    import torch

    scheduler = new_scheduler(name, steps, overrides, begin)
    latents = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(device)
    state = {
        "scheduler": scheduler, "timesteps": scheduler.timesteps[begin:].to(device), "latents": latents,
        "step_kwargs": step_kwargs(scheduler, seed),
    }  # fmt: skip
    total = len(scheduler.timesteps) - begin
    return RunningItem(GenerationItem(prompt="p", seed=seed), total=total, requested=total, state=state)


def reference(name: str, steps: int, seed: int, overrides=None, begin=0) -> list:
    """The image's latents after each step, its own diffusers scheduler stepped as the pipeline steps it."""
    import torch

    scheduler = new_scheduler(name, steps, overrides, begin)
    kwargs = step_kwargs(scheduler, seed)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    out = []
    for t in scheduler.timesteps[begin:]:
        eps = prediction(scale(scheduler, x, t), t)
        x = scheduler.step(eps, t, x, **kwargs, return_dict=False)[0]
        out.append(x)
    return out


def denoiser() -> Denoiser:
    return Denoiser.__new__(Denoiser)  # prepared and step_items use no pipeline


def model_inputs(running: list[RunningItem]) -> list:
    from model_worker.model.families.linear_steps import scaled_input

    return [
        scaled_input(r, r.state["latents"])
        if r.state["linear"] is not None
        else scale(r.state["scheduler"], r.state["latents"], r.state["step_timesteps"][r.done])
        for r in running
    ]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_the_running_sets_step_equals_each_images_own_diffusers_scheduler(name):
    # (steps, seed, the step of the others at which it joins)
    assert_steps_equal_diffusers(name, [(5, 1, 0), (8, 2, 0), (6, 3, 2)])
    assert (worker_linear(name) is not None) == (name in VECTORISED)


# The multistep schedulers' other configurations the formula covers: prediction types, DPM-Solver's solver type,
# order, sigmas and final step, long schedules (DPM-Solver's lower-order final step only under 15 steps), and
# images starting part-way into their schedule (image-to-image's strength).
VARIANTS = [
    ("PNDMScheduler", {"prediction_type": "v_prediction"}, 0),
    ("PNDMScheduler", {"timestep_spacing": "trailing"}, 0),
    ("PNDMScheduler", {}, 3),
    ("DPMSolverMultistepScheduler", {"prediction_type": "v_prediction"}, 0),
    ("DPMSolverMultistepScheduler", {"solver_type": "heun", "use_karras_sigmas": True}, 0),
    ("DPMSolverMultistepScheduler", {"final_sigmas_type": "sigma_min", "lower_order_final": False}, 0),
    ("DPMSolverMultistepScheduler", {"euler_at_final": True, "timestep_spacing": "trailing"}, 0),
    ("DPMSolverMultistepScheduler", {"solver_order": 1}, 0),
    ("DPMSolverMultistepScheduler", {"prediction_type": "sample"}, 0),
    (
        "DPMSolverMultistepScheduler",
        {"use_flow_sigmas": True, "prediction_type": "flow_prediction", "flow_shift": 3.0},
        0,
    ),
    ("DPMSolverMultistepScheduler", {}, 4),
]


@pytest.mark.parametrize(("name", "overrides", "begin"), VARIANTS)
def test_the_multistep_schedulers_other_configurations_equal_diffusers(name, overrides, begin):
    assert_steps_equal_diffusers(name, [(9, 1, 0), (20, 2, 0), (16, 3, 3)], overrides, begin)
    assert denoiser().prepared([running_item(name, 20, 1, overrides=overrides)])[0].state["linear"] is not None


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("PNDMScheduler", {"skip_prk_steps": False}), ("DPMSolverMultistepScheduler", {"solver_order": 3}),
     ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"})],
)  # fmt: skip
def test_configurations_outside_the_formula_keep_their_own_scheduler_and_still_equal_diffusers(name, overrides):
    assert denoiser().prepared([running_item(name, 20, 1, overrides=overrides)])[0].state["linear"] is None
    if overrides.get("algorithm_type") is None:  # the SDE draws from the global generator: no oracle
        assert_steps_equal_diffusers(name, [(20, 1, 0), (16, 3, 3)], overrides)


def assert_steps_equal_diffusers(name: str, plan: list, overrides=None, begin: int = 0) -> None:
    """Steps the running set, images joining at their step of the clock, and compares every image's latents after
    every step with its own diffusers scheduler's."""
    import torch

    worker = denoiser()
    expected = {seed: reference(name, steps, seed, overrides, begin) for steps, seed, _ in plan}
    running: list[RunningItem] = []
    clock = 0
    while clock == 0 or running:
        joining = [running_item(name, s, seed, overrides=overrides, begin=begin) for s, seed, j in plan if j == clock]
        running += worker.prepared(joining)
        inputs = model_inputs(running)
        predictions = [prediction(x, r.state["step_timesteps"][r.done]) for r, x in zip(running, inputs, strict=True)]
        worker.step_items(running, predictions)
        for r in running:
            assert r.failure is None
            want = expected[r.item.seed][r.done - 1]
            assert torch.allclose(r.state["latents"], want, atol=1e-4, rtol=1e-4), (name, r.item.seed, r.done)
        running = [r for r in running if r.done < r.total]
        clock += 1


def worker_linear(name: str):
    return denoiser().prepared([running_item(name, 4, 1)])[0].state["linear"]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_step_of_the_running_set_reads_nothing_back_from_the_device(name):
    """Latents, timesteps and predictions on `meta`: a host read of any of them raises."""
    import torch

    worker = denoiser()
    running = worker.prepared([running_item(name, steps, seed) for steps, seed in ((5, 1), (8, 2))])
    for r in running:  # the images joined on the host; from here on their tensors are the device's
        r.state["latents"] = r.state["latents"].to("meta")
        r.state["timesteps"] = r.state["timesteps"].to("meta")
        for key in ("linear", "noise"):
            if r.state.get(key) is not None:
                r.state[key] = r.state[key].to("meta")
    for _ in range(3):  # PNDM and DPM-Solver take other branches on their first steps
        inputs = model_inputs(running)
        worker.step_items(running, [torch.tanh(x) for x in inputs])
        failures = [r.failure for r in running if r.failure is not None]
        assert not failures, failures


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_step_of_the_running_set_copies_nothing_from_the_host(name, monkeypatch):
    """Counting mode: every host-to-device copy during a step is counted (on CUDA a copy from pageable memory stops
    the host). Euler ancestral and LCM draw their noise on each image's CPU generator: drawn for all its steps when
    the image joins, and copied then, never per step."""
    import torch

    worker = denoiser()
    running = worker.prepared([running_item(name, steps, seed) for steps, seed in ((5, 1), (8, 2))])
    for r in running:
        for key in ("latents", "timesteps", "linear", "noise"):
            if r.state.get(key) is not None:
                r.state[key] = r.state[key].to("meta")
    copies = []
    to = torch.Tensor.to

    def counted_to(self, *args, **kwargs):
        moved = to(self, *args, **kwargs)
        if self.device.type == "cpu" and moved.device.type != "cpu":
            copies.append(tuple(self.shape))
        return moved

    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    for _ in range(3):
        inputs = model_inputs(running)
        worker.step_items(running, [torch.tanh(x) for x in inputs])
        assert not [r.failure for r in running if r.failure is not None]
    assert copies == []


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
@pytest.mark.parametrize("name", SCHEDULERS)
def test_on_cuda_a_step_makes_no_host_sync(name):
    import torch

    worker = denoiser()
    running = worker.prepared([running_item(name, steps, seed, "cuda") for steps, seed in ((5, 1), (8, 2))])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            inputs = model_inputs(running)
            worker.step_items(running, [torch.tanh(x) for x in inputs])
            assert not [r.failure for r in running if r.failure is not None]
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_step_launches_as_many_operations_for_eight_images_as_for_two(name):
    """The scheduler arithmetic of the whole running set at once: the non-view operations of a step (each a kernel
    launch on a GPU) do not grow with the images in it (`bench/scheduler_steps.py` prints them)."""
    from bench.scheduler_steps import measure

    two, eight = (measure(name, images, 8, "cpu", vectorised=True)["operations"] for images in (2, 8))
    assert eight == two, (name, two, eight)
    per_image = measure(name, 8, 8, "cpu", vectorised=False)["operations"]
    assert per_image > eight or name == "FlowMatchEulerDiscreteScheduler", (name, per_image, eight)
