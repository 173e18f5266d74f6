"""The catalog's step limit is one its scheduler can run: the rule (contract/step_limits.py) checked against
diffusers' own schedulers at the bound it gives, tight where diffusers fails just past it, and a catalog or loaded
scheduler with a limit beyond it refused with a message that names the bound."""

from __future__ import annotations

import warnings

import pytest
import yaml

from contract.catalog import ModelCatalog, load_catalog
from contract.families import FAMILIES
from contract.model_spec import STEPPABLE_SCHEDULERS, ModelSpec
from contract.step_limits import most_steps

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

# SD 1.5's saved scheduler config, less the spacing and offset each case sets (bench/scheduler_steps.py's).
UNET = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
        "set_alpha_to_one": False, "skip_prk_steps": True, "clip_sample": False}  # fmt: skip
# LMS needs scipy, which the worker does not install.
CHECKED = sorted(STEPPABLE_SCHEDULERS - {"LMSDiscreteScheduler"})


def configs(name: str) -> list[dict]:
    if name == "FlowMatchEulerDiscreteScheduler":
        return [{"num_train_timesteps": 1000, "shift": 3.0}]
    if name == "LCMScheduler":
        return [{**UNET, "original_inference_steps": 50}]
    return [{**UNET, "timestep_spacing": spacing, "steps_offset": offset}
            for spacing in ("leading", "trailing", "linspace") for offset in (0, 1)]  # fmt: skip


def scheduler(name: str, config: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(diffusers, name).from_config({k: v for k, v in config.items() if k != "skip_prk_steps"}
                                                    if name != "PNDMScheduler" else config)  # fmt: skip


def run(name: str, config: dict, steps: int) -> None:
    """Every step of an `steps`-step schedule with diffusers' own scheduler on random model outputs: raises (an
    index past the training schedule, diffusers' own refusal) or leaves non-finite latents where it cannot run."""
    s = scheduler(name, config)
    s.set_timesteps(steps)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 2, 2, generator=generator)
    kwargs = (
        {"generator": generator} if name in ("EulerAncestralDiscreteScheduler", "LCMScheduler", "DDPMScheduler") else {}
    )
    for t in s.timesteps:
        x = s.step(torch.randn(x.shape, generator=generator), t, x, **kwargs).prev_sample
    if not torch.isfinite(x).all():
        raise FloatingPointError(f"{name} {config} at {steps} steps: non-finite latents")


@pytest.mark.parametrize("name", CHECKED)
def test_every_scheduler_runs_every_config_at_its_bound(name):
    for config in configs(name):
        bound = most_steps(name, config)
        run(name, config, bound)
        if name in ("PNDMScheduler", "DDIMScheduler", "LCMScheduler"):  # the worker's own step reads the schedule too
            from model_worker.model.families.linear_steps import linear_coefficients

            s = scheduler(name, config)
            s.set_timesteps(bound)
            kwargs = {"generator": torch.Generator()} if name == "LCMScheduler" else {}
            assert linear_coefficients(s, [int(t) for t in s.timesteps], kwargs) is not None


@pytest.mark.parametrize(
    ("name", "config", "bound"),
    [
        ("PNDMScheduler", {**UNET, "timestep_spacing": "leading", "steps_offset": 5}, 199),
        ("DDIMScheduler", {**UNET, "timestep_spacing": "leading", "steps_offset": 3}, 499),
        ("DDPMScheduler", {**UNET, "timestep_spacing": "leading", "steps_offset": 5}, 199),
        ("LCMScheduler", {**UNET, "original_inference_steps": 50}, 50),
    ],
)
def test_the_bound_is_tight_where_diffusers_fails_just_past_it(name, config, bound):
    assert most_steps(name, config) == bound
    run(name, config, bound)
    with pytest.raises((IndexError, ValueError, FloatingPointError)):
        run(name, config, bound + 1)


def test_sd15s_scheduler_fails_at_1000_steps_and_the_bound_is_below():
    config = {**UNET, **dict(FAMILIES["sd15"].scheduler_config)}
    with pytest.raises(IndexError):
        run("PNDMScheduler", config, 1000)
    assert most_steps("PNDMScheduler", config) < 1000


def entry(**changes) -> dict:
    base = {
        "name": "m", "version": "1", "task": "text-to-image", "pipeline": "StableDiffusionPipeline",
        "weights_path": "m/1", "hardware": "l4", "gpu_sharing": False, "max_batch_size": 4,
        "max_instances_per_request": 4, "request_timeout_seconds": 120, "ack_deadline_seconds": 30,
        "max_delivery_attempts": 5, "drain_seconds": 60, "replicas": {"min": 1, "max": 2},
        "limits": {"max_inference_steps": 1000, "max_width": 1024, "max_height": 1024},
    }  # fmt: skip
    return {**base, **changes}


def test_a_catalog_whose_limit_its_scheduler_cannot_run_is_refused_at_load(tmp_path):
    catalog = tmp_path / "models.yaml"
    catalog.write_text(yaml.safe_dump({"schema_version": 1, "models": {"m": entry()}}))
    with pytest.raises(ValueError) as caught:
        ModelCatalog.from_yaml(catalog)
    message = str(caught.value)
    assert "m: limits.max_inference_steps 1000" in message and "PNDMScheduler" in message and "at most 500" in message


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"scheduler": "LCMScheduler", "scheduler_config": {"original_inference_steps": 8}}, 9),
        ({"scheduler_config": {"steps_offset": 5}}, 200),
        ({"pipeline": "StableDiffusionXLPipeline", "scheduler_config": {"timestep_spacing": "trailing"}}, 501),
        ({"pipeline": "FluxPipeline", "hardware": "a100"}, 501),
    ],
)
def test_the_limit_is_checked_against_the_catalogs_scheduler_and_overrides(changes, refused):
    ModelSpec.model_validate(entry(limits={"max_inference_steps": refused - 1, "max_width": 1024,
                                           "max_height": 1024}, **changes))  # fmt: skip
    with pytest.raises(ValueError, match="is more than its scheduler can run"):
        ModelSpec.model_validate(entry(limits={"max_inference_steps": refused, "max_width": 1024,
                                               "max_height": 1024}, **changes))  # fmt: skip


def test_every_shipped_catalog_model_fits_its_scheduler():
    for spec in load_catalog().units():
        if spec.pipeline is not None:
            scheduler_name, config = spec.scheduler_settings
            assert spec.limits.max_inference_steps <= most_steps(scheduler_name, config), spec.name


def test_the_worker_refuses_a_loaded_scheduler_whose_saved_config_cannot_run_the_limit():
    from model_worker.model.pipeline import configured_scheduler

    spec = ModelSpec.model_validate(entry(limits={"max_inference_steps": 300, "max_width": 1024, "max_height": 1024}))
    fits = scheduler("PNDMScheduler", {**UNET, "timestep_spacing": "leading", "steps_offset": 1})
    assert configured_scheduler(spec, fits) is fits
    saved = scheduler("PNDMScheduler", {**UNET, "timestep_spacing": "leading", "steps_offset": 5})
    with pytest.raises(ValueError, match="runs at most 199"):
        configured_scheduler(spec, saved)
