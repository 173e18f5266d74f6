"""Scheduler steps that are one formula, done for the whole running set at once without reading the device.

Every scheduler the catalog lets a model step per item has, for one image and its configurations below, a step
that is linear in what it is given and what it kept:

    x' = a x + b eps + c noise + d saved + w1 h1 + w2 h2 + w3 h3

where `x` is the image's latents, `eps` the model's output for it this step, `noise` the stochastic schedulers'
draw (Euler ancestral, LCM), `saved` the latents PNDM keeps from its first step for its second, and `h1..h3` the
vectors the multistep schedulers keep from earlier steps (most recent first): PNDM's past model outputs,
DPM-Solver++'s past data predictions. After the step an image pushes `u x + v eps` on its history when the
scheduler keeps one (PNDM's output as given; DPM-Solver++'s data prediction `x0 = p x + q eps`). DDIM (eta 0),
Euler, Euler ancestral, flow-matching Euler and LCM keep nothing; Euler's and Euler ancestral's model input is
scaled by `1 / sqrt(sigma^2 + 1)`.

Every coefficient depends only on the image's schedule and its step, so they are computed once per image when it
joins, from its own diffusers scheduler after `set_timesteps` (Python numbers, then one small tensor on the
device). A step of the running set gathers each image's row by index on the device and runs one multiply-add per
term for all images: no `.item()`, no comparison of a device tensor in Python, no per-image scheduler call. Each
image's coefficients are exactly the ones its diffusers scheduler would apply (tests/unit/test_linear_steps.py
steps both side by side, every scheduler, mixed step counts, images joining mid-run).

The stochastic two add noise each step, which diffusers draws from the image's own CPU generator and copies to the
device with a blocking copy, a host sync a step. Here an image's noise for all its steps is drawn when it joins,
from the same generator in the same order and dtype as diffusers draws it (so the images stay diffusers' at the
same seed), and copied to the device once; a step indexes it.

A configuration outside these formulas (PNDM's Runge-Kutta warm-up, DPM-Solver of order 3 or with noise, DDIM with
eta, clipping or thresholding, a stochastic step without a generator) and the schedulers not written out here
(DDPM, LMS, UniPC) return None and keep their own diffusers scheduler, stepped per image with its timesteps as
Python numbers (`Denoiser.step_items`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

# The scheduler classes the formula covers, and the configurations it covers them in.
LINEAR_SCHEDULERS = frozenset(
    {"DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "FlowMatchEulerDiscreteScheduler",
     "LCMScheduler", "PNDMScheduler", "DPMSolverMultistepScheduler"}
)  # fmt: skip
# Those whose step adds noise drawn from the image's generator (the coefficient `c`).
NOISED_SCHEDULERS = frozenset({"EulerAncestralDiscreteScheduler", "LCMScheduler"})
# The most earlier vectors a step combines (PNDM's fourth-order step: three, and this step's output).
HISTORY = 3


class Step(NamedTuple):
    """One step's coefficients for one image (see the module's formula). `save` and `push` are 1.0 or 0.0."""

    scale: float  # of the model's input
    a: float  # of the latents
    b: float  # of the model's output
    c: float = 0.0  # of this step's noise
    d: float = 0.0  # of the saved latents
    w1: float = 0.0  # of the history, most recent first
    w2: float = 0.0
    w3: float = 0.0
    u: float = 0.0  # the pushed vector: u x + v eps
    v: float = 0.0
    push: float = 0.0  # whether this step pushes onto the history
    save: float = 0.0  # whether this step keeps its latents as `saved`


# The columns of the device table a step of the running set reads.
A, B, C, D, W1, U, V = (Step._fields.index(name) for name in ("a", "b", "c", "d", "w1", "u", "v"))


def linear_coefficients(scheduler, timesteps: list, step_kwargs: dict[str, Any]) -> list[Step] | None:
    """Per step of this image's `timesteps` (its scheduler's from its `begin_index`): its `Step`, or None when the
    scheduler or its configuration is not one of the formulas."""
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
    if name in ("PNDMScheduler", "DPMSolverMultistepScheduler"):
        try:
            if name == "PNDMScheduler":
                return pndm_coefficients(scheduler, timesteps)
            return dpm_coefficients(scheduler, begin, steps)
        except ZeroDivisionError:  # a schedule at an end point (alpha 0): diffusers' own arithmetic, per image
            return None
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
                out.append(Step(scale, 1.0, dt, up))
            else:  # x0 = eps * (-sigma / sqrt(sigma^2 + 1)) + x / (sigma^2 + 1)
                skip, gain = 1 / (sigma**2 + 1), -sigma * scale
                out.append(Step(scale, 1 + (1 - skip) * dt / sigma, -gain * dt / sigma, up))
        return out
    if config.get("stochastic_sampling", False) or getattr(scheduler, "_per_token_timesteps", None) is not None:
        return None
    sigmas = scheduler.sigmas.tolist()  # flow matching: x' = x + (sigma_next - sigma) v
    return [Step(1.0, 1.0, sigmas[k + 1] - sigmas[k]) for k in range(begin, begin + steps)]


def lcm_coefficients(scheduler, begin: int, steps: int) -> list[Step] | None:
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
            out.append(Step(1.0, a, b))
        else:
            out.append(Step(1.0, math.sqrt(a_prev) * a, math.sqrt(a_prev) * b, math.sqrt(1 - a_prev)))
    return out


# PNDM's linear multistep (PLMS) weights of this step's output and its history, by how many outputs it keeps.
PLMS_WEIGHTS = {0: (1.0,), 1: (1.5, -0.5), 2: (23 / 12, -16 / 12, 5 / 12), 3: (55 / 24, -59 / 24, 37 / 24, -9 / 24)}


def pndm_coefficients(scheduler, timesteps: list) -> list[Step] | None:
    """PNDM with `skip_prk_steps` (Stable Diffusion's): diffusers' `step_plms`. Its counter starts at the image's
    first step; the first step is an Euler step that keeps its latents, the second restarts from them with the mean
    of the two outputs (and keeps no output), later ones combine up to four outputs; each is `_get_prev_sample`,
    `x' = s x - k M` (v-prediction first turns M into a noise prediction with the sample)."""
    config = scheduler.config
    if not config.skip_prk_steps or config.prediction_type not in ("epsilon", "v_prediction"):
        return None
    alphas, final = scheduler.alphas_cumprod.tolist(), float(scheduler.final_alpha_cumprod)
    ratio = config.num_train_timesteps // scheduler.num_inference_steps
    out, kept = [], 0
    for k, timestep in enumerate(timesteps):
        t, previous = (timestep + ratio, timestep) if k == 1 else (timestep, timestep - ratio)
        a_t = alphas[t]
        a_prev = alphas[previous] if previous >= 0 else final
        s = (a_prev / a_t) ** 0.5
        m = (a_prev - a_t) / (a_t * (1 - a_prev) ** 0.5 + (a_t * (1 - a_t) * a_prev) ** 0.5)
        if config.prediction_type == "v_prediction":  # M_eps = sqrt(a_t) M + sqrt(1 - a_t) sample
            s, m = s - m * (1 - a_t) ** 0.5, m * a_t**0.5
        weights = (0.5, 0.5) if k == 1 else PLMS_WEIGHTS[kept]
        history = [-m * w for w in weights[1:]] + [0.0] * (HISTORY + 1 - len(weights))
        if k == 1:  # from the first step's latents; its output is not kept
            out.append(Step(1.0, 0.0, -m * weights[0], 0.0, s, *history))
        else:
            out.append(Step(1.0, s, -m * weights[0], 0.0, 0.0, *history, 0.0, 1.0, 1.0, float(k == 0)))
            kept = min(kept + 1, HISTORY)
    return out


def dpm_coefficients(scheduler, begin: int, steps: int) -> list[Step] | None:
    """DPM-Solver++ (diffusers' `DPMSolverMultistepScheduler`, algorithm `dpmsolver++`, order 1 or 2, either solver
    type): each step converts the output to a data prediction `m = p x + q eps` and keeps it; a first-order step is
    `x' = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) m`, a second-order one also takes the previous `m`. The
    coefficients are computed with the scheduler's own float32 arithmetic (`_sigma_to_alpha_sigma_t`, its log
    lambdas), so a final step to sigma 0 is its first-order step to the data prediction, as in diffusers."""
    import torch

    config = scheduler.config
    if (
        config.algorithm_type != "dpmsolver++" or config.solver_order not in (1, 2) or config.thresholding
        or config.solver_type not in ("midpoint", "heun") or config.variance_type in ("learned", "learned_range")
        or config.prediction_type not in ("epsilon", "v_prediction", "sample", "flow_prediction")
    ):  # fmt: skip
        return None
    sigmas, count = scheduler.sigmas.to(torch.float32), len(scheduler.timesteps)

    def alpha_sigma_lambda(index: int):
        alpha, sigma = scheduler._sigma_to_alpha_sigma_t(sigmas[index])
        return alpha, sigma, torch.log(alpha) - torch.log(sigma)

    out = []
    for k in range(steps):
        index = begin + k
        alpha_t, sigma_t, lambda_t = alpha_sigma_lambda(index + 1)
        alpha_s0, sigma_s0, lambda_s0 = alpha_sigma_lambda(index)
        raw = float(sigmas[index])
        p, q = {
            "epsilon": (1 / float(alpha_s0), -float(sigma_s0) / float(alpha_s0)),
            "v_prediction": (float(alpha_s0), -float(sigma_s0)),
            "sample": (0.0, 1.0),
            "flow_prediction": (1.0, -raw),
        }[config.prediction_type]
        final = index == count - 1 and (
            config.euler_at_final or (config.lower_order_final and count < 15) or config.final_sigmas_type == "zero"
        )
        h = lambda_t - lambda_s0
        carry, gain = float(sigma_t / sigma_s0), float(alpha_t * (torch.exp(-h) - 1.0))
        if config.solver_order == 1 or k < 1 or final:  # x' = carry x - gain m
            keep, previous = -gain, 0.0
        else:  # D0 = m, D1 = (m - m_prev) / r0
            _, _, lambda_s1 = alpha_sigma_lambda(index - 1)
            r0 = float((lambda_s0 - lambda_s1) / h)
            heun = float(alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0))
            d1 = -0.5 * gain if config.solver_type == "midpoint" else heun  # the coefficient of D1
            keep, previous = -gain + d1 / r0, -d1 / r0
        out.append(Step(1.0, carry + keep * p, keep * q, 0.0, 0.0, previous, 0.0, 0.0, p, q, 1.0))
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
        out.append(Step(1.0, a, b))
    return out


def coefficient_table(coefficients: list[Step], device):
    """The image's coefficients as one (steps, fields) float32 tensor on the device: copied once, when it joins."""
    return host_values([list(step) for step in coefficients], device)


def host_values(values: list, device):
    """Python numbers as a float32 tensor on the device without stopping the host: on CUDA copied from pinned
    memory asynchronously (a plain `torch.tensor(..., device="cuda")` waits for the copy)."""
    import torch

    tensor = torch.tensor(values, dtype=torch.float32)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def step_linear(running, predictions: list) -> None:
    """One step of every image in `running` (all with a coefficient table) in float32, cast back to the prediction's
    dtype as diffusers' Euler and DPM-Solver steps do: each term of the formula is one multiply-add over the whole
    set, and only the terms some image uses this step (its Python coefficients say which) are computed. An image
    missing a term (a history shorter than another's) gets zeros there."""
    import torch

    latents = torch.cat([r.state["latents"] for r in running])
    eps = torch.cat(predictions)
    x, e = latents.to(torch.float32), eps.to(torch.float32)
    rows = torch.stack([r.state["linear"][r.done] for r in running])  # (N, fields): views gathered on the device
    steps = [r.state["steps"][r.done] for r in running]  # the same numbers on the host, to choose the terms

    def column(index: int):
        return rows[:, index].view(-1, *[1] * (latents.dim() - 1))

    stepped = column(A) * x + column(B) * e
    zero = None
    if any(r.state.get("noise") is not None for r in running):
        zero = torch.zeros_like(running[0].state["latents"])
        noise = torch.cat([r.state["noise"][r.done : r.done + 1] if r.state.get("noise") is not None else zero
                           for r in running])  # fmt: skip
        stepped = stepped + column(C) * noise.to(torch.float32)
    for index in (D, *range(W1, W1 + HISTORY)):
        if not any(step[index] for step in steps):
            continue
        zero = zero if zero is not None else torch.zeros_like(running[0].state["latents"])
        terms = torch.cat([vector if (vector := kept(r, index)) is not None else zero for r in running])
        stepped = stepped + column(index) * terms.to(torch.float32)
    pushed = (column(U) * x + column(V) * e).to(eps.dtype) if any(step.push for step in steps) else None
    stepped = stepped.to(eps.dtype)
    for index, (r, step) in enumerate(zip(running, steps, strict=True)):
        if step.save:
            r.state["saved"] = latents[index : index + 1]
        if step.push:
            r.state["history"] = [pushed[index : index + 1], *r.state.get("history", ())][:HISTORY]
        r.state["latents"] = stepped[index : index + 1]
        r.done += 1


def kept(r, index: int):
    """What an image kept for the term in column `index`: its saved latents (D) or an earlier vector (W1...)."""
    if index == D:
        return r.state.get("saved")
    history = r.state.get("history", ())
    return history[index - W1] if len(history) > index - W1 else None


def scaled_input(r, sample):
    """The model's input rows for a linear image: its latents times its step's input scale (Euler's)."""
    return sample * r.state["linear"][r.done, 0].to(sample.dtype)
