"""Scheduler steps that are one formula, done for the whole running set at once without reading the device.

Diffusers' DDIM (eta 0), Euler and flow-matching Euler steps are, for one image, `x_prev = a * x + b * eps` (and
Euler scales the model's input by `1 / sqrt(sigma^2 + 1)`), where `a`, `b` and the input scale depend only on the
image's schedule and its step. They are computed once per image when it joins, from its own diffusers scheduler
after `set_timesteps` (Python numbers, then one small tensor on the device), so a step of the running set gathers
each image's coefficients by index on the device and runs one multiply-add for all images: no `.item()`, no
comparison of a device tensor in Python, no per-image scheduler call. Each image's coefficients are exactly the
ones its diffusers scheduler would apply (tests/unit/test_linear_steps.py compares them step by step).

A scheduler, or a configuration, outside this formula (PNDM, DPM-Solver++ 2M, LCM, Euler ancestral's noise,
DDIM with eta, clipping or thresholding) returns None here and keeps its own diffusers scheduler, stepped per image
with its timesteps as Python numbers (`Denoiser.step_items`), which keeps their arithmetic on the host's scalars.
"""

from __future__ import annotations

import math
from typing import Any

# The scheduler classes the formula covers, and the configurations it covers them in.
LINEAR_SCHEDULERS = frozenset({"DDIMScheduler", "EulerDiscreteScheduler", "FlowMatchEulerDiscreteScheduler"})


def linear_coefficients(
    scheduler, timesteps: list, step_kwargs: dict[str, Any]
) -> list[tuple[float, float, float]] | None:
    """Per step of this image's `timesteps` (its scheduler's from its `begin_index`): (input scale, a, b), or None
    when the scheduler or its configuration is not the plain formula."""
    name = type(scheduler).__name__
    if name not in LINEAR_SCHEDULERS:
        return None
    config = scheduler.config
    begin, steps = getattr(scheduler, "begin_index", None) or 0, len(timesteps)
    if name == "DDIMScheduler":
        return ddim_coefficients(scheduler, timesteps, step_kwargs)
    if name == "EulerDiscreteScheduler":
        if config.prediction_type not in ("epsilon", "v_prediction") or step_kwargs.get("s_churn", 0.0):
            return None
        sigmas = scheduler.sigmas.tolist()
        out = []
        for k in range(begin, begin + steps):
            sigma, following = sigmas[k], sigmas[k + 1]
            scale = 1 / math.sqrt(sigma**2 + 1)
            dt = following - sigma
            if config.prediction_type == "epsilon":  # x0 = x - sigma eps; x' = x + (x - x0) / sigma * dt
                out.append((scale, 1.0, dt))
            else:  # x0 = eps * (-sigma / sqrt(sigma^2 + 1)) + x / (sigma^2 + 1)
                skip, gain = 1 / (sigma**2 + 1), -sigma * scale
                out.append((scale, 1 + (1 - skip) * dt / sigma, -gain * dt / sigma))
        return out
    if config.get("stochastic_sampling", False) or getattr(scheduler, "_per_token_timesteps", None) is not None:
        return None
    sigmas = scheduler.sigmas.tolist()  # flow matching: x' = x + (sigma_next - sigma) v
    return [(1.0, 1.0, sigmas[k + 1] - sigmas[k]) for k in range(begin, begin + steps)]


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
        out.append((1.0, a, b))
    return out


def coefficient_table(coefficients: list[tuple[float, float, float]], device):
    """The image's coefficients as one (steps, 3) float32 tensor on the device: copied once, when the image joins."""
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
    """One step of every image in `running` (all with a coefficient table): x' = a x + b eps in float32, cast back
    to the prediction's dtype as diffusers' Euler steps do."""
    import torch

    latents = torch.cat([r.state["latents"] for r in running])
    eps = torch.cat(predictions)
    stepped = (gathered(running, 1) * latents.to(torch.float32) + gathered(running, 2) * eps.to(torch.float32)).to(
        eps.dtype
    )
    for index, r in enumerate(running):
        r.state["latents"] = stepped[index : index + 1]
        r.done += 1


def scaled_input(r, sample):
    """The model's input rows for a linear image: its latents times its step's input scale (Euler's)."""
    return sample * r.state["linear"][r.done, 0].to(sample.dtype)
