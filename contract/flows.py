"""Flows: a named, ordered list of served models called as one model (the catalog's `flows:`).

Each stage is a served model with the parameters it fixes, the request parameters it takes, and how its output
goes on to the next stage: a `latent` the next stage starts from (diffusers' SDXL base `denoising_end` ->
refiner `denoising_start`, or a clean latent into image-to-image) or an `image`, with an optional resize
between the two (the hires fix). An inpaint stage repaints the previous stage's image (the request's, when it is
the first) under the request's mask, so a flow with one takes a mask. The catalog refuses at load what cannot run
(`build_flows`); the API resolves a request into each stage's plan (`plan_stages`) and the worker runs the plans
(model_worker/flows/stages.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from contract import naming
from contract.generation import ROLES, AdapterRef, ControlRef, GenerationParameters, optional_parameters_model
from contract.messages import FlowStagePlan, Handoff, Resize, StageOutput

if TYPE_CHECKING:
    from contract.model_spec import AdapterPolicy, GenerationDefaults, GenerationLimits, ModelSpec

# What a request to a flow may carry, and so what a stage may take: the generation parameters, the prompt
# (every stage gets the instance's prompt), the input image (a first stage that is image-to-image, inpaint or edit)
# and the mask (every inpaint stage: it repaints the previous stage's image, or the request's when it is the first,
# under the request's mask).
REQUEST_PARAMETERS: tuple[str, ...] = ("prompt", "image", "mask", *ROLES)
# A later stage's size is the previous stage's output times its resize: never the request's.
SIZE_PARAMETERS = ("width", "height")
# What a later stage takes when its `takes` is left out: the prompt and the conditioning (a ControlNet's control
# image holds a hires pass to the same layout), not the size or the step count (a hires pass has its own) or the
# strength (the flow fixes it); an inpaint stage takes the mask.
LATER_STAGE_TAKES = ("prompt", "mask", "negative_prompt", "seed", "guidance_scale", "adapters", "controls")
# Resolved per stage's model (registered per model), never taken from the request as sent.
PER_MODEL = ("adapters", "controls")
STAGE_NAME = re.compile(r"[a-z0-9]([a-z0-9_-]{0,30}[a-z0-9])?")
# The VAE's downscale of every served family: a latent resize works on sizes divided by it.
LATENT_FACTOR = 8
SYNTHETIC_SIZE_MULTIPLE = 8
# A stage's `fixes`, checked against what a client could send (the parameters' constraints).
StageFixes = optional_parameters_model("StageFixes", ConfigDict(extra="forbid", strict=True))


class FlowError(ValueError):
    """A flow the catalog refuses, or a request its stages cannot run: the message names flow and stage."""


class FlowStage(BaseModel):
    """One stage as the catalog writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    model: str
    # Parameters this stage sets; the request cannot change them.
    fixes: dict[str, Any] = Field(default_factory=dict)
    # Request parameters it takes (REQUEST_PARAMETERS); None: the first stage takes all its model accepts, a
    # later one LATER_STAGE_TAKES.
    takes: tuple[str, ...] | None = None
    output: StageOutput = "image"
    # Between this stage and the next.
    resize: Resize | None = None
    handoff: Handoff | None = None


@dataclass(frozen=True)
class FlowRequestContract:
    """What the API validates a flow's request against: the union of what the stages take, the first stage's
    defaults, limits tightened so every stage's size (after the resizes) fits its model."""

    task: str
    takes: tuple[str, ...]
    defaults: GenerationDefaults
    limits: GenerationLimits
    # Width and height must be multiples of this, so every stage's size after the resizes is one of its family's.
    size_multiple: int
    max_instances_per_request: int
    # The stages that take adapters, with their models' policies (adapters are registered per model).
    adapters: dict[str, AdapterPolicy]
    # The inpaint stages, which repaint under the request's mask (each instance then carries one).
    mask_stages: tuple[str, ...] = ()


class FlowSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    stages: list[FlowStage] = Field(min_length=2)
    # Each stage's resolved `takes` (the defaults applied), set by `build_flows`.
    _takes: dict[str, tuple[str, ...]] = PrivateAttr(default_factory=dict)
    _request_contract: FlowRequestContract | None = PrivateAttr(default=None)

    @property
    def request_contract(self) -> FlowRequestContract:
        if self._request_contract is None:
            raise FlowError(f"flow {self.name}: not built by the catalog (contract/flows.py build_flows)")
        return self._request_contract

    def takes(self, stage: str) -> tuple[str, ...]:
        """The request parameters a stage takes (its `takes`, or the default for its place)."""
        return self._takes[stage]

    @property
    def models(self) -> list[str]:
        return [stage.model for stage in self.stages]


def _unit_label(spec: ModelSpec) -> str:
    return f"{spec.name} ({spec.pipeline or spec.runner}, {spec.task})"


def _size_multiple(spec: ModelSpec) -> int:
    family = spec.family
    return family.size_multiple if family else SYNTHETIC_SIZE_MULTIPLE


def _default_takes(spec: ModelSpec, first: bool) -> tuple[str, ...]:
    wanted = REQUEST_PARAMETERS if first else LATER_STAGE_TAKES
    takes = []
    for name in wanted:
        if (name == "image" and not spec.needs_image) or (name == "strength" and not spec.takes_strength):
            continue
        if name == "mask" and not spec.takes_mask:
            continue  # an edit model takes an image but no strength (its image is a reference, not a start)
        if name == "guidance_scale" and spec.guidance_mode == "none":
            continue
        if name == "negative_prompt" and spec.guidance_mode != "cfg":
            continue
        if (name == "adapters" and spec.adapters is None) or (name == "controls" and spec.controls is None):
            continue
        takes.append(name)
    return tuple(takes)


def build_flows(raw: Mapping[str, Any], models: Mapping[str, ModelSpec]) -> dict[str, FlowSpec]:
    """The catalog's `flows:`, each checked against the served models (a versioned model's stable version: every
    version accepts the same requests); a FlowError names what is wrong."""
    flows: dict[str, FlowSpec] = {}
    for name, entry in (raw or {}).items():
        if problem := naming.model_name_problem(name):
            raise FlowError(f"flow {name!r}: {problem.replace('model name', 'a flow name')}")
        if name in models:
            raise FlowError(f"flow {name}: a model has that name; a flow is called like a model, so names are unique")
        if not isinstance(entry, dict):
            raise FlowError(f"flow {name}: expected a mapping with `stages`, not {type(entry).__name__}")
        try:
            flow = FlowSpec.model_validate({**entry, "name": name})
        except ValidationError as exc:
            raise FlowError(f"flow {name}: {_first_error(exc)}") from None
        _check(flow, models, set(raw))
        flows[name] = flow
    return flows


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def _check(flow: FlowSpec, models: Mapping[str, ModelSpec], flows: set[str]) -> None:
    seen: set[str] = set()
    specs: list[ModelSpec] = []
    for index, stage in enumerate(flow.stages):
        where = f"flow {flow.name}: stage {stage.name!r}"
        if not STAGE_NAME.fullmatch(stage.name):
            raise FlowError(f"{where}: a stage name is lowercase letters, digits, '-' and '_' (at most 32)")
        if stage.name in seen:
            raise FlowError(f"{where}: the name is used twice; each stage of a flow has its own name")
        seen.add(stage.name)
        if stage.model in flows:
            raise FlowError(
                f"{where}: {stage.model} is a flow; flows do not nest (a stage is a served model), so no flow can "
                "call itself in a cycle"
            )
        spec = models.get(stage.model)
        if spec is None:
            raise FlowError(
                f"{where}: model {stage.model!r} is not a served model; served: {', '.join(sorted(models))}"
            )
        specs.append(spec)
        flow._takes[stage.name] = _check_parameters(where, stage, spec, index == 0)
    for index, (stage, spec) in enumerate(zip(flow.stages, specs, strict=True)):
        nxt = (flow.stages[index + 1], specs[index + 1]) if index + 1 < len(specs) else None
        _check_handoff(flow, index, stage, spec, nxt)
    flow._request_contract = _request_contract(flow, specs)


def _check_parameters(where: str, stage: FlowStage, spec: ModelSpec, first: bool) -> tuple[str, ...]:
    if unknown := sorted(set(stage.fixes) - set(ROLES)):
        raise FlowError(f"{where}: fixes {unknown}, which are not generation parameters ({', '.join(ROLES)})")
    takes = stage.takes
    if takes is None:
        takes = tuple(name for name in _default_takes(spec, first) if name not in stage.fixes)
    if unknown := sorted(set(takes) - set(REQUEST_PARAMETERS)):
        raise FlowError(f"{where}: takes {unknown}; a stage takes some of {', '.join(REQUEST_PARAMETERS)}")
    if both := sorted(set(takes) & set(stage.fixes)):
        raise FlowError(f"{where}: both fixes and takes {both}; a fixed parameter is not the request's")
    if not first and (sized := sorted((set(takes) | set(stage.fixes)) & {*SIZE_PARAMETERS, "image"})):
        raise FlowError(
            f"{where}: takes or fixes {sized}; a later stage's input and size are the previous stage's output "
            "(times its resize)"
        )
    if "mask" in takes and not spec.takes_mask:
        raise FlowError(f"{where}: takes mask, but {_unit_label(spec)} takes none (inpaint models do)")
    if spec.takes_mask and "mask" not in takes:
        raise FlowError(
            f"{where}: {_unit_label(spec)} repaints under the request's mask, so it must take `mask` (the flow's "
            "request then carries one)"
        )
    if not spec.needs_image and {"strength", "image"} & (set(takes) | set(stage.fixes)):
        raise FlowError(f"{where}: {_unit_label(spec)} takes no image, so no `strength` or `image`")
    if spec.needs_image and not spec.takes_strength and "strength" in set(takes) | set(stage.fixes):
        raise FlowError(f"{where}: {_unit_label(spec)} takes no `strength` (its image is a reference, not a start)")
    if "adapters" in takes and spec.adapters is None:
        raise FlowError(f"{where}: takes adapters, but {spec.name} serves none (no `adapters` in its catalog entry)")
    if "adapters" in stage.fixes:
        raise FlowError(f"{where}: adapters are the request's (registered per model): `takes` them, do not fix them")
    if "controls" in takes and spec.controls is None:
        raise FlowError(f"{where}: takes controls, but {spec.name} serves none (no `controls` in its catalog entry)")
    if "controls" in stage.fixes:
        raise FlowError(f"{where}: controls are the request's (registered per model): `takes` them, do not fix them")
    if "guidance_scale" in set(takes) | set(stage.fixes) and spec.guidance_mode == "none":
        raise FlowError(f"{where}: {spec.name} takes no guidance (its guidance is 'none')")
    steps = stage.fixes.get("num_inference_steps")
    if steps is not None and not (isinstance(steps, int) and 1 <= steps <= spec.limits.max_inference_steps):
        raise FlowError(
            f"{where}: fixes num_inference_steps {steps!r}; {spec.name} runs 1 to {spec.limits.max_inference_steps}"
        )
    try:
        StageFixes.model_validate(stage.fixes)
    except ValidationError as exc:
        raise FlowError(f"{where}: fixes {_first_error(exc)}") from None
    return tuple(takes)


def _check_handoff(
    flow: FlowSpec, index: int, stage: FlowStage, spec: ModelSpec, nxt: tuple[FlowStage, ModelSpec] | None
) -> None:
    where = f"flow {flow.name}: stage {stage.name!r}"
    handoff = stage.handoff or Handoff()
    if index > 0 and spec.task == "text-to-image":
        raise FlowError(
            f"{where}: {_unit_label(spec)} is text-to-image and cannot take the previous stage's "
            f"{flow.stages[index - 1].output}; a later stage must be image-to-image"
        )
    if nxt is None:
        if stage.output == "latent":
            raise FlowError(f"{where}: the last stage's output is the flow's answer: `output: image`, not latent")
        if stage.resize is not None:
            raise FlowError(f"{where}: a resize goes between two stages; the last stage has none after it")
        if handoff.denoising_end is not None:
            raise FlowError(f"{where}: denoising_end hands a latent on; the last stage has no stage after it")
    previous = flow.stages[index - 1] if index > 0 else None
    if handoff.denoising_start is not None:
        before = (previous.handoff or Handoff()).denoising_end if previous else None
        if before != handoff.denoising_start:
            raise FlowError(
                f"{where}: denoising_start {handoff.denoising_start} must equal the previous stage's denoising_end "
                f"({before}): the refiner starts where the base stopped"
            )
    if handoff.denoising_start is not None or handoff.denoising_end is not None:
        family = spec.family
        if family is None or not family.denoising_handoff:
            raise FlowError(
                f"{where}: {_unit_label(spec)} does not take denoising_end/denoising_start (diffusers' base + "
                "refiner handoff is served for SDXL)"
            )
    if handoff.denoising_end is not None and stage.output != "latent":
        raise FlowError(f"{where}: denoising_end leaves a noisy latent: it needs `output: latent`")
    if nxt is None:
        return
    next_stage, next_spec = nxt
    if handoff.denoising_end is not None and (next_stage.handoff or Handoff()).denoising_start is None:
        raise FlowError(
            f"flow {flow.name}: stage {next_stage.name!r}: the previous stage stops at denoising_end "
            f"{handoff.denoising_end}, so this stage needs `handoff: {{denoising_start: {handoff.denoising_end}}}`"
        )
    if stage.output == "latent" and next_spec.takes_mask:
        raise FlowError(
            f"{where}: {_unit_label(next_spec)} repaints an image under the mask (its masked image is encoded from "
            "pixels), so the stage before it hands on `output: image`, not a latent"
        )
    if stage.output == "latent":
        mine, theirs = spec.family, next_spec.family
        if mine is None or not mine.latent_space:
            raise FlowError(
                f"{where}: {_unit_label(spec)} does not hand latents on (SD 1.5 and SDXL do); use `output: image`"
            )
        if theirs is None or mine.latent_space != theirs.latent_space:
            raise FlowError(
                f"{where}: a latent handoff from {_unit_label(spec)} to {_unit_label(next_spec)} crosses latent "
                f"spaces ({mine.latent_space} -> {theirs.latent_space if theirs else 'no latents'}); use `output: image`"
            )
    if stage.resize is not None:
        if (stage.resize.space == "latent") != (stage.output == "latent"):
            raise FlowError(
                f"{where}: a {stage.resize.space}-space resize needs `output: "
                f"{'latent' if stage.resize.space == 'latent' else 'image'}`"
            )
        if handoff.denoising_end is not None:
            raise FlowError(f"{where}: a resize of a partly denoised latent (denoising_end) is no documented handoff")


def _defaults(spec: ModelSpec) -> dict[str, Any]:
    return spec.defaults.model_dump(exclude_none=True)


def _scales(flow: FlowSpec) -> list[float]:
    """Each stage's size over the first stage's (the product of the resizes before it)."""
    scales, scale = [], 1.0
    for stage in flow.stages:
        scales.append(scale)
        scale *= stage.resize.scale if stage.resize else 1
    return scales


def _fits(size: int, scale: float, multiple: int) -> bool:
    scaled = size * scale
    return scaled == int(scaled) and int(scaled) % multiple == 0


def _request_contract(flow: FlowSpec, specs: list[ModelSpec]) -> FlowRequestContract:
    first = specs[0]
    scales = _scales(flow)
    base = _size_multiple(first)
    multiple = next(
        (m for m in range(base, 64 * base + 1, base)
         if all(_fits(m, s, max(_size_multiple(spec), LATENT_FACTOR)) for s, spec in zip(scales, specs, strict=True))),
        None,
    )  # fmt: skip
    if multiple is None:
        raise FlowError(f"flow {flow.name}: no first-stage size gives every stage a size its family accepts")
    limits: dict[str, int] = {}
    for axis in SIZE_PARAMETERS:
        largest = min(getattr(spec.limits, f"max_{axis}") / s for s, spec in zip(scales, specs, strict=True))
        limits[f"max_{axis}"] = int(largest) // multiple * multiple
    defaults = {**_defaults(first), **{k: v for k, v in flow.stages[0].fixes.items() if k in _defaults(first)}}
    for axis in SIZE_PARAMETERS:
        size = defaults[axis]
        for scale, stage, spec in zip(scales, flow.stages, specs, strict=True):
            family_multiple = max(_size_multiple(spec), LATENT_FACTOR)
            limit = getattr(spec.limits, f"max_{axis}")
            if not _fits(size, scale, family_multiple) or size * scale > limit:
                raise FlowError(
                    f"flow {flow.name}: stage {stage.name!r}: the flow's default {axis} {size} becomes "
                    f"{size * scale:g} after the resizes, which {spec.name} does not accept (a multiple of "
                    f"{family_multiple}, at most {limit})"
                )
    takes = tuple(dict.fromkeys(name for stage in flow.stages for name in flow.takes(stage.name)))
    steps_limit = min(
        (spec.limits.max_inference_steps for stage, spec in zip(flow.stages, specs, strict=True)
         if "num_inference_steps" in flow.takes(stage.name)),
        default=first.limits.max_inference_steps,
    )  # fmt: skip
    mask_stages = tuple(stage.name for stage in flow.stages if "mask" in flow.takes(stage.name))
    # The request's mask is decoded by every inpaint stage's worker, and is the request's image's size.
    max_input_pixels = min(
        [first.limits.max_input_pixels]
        + [spec.limits.max_input_pixels for stage, spec in zip(flow.stages, specs, strict=True)
           if stage.name in mask_stages]
    )  # fmt: skip
    from contract.model_spec import GenerationDefaults, GenerationLimits

    return FlowRequestContract(
        task=first.task,
        takes=takes,
        defaults=GenerationDefaults.model_validate(defaults),
        limits=GenerationLimits(
            max_inference_steps=steps_limit,
            max_width=limits["max_width"],
            max_height=limits["max_height"],
            max_input_pixels=max_input_pixels,
        ),
        size_multiple=multiple,
        max_instances_per_request=min(spec.max_instances_per_request for spec in specs),
        adapters={
            stage.name: spec.adapters
            for stage, spec in zip(flow.stages, specs, strict=True)
            if "adapters" in flow.takes(stage.name) and spec.adapters is not None
        },
        mask_stages=mask_stages,
    )


def stage_steps(parameters: GenerationParameters, handoff: Handoff | None, image_input: bool) -> int:
    """The denoising steps a stage runs, as diffusers counts them: `strength` of the schedule for an
    image-to-image call, the part before `denoising_end` / after `denoising_start` for the base + refiner
    handoff (diffusers cuts the schedule at a training timestep; with evenly spaced timesteps that is this
    rounding)."""
    steps = parameters.num_inference_steps
    handoff = handoff or Handoff()
    if handoff.denoising_start is not None:
        return steps - round(steps * handoff.denoising_start)
    if handoff.denoising_end is not None:
        return round(steps * handoff.denoising_end)
    if image_input and parameters.strength is not None:
        return min(int(steps * parameters.strength), steps)
    return steps


def plan_stages(
    flow: FlowSpec,
    units: Sequence[ModelSpec],
    asked: Mapping[str, Any],
    adapters: Mapping[str, tuple[AdapterRef, ...]] | None = None,
    controls: Mapping[str, tuple[ControlRef, ...]] | None = None,
) -> list[FlowStagePlan]:
    """Every stage's plan for one request: `units` are the served units the API chose, one per stage (a
    version or canary of the stage's model); `asked` the request's parameters as the client sent them (those
    left out absent) with its `seed` resolved; `adapters` the adapters resolved per stage name for the stages
    that take them, and `controls` their control models (ControlNets, then image prompts). Per stage: its model's
    defaults, then what it takes of the request, then what it fixes; a later stage's size is the previous one's
    times its resize."""
    if len(units) != len(flow.stages):
        raise FlowError(f"flow {flow.name}: {len(units)} units for {len(flow.stages)} stages")
    if "seed" not in asked:
        raise FlowError(f"flow {flow.name}: the request's seed must be resolved before planning")
    if unknown := sorted(set(asked) - set(REQUEST_PARAMETERS)):
        raise FlowError(f"flow {flow.name}: {unknown} are not request parameters ({', '.join(REQUEST_PARAMETERS)})")
    plans: list[FlowStagePlan] = []
    size: tuple[int, int] | None = None
    for index, (stage, unit) in enumerate(zip(flow.stages, units, strict=True)):
        where = f"flow {flow.name}: stage {stage.name!r}"
        if unit.name != stage.model:
            raise FlowError(f"{where}: unit {unit.queue} is not a version of {stage.model}")
        takes = flow.takes(stage.name)
        values = _defaults(unit)
        values.update({k: v for k, v in asked.items() if k in takes and k in ROLES and k not in PER_MODEL})
        values.update(stage.fixes)
        values.setdefault("seed", asked["seed"])
        values["adapters"] = tuple((adapters or {}).get(stage.name, ())) if "adapters" in takes else ()
        values["controls"] = tuple((controls or {}).get(stage.name, ())) if "controls" in takes else ()
        if not unit.takes_strength:
            values.pop("strength", None)
        if size is not None:
            values["width"], values["height"] = size
        try:
            parameters = GenerationParameters.model_validate(values)
        except ValidationError as exc:
            raise FlowError(f"{where}: {_first_error(exc)}") from None
        multiple = max(_size_multiple(unit), LATENT_FACTOR)
        for axis in SIZE_PARAMETERS:
            value, limit = getattr(parameters, axis), getattr(unit.limits, f"max_{axis}")
            if value % multiple or value > limit:
                raise FlowError(f"{where}: {axis} {value} is not a multiple of {multiple} at most {limit}")
        scale = stage.resize.scale if stage.resize else 1
        size = (_scaled(parameters.width, scale), _scaled(parameters.height, scale))
        image_input = index > 0 or "image" in takes
        plans.append(
            FlowStagePlan(
                name=stage.name,
                model=unit.name,
                model_version=unit.version,
                queue=unit.queue,
                parameters=parameters,
                output=stage.output,
                resize=stage.resize,
                handoff=stage.handoff,
                steps=stage_steps(parameters, stage.handoff, image_input),
            )
        )
    return plans


def _scaled(size: int, scale: float) -> int:
    return int(math.floor(size * scale + 0.5))


def total_steps(plans: Sequence[FlowStagePlan]) -> int:
    """A flow's progress total: every stage's steps."""
    return sum(plan.steps for plan in plans)
