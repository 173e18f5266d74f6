"""The most denoising steps a scheduler configuration can run, so the catalog never offers a count it cannot.

diffusers' discrete schedulers index their training schedule (`alphas_cumprod`, `sigmas`) by timestep, and with
`timestep_spacing: leading` a schedule's timesteps are `i * (T // n) + steps_offset`: Stable Diffusion 1.5's PNDM
(`steps_offset: 1`, T = 1,000) reaches timestep 1,000 at 1,000 steps and fails with an IndexError, in diffusers'
own step as in the worker's (`linear_steps`); the schedulers that interpolate their sigmas (Euler, DPM-Solver++)
clamp such a timestep instead, a silently wrong schedule. The multistep solvers (DPM-Solver++, UniPC) divide by the gap
between consecutive steps' log-SNRs, so a schedule whose rounded timesteps repeat (trailing or linspace spacing
close to T steps) steps to NaN. Each scheduler's exact edge differs (UniPC trailing at 998, PNDM leading at 1,000),
so the bound here is one rule below all of them, checked against diffusers itself for every scheduler and spacing
in tests/unit/test_step_limits.py:

- at most half the training timesteps (each step spans at least two of them, so no two steps share one);
- LCM: at most its distillation's `original_inference_steps` (diffusers refuses more);
- leading spacing: every count up to the bound keeps its largest timestep inside the training schedule.

Pure Python (the API reads the catalog without diffusers); the worker checks the same rule against the config its
loaded scheduler really has (model_worker/model/pipeline.py)."""

from __future__ import annotations

from collections.abc import Mapping

FLOW_SCHEDULERS = frozenset({"FlowMatchEulerDiscreteScheduler"})
# Schedulers whose leading spacing spreads n + 1 points and drops the last (their `step_ratio` is T // (n + 1)).
PLUS_ONE_LEADING = frozenset({"DPMSolverMultistepScheduler", "UniPCMultistepScheduler"})
# diffusers' defaults for what a saved config may leave out.
DEFAULT_TRAIN_TIMESTEPS = 1000
DEFAULT_ORIGINAL_STEPS = 50


def most_steps(scheduler: str, config: Mapping[str, object]) -> int:
    """The largest step count `n` such that every count from 1 to `n` runs on this scheduler class and config."""
    train = int(config.get("num_train_timesteps") or DEFAULT_TRAIN_TIMESTEPS)
    most = train // 2
    if scheduler == "LCMScheduler":  # its own skipping schedule; spacing and offset do not apply
        return min(most, int(config.get("original_inference_steps") or DEFAULT_ORIGINAL_STEPS))
    if scheduler in FLOW_SCHEDULERS or config.get("timestep_spacing", "leading") != "leading":
        return most
    offset = int(config.get("steps_offset") or 0)
    for n in range(1, most + 1):
        if top_leading_timestep(scheduler, n, train, offset) > train - 1:
            return n - 1
    return most


def top_leading_timestep(scheduler: str, n: int, train: int, offset: int) -> int:
    """The largest timestep of an `n`-step schedule with leading spacing (diffusers' `set_timesteps`)."""
    if scheduler in PLUS_ONE_LEADING:
        return n * (train // (n + 1)) + offset
    return (n - 1) * (train // n) + offset


def steps_problem(model: str, limit: int, scheduler: str, config: Mapping[str, object]) -> str | None:
    """Why `limit` (the catalog's `max_inference_steps`) is more than the scheduler can run; None when it fits."""
    most = most_steps(scheduler, config)
    if limit <= most:
        return None
    shown = {key: config[key] for key in ("num_train_timesteps", "timestep_spacing", "steps_offset",
                                           "original_inference_steps") if key in config}  # fmt: skip
    return (
        f"{model}: limits.max_inference_steps {limit} is more than its scheduler can run: {scheduler} {shown} runs "
        f"at most {most} steps (contract/step_limits.py); lower the limit or change the scheduler's config"
    )
