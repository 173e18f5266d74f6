"""Scheduler steps that are one formula, done for the whole running set at once without reading the device.

Diffusers' DDIM (eta 0), Euler, Euler ancestral, flow-matching Euler and LCM steps are, for one image,
`x_prev = a * x + b * eps + c * noise` (Euler's and Euler ancestral's model input scaled by `1 / sqrt(sigma^2 + 1)`),
where `a`, `b`, `c` and the input scale depend only on the image's schedule and its step. They are computed once per
image when it joins, from its own diffusers scheduler after `set_timesteps` (Python numbers, then one small tensor
on the device), so a step of the running set gathers each image's coefficients by index on the device and runs one
multiply-add for all images: no `.item()`, no comparison of a device tensor in Python, no per-image scheduler call.
Each image's coefficients are exactly the ones its diffusers scheduler would apply (tests/unit/test_linear_steps.py
compares them step by step).

The stochastic two (Euler ancestral, LCM) add noise each step, which diffusers draws from the image's own CPU
generator and copies to the device with a blocking copy, a host sync a step. Here an image's noise for all its
steps is drawn when it joins, from the same generator in the same order and dtype as diffusers draws it (so the
images stay diffusers' at the same seed), and copied to the device once; a step indexes it.

A scheduler, or a configuration, outside this formula (PNDM, DPM-Solver++ 2M, DDIM with eta, clipping or
thresholding, a stochastic step without a generator) returns None here and keeps its own diffusers scheduler,
stepped per image with its timesteps as Python numbers (`Denoiser.step_items`), which keeps their arithmetic on the
host's scalars.
"""

from __future__ import annotations

import math
from typing import Any

# The scheduler classes the formula covers, and the configurations it covers them in.
LINEAR_SCHEDULERS = frozenset(
    {"DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "FlowMatchEulerDiscreteScheduler",
     "LCMScheduler"}
)  # fmt: skip
# Those whose step adds noise drawn from the image's generator (the fourth coefficient, `c`).
NOISED_SCHEDULERS = frozenset({"EulerAncestralDiscreteScheduler", "LCMScheduler"})
Coefficients = tuple[float, float, float, float]  # (input scale, a, b, c)


def linear_coefficients(scheduler, timesteps: list, step_kwargs: dict[str, Any]) -> list[Coefficients] | None:
    """Per step of this image's `timesteps` (its scheduler's from its `begin_index`): (input scale, a, b, c), or None
    when the scheduler or its configuration is not the plain formula."""
    name = type(scheduler).__name__
    if name not in LINEAR_SCHEDULERS:
        return None
    if name in NOISED_SCHEDULERS and step_generator(step_kwargs) is None:
        return None  # noise from the global generator: left to diffusers, as the pipeline would draw it
    config = scheduler.config
    begin, steps = getattr(scheduler, "begin_index", None) or 0, len(timesteps)
    if name == "DDIMScheduler":
        return ddim_coefficients(scheduler, timesteps, step_kwargs)
    if name == "LCMScheduler":
        return lcm_coefficients(scheduler, begin, steps)
    if name in ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler"):
        if config.prediction_type not in ("epsilon", "v_prediction") or step_kwargs.get("s_churn", 0.0):
            return None
        sigmas = scheduler.sigmas.tolist()
        out = []
        for k in range(begin, begin + steps):
            sigma, following = sigmas[k], sigmas[k + 1]
            up = 0.0
            if name == "EulerAncestralDiscreteScheduler":  # steps to sigma_down, then adds sigma_up of noise
                up = (following**2 * (sigma**2 - following**2) / sigma**2) ** 0.5
                following = (following**2 - up**2) ** 0.5
            scale = 1 / math.sqrt(sigma**2 + 1)
            dt = following - sigma
            if config.prediction_type == "epsilon":  # x0 = x - sigma eps; x' = x + (x - x0) / sigma * dt
                out.append((scale, 1.0, dt, up))
            else:  # x0 = eps * (-sigma / sqrt(sigma^2 + 1)) + x / (sigma^2 + 1)
                skip, gain = 1 / (sigma**2 + 1), -sigma * scale
                out.append((scale, 1 + (1 - skip) * dt / sigma, -gain * dt / sigma, up))
        return out
    if config.get("stochastic_sampling", False) or getattr(scheduler, "_per_token_timesteps", None) is not None:
        return None
    sigmas = scheduler.sigmas.tolist()  # flow matching: x' = x + (sigma_next - sigma) v
    return [(1.0, 1.0, sigmas[k + 1] - sigmas[k], 0.0) for k in range(begin, begin + steps)]


def lcm_coefficients(scheduler, begin: int, steps: int) -> list[Coefficients] | None:
    """LCM: denoised = c_out x0 + c_skip x; x' = sqrt(a_prev) denoised + sqrt(1 - a_prev) noise, or the denoised
    itself at the schedule's last step (diffusers draws no noise there)."""
    config = scheduler.config
    if config.thresholding or config.clip_sample or config.prediction_type not in ("epsilon", "v_prediction", "sample"):
        return None
    alphas, schedule = scheduler.alphas_cumprod.tolist(), [int(t) for t in scheduler.timesteps.tolist()]
    final = float(scheduler.final_alpha_cumprod)
    out = []
    for index in range(begin, begin + steps):
        t = schedule[index]
        previous = schedule[index + 1] if index + 1 < len(schedule) else t
        a_t = alphas[t]
        a_prev = alphas[previous] if previous >= 0 else final
        c_skip, c_out = (float(c) for c in scheduler.get_scalings_for_boundary_condition_discrete(t))
        if config.prediction_type == "epsilon":  # x0 = (x - sqrt(1 - a_t) eps) / sqrt(a_t)
            x0_x, x0_eps = 1 / math.sqrt(a_t), -math.sqrt(1 - a_t) / math.sqrt(a_t)
        elif config.prediction_type == "v_prediction":  # x0 = sqrt(a_t) x - sqrt(1 - a_t) v
            x0_x, x0_eps = math.sqrt(a_t), -math.sqrt(1 - a_t)
        else:  # the model predicts x0
            x0_x, x0_eps = 0.0, 1.0
        a, b = c_out * x0_x + c_skip, c_out * x0_eps
        if index == scheduler.num_inference_steps - 1:
            out.append((1.0, a, b, 0.0))
        else:
            out.append((1.0, math.sqrt(a_prev) * a, math.sqrt(a_prev) * b, math.sqrt(1 - a_prev)))
    return out


def step_generator(step_kwargs: dict[str, Any]):
    """The generator the image's scheduler step draws its noise from (diffusers takes one, or a list of one)."""
    generator = step_kwargs.get("generator")
    if isinstance(generator, list):
        return generator[0] if len(generator) == 1 else None
    return generator


def noise_table(scheduler, step_kwargs: dict[str, Any], steps: int, latents):
    """An image's noise for each of its `steps`, drawn now as its diffusers scheduler would draw it step by step
    (`randn_tensor`: the latents' shape and dtype, on the generator's device, in step order), then moved to the
    latents' device once; None for a scheduler that adds none. The generator serves nothing else after the image
    joined, so the draws are the ones diffusers' own steps would make at the same seed."""
    import torch

    if type(scheduler).__name__ not in NOISED_SCHEDULERS:
        return None
    generator = step_generator(step_kwargs)
    shape, dtype = tuple(latents.shape), latents.dtype
    draws = [torch.randn(shape, generator=generator, device=generator.device, dtype=dtype) for _ in range(steps)]
    table = torch.cat(draws)
    if table.device == latents.device:
        return table
    if latents.device.type == "cuda":
        return table.pin_memory().to(latents.device, non_blocking=True)
    return table.to(latents.device)


def ddim_coefficients(scheduler, timesteps: list, step_kwargs: dict[str, Any]):
    config = scheduler.config
    if step_kwargs.get("eta", 0.0) or config.clip_sample or config.thresholding:
        return None
    if config.prediction_type not in ("epsilon", "v_prediction"):
        return None
    alphas = scheduler.alphas_cumprod.tolist()
    final = float(scheduler.final_alpha_cumprod)
    ratio = config.num_train_timesteps // scheduler.num_inference_steps
    out = []
    for t in timesteps:
        a_t = alphas[t]
        previous = t - ratio
        a_prev = alphas[previous] if previous >= 0 else final
        if config.prediction_type == "epsilon":
            # x0 = (x - sqrt(1 - a_t) eps) / sqrt(a_t); x' = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps
            a = math.sqrt(a_prev / a_t)
            b = math.sqrt(1 - a_prev) - math.sqrt(a_prev) * math.sqrt(1 - a_t) / math.sqrt(a_t)
        else:  # x0 = sqrt(a_t) x - sqrt(1 - a_t) v; eps = sqrt(a_t) v + sqrt(1 - a_t) x
            a = math.sqrt(a_prev) * math.sqrt(a_t) + math.sqrt(1 - a_prev) * math.sqrt(1 - a_t)
            b = -math.sqrt(a_prev) * math.sqrt(1 - a_t) + math.sqrt(1 - a_prev) * math.sqrt(a_t)
        out.append((1.0, a, b, 0.0))
    return out


def coefficient_table(coefficients: list[Coefficients], device):
    """The image's coefficients as one (steps, 4) float32 tensor on the device: copied once, when the image joins."""
    return host_values(coefficients, device)


def host_values(values: list, device):
    """Python numbers as a float32 tensor on the device without stopping the host: on CUDA copied from pinned
    memory asynchronously (a plain `torch.tensor(..., device="cuda")` waits for the copy)."""
    import torch

    tensor = torch.tensor(values, dtype=torch.float32)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def gathered(running, column: int):
    """Each image's coefficient of its current step, as an [N, 1, ...] device tensor of the latents' rank (views gathered by index and
    stacked: no host read)."""
    import torch

    rank = running[0].state["latents"].dim()
    return torch.stack([r.state["linear"][r.done, column] for r in running]).view(-1, *[1] * (rank - 1))


def step_linear(running, predictions: list) -> None:
    """One step of every image in `running` (all with a coefficient table): x' = a x + b eps (+ c noise, its step's
    row of its noise table) in float32, cast back to the prediction's dtype as diffusers' Euler steps do."""
    import torch

    latents = torch.cat([r.state["latents"] for r in running])
    eps = torch.cat(predictions)
    stepped = gathered(running, 1) * latents.to(torch.float32) + gathered(running, 2) * eps.to(torch.float32)
    if any(r.state.get("noise") is not None for r in running):
        noise = torch.cat([
            r.state["noise"][r.done : r.done + 1] if r.state.get("noise") is not None
            else torch.zeros_like(r.state["latents"])
            for r in running
        ])  # fmt: skip
        stepped = stepped + gathered(running, 3) * noise.to(torch.float32)
    stepped = stepped.to(eps.dtype)
    for index, r in enumerate(running):
        r.state["latents"] = stepped[index : index + 1]
        r.done += 1


def scaled_input(r, sample):
    """The model's input rows for a linear image: its latents times its step's input scale (Euler's)."""
    return sample * r.state["linear"][r.done, 0].to(sample.dtype)
