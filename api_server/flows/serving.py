"""Flows on the request path: a flow is called like a model (`POST /v1/models/{flow}:predict`, jobs, events,
cancel, deadlines, idempotency, cache and coalescing, priority), and the serving stage never knows it is one.

A call to a flow resolves each stage's unit as a single call to that model would (the traffic split and its
canary, per stage), then goes on as a `FlowModel`: a `ModelSpec` named for the flow whose queue is the first
stage's unit, whose version names every stage's unit (so the cache never answers one version's image for
another's) and whose timeout covers every stage. Its request is validated against the flow's request contract
(contract/flows.py), adapters resolved for the stages that take them, each stage planned with the contract's
`plan_stages`, and the message published once, to the first stage's unit, carrying the `FlowContext`; the
workers run the stages (in one process when one worker group serves them all, else queue to queue) and only
the last stage answers. The log rows it leaves are `rows.py`'s. A stage the split sent to a canary that fails
it is asked again on its model's stable version, as a direct call to that model would be (`FlowCall.fallback`
for a sync call, `FlowCall.all_stable` for a job; predict/serving.py asks), and every stage that ran feeds the
rollback guard (`observed.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.predict.adapters import AdapterService
from api_server.predict.controls import ControlService
from api_server.predict.schemas import PredictBody
from contract.catalog import ModelCatalog
from contract.flows import FlowError, FlowSpec, plan_stages
from contract.generation import ROLES, AdapterRef, ControlRef, GenerationParameters
from contract.messages import FlowContext, FlowStagePlan, InferenceRequest, StageReport
from contract.model_spec import TASK_INPUTS, ModelSpec

# How a flow's version names its stages' units: `base=1,refiner=2`.
VERSION_SEPARATOR = ","


class FlowModel(ModelSpec):
    """A flow as the request path sees a model: published to its first stage's unit, timed over all stages."""

    first_queue: str = ""
    first_deployment: str = ""
    # Its inpaint stages (contract/flows.py `mask_stages`): its request carries a mask whatever its first stage's task.
    mask_stages: tuple[str, ...] = ()

    @property
    def queue(self) -> str:
        return self.first_queue

    @property
    def takes_mask(self) -> bool:
        return bool(self.mask_stages)

    @property
    def deployment(self) -> str:
        return self.first_deployment


@dataclass
class FlowCall:
    """One request to a flow: the units chosen for its stages, then (once its body is validated) their plans."""

    flow: FlowSpec
    units: list[ModelSpec]
    spec: FlowModel
    plans: list[FlowStagePlan] = field(default_factory=list)
    # Per stage, the stable version behind the unit the split chose for it when that unit is another version (a
    # canary): what the stage falls back to when that version fails it, as a direct call to its model does.
    stable: list[ModelSpec | None] = field(default_factory=list)
    # What `plan_stages` planned from (the request's parameters and resolved adapters): a fallback plans again.
    asked: dict[str, Any] = field(default_factory=dict)
    adapters: dict[str, tuple[AdapterRef, ...]] = field(default_factory=dict)
    # The control models resolved per stage that takes them (registered per model), and their images: the same
    # for every such stage, in the request's order (ControlNets', then image prompts').
    controls: dict[str, tuple[ControlRef, ...]] = field(default_factory=dict)
    control_images: list[bytes] = field(default_factory=list)

    def fallback(self, ended: StageReport) -> FlowCall | None:
        """This call with the stage it ended in (`ended`, a failed stage's report) on that stage's stable version,
        planned again; None when that stage already ran on its stable version (nothing to fall back to)."""
        index = ended.index
        if index >= len(self.stable) or self.stable[index] is None or ended.model_version != self.units[index].version:
            return None
        return self._on_stable({index})

    def all_stable(self) -> FlowCall | None:
        """This call with every stage the split sent to a canary on its stable version (a job's fallback, asked if
        one of them fails it: which one is known only then); None when every stage is on its stable version."""
        return self._on_stable({index for index, stable in enumerate(self.stable) if stable is not None})

    def _on_stable(self, indices: set[int]) -> FlowCall | None:
        if not indices:
            return None
        units = [stable if index in indices and stable is not None else unit
                 for index, (unit, stable) in enumerate(zip(self.units, self.stable, strict=True))]  # fmt: skip
        behind = [None if index in indices else stable for index, stable in enumerate(self.stable)]
        call = FlowCall(self.flow, units, flow_model(self.flow, units), stable=behind, asked=self.asked,
                        adapters=self.adapters, controls=self.controls,
                        control_images=self.control_images)  # fmt: skip
        call.plans = plan_stages(self.flow, units, self.asked, self.adapters, self.controls)
        return call

    def check(
        self,
        body: PredictBody,
        params: GenerationParameters,
        adapters: AdapterService | None,
        controls: ControlService | None = None,
    ) -> None:
        """Refuses (422, naming the field) what no stage takes, then plans every stage."""
        contract = self.flow.request_contract
        given = body.parameters.model_dump(exclude_none=True, exclude={"priority"})
        for name in given:
            # Image prompts ride in the parameters' controls (their IP-Adapters after the ControlNets).
            if (name if name != "image_prompts" else "controls") not in contract.takes:
                raise ApiError(422, f"parameters.{name}: flow {self.flow.name} does not take it ({_fixed_by(self.flow, name)})",
                               f"parameters.{name}")  # fmt: skip
        for axis in ("width", "height"):
            if getattr(params, axis) % contract.size_multiple:
                raise ApiError(422, f"parameters.{axis}: must be a multiple of {contract.size_multiple} for flow "
                               f"{self.flow.name} (every stage's size after its resizes must fit its model)",
                               f"parameters.{axis}")  # fmt: skip
        asked: dict[str, Any] = {name: value for name, value in given.items()
                                 if name in ROLES and name not in ("adapters", "controls")}  # fmt: skip
        asked["seed"] = params.seed
        resolved = self._adapters(body, adapters)
        self.asked, self.adapters = asked, resolved
        self._controls(body, controls)
        try:
            self.plans = plan_stages(self.flow, self.units, asked, resolved, self.controls)
        except FlowError as exc:
            raise ApiError(422, f"parameters: {exc}", "parameters") from exc

    def _adapters(self, body: PredictBody, adapters: AdapterService | None) -> dict[str, tuple[AdapterRef, ...]]:
        """The request's adapters, resolved for each stage that takes them (they are registered per model)."""
        requested = body.parameters.adapters
        if not requested:
            return {}
        if adapters is None:
            raise ApiError(422, "parameters.adapters: not served here", "parameters.adapters")
        taking = {stage.name: unit for stage, unit in zip(self.flow.stages, self.units, strict=True)
                  if "adapters" in self.flow.takes(stage.name)}  # fmt: skip
        return {name: adapters.resolve(unit, requested) for name, unit in taking.items()}

    def _controls(self, body: PredictBody, controls: ControlService | None) -> None:
        """The request's control models, resolved for each stage that takes them as predict resolves them for its
        model (the same 422s), and their images."""
        requested, prompts = body.parameters.controls, body.parameters.image_prompts
        if not requested and not prompts:
            return
        if controls is None:
            field = "parameters.controls" if requested else "parameters.image_prompts"
            raise ApiError(422, f"{field}: not served here", field)
        for stage, unit in zip(self.flow.stages, self.units, strict=True):
            if "controls" in self.flow.takes(stage.name):
                refs, images = controls.resolve_all(unit, requested, prompts)
                self.controls[stage.name], self.control_images = refs, images

    @property
    def logged_controls(self) -> tuple[ControlRef, ...]:
        """Each control model once, as the stages that take it resolved it (the flow's cache key and log row)."""
        seen: dict[tuple, ControlRef] = {}
        for refs in self.controls.values():
            for ref in refs:
                seen.setdefault((ref.name, ref.kind, ref.version, ref.sha256), ref)
        return tuple(seen.values())

    def message(self, request: InferenceRequest) -> InferenceRequest:
        """The flow's request as its first stage's unit takes it, with every stage's plan on it."""
        first = self.plans[0]
        return request.model_copy(
            update={
                "model": first.model,
                "model_version": first.model_version,
                "parameters": first.parameters,
                "flow": FlowContext(flow=self.flow.name, stages=self.plans),
            }
        )


class FlowService:
    def __init__(self, catalog: ModelCatalog, choose: Callable[[str, str, Caller], ModelSpec]) -> None:
        """`choose(model, request_id, caller)`: the unit a single call to `model` would get (split, canary)."""
        self._catalog = catalog
        self._choose = choose

    def names(self) -> list[str]:
        return sorted(self._catalog.flows)

    def get(self, name: str) -> FlowSpec | None:
        return self._catalog.flow(name)

    def call(self, flow: FlowSpec, request_id: str, caller: Caller) -> FlowCall:
        """A request to `flow`: each stage's unit chosen as for a single call to its model."""
        units = [self._choose(stage.model, request_id, caller) for stage in flow.stages]
        return FlowCall(flow, units, flow_model(flow, units), stable=[self._stable_behind(unit) for unit in units])

    def _stable_behind(self, unit: ModelSpec) -> ModelSpec | None:
        """The stable version of `unit`'s model when `unit` is another of its versions (a canary), else None."""
        rollout = self._catalog.rollout(unit.name)
        if rollout is None or unit.version == rollout.stable:
            return None
        return rollout.versions[rollout.stable]

    def stable(self, flow: FlowSpec) -> FlowModel:
        """The flow as its stages' stable versions make it (what the catalog listing shows)."""
        return flow_model(flow, [self._stable_unit(stage.model) for stage in flow.stages])

    def _stable_unit(self, model: str) -> ModelSpec:
        spec = self._catalog.get(model)
        assert spec is not None, f"flow stage model {model} is checked at catalog load"
        return spec

    def view(self, flow: FlowSpec) -> dict:
        """A flow as `GET /v1/models` lists it: called like a model, with its stages in order."""
        spec, contract = self.stable(flow), flow.request_contract
        return {
            "name": flow.name,
            "version": spec.version,
            "versions": [spec.version],
            "task": contract.task,
            "inputs": list(dict.fromkeys([*TASK_INPUTS[contract.task], *(["mask"] if contract.mask_stages else [])])),
            "family": None,
            "guidance": _guidance(flow, self._stable_unit),
            "size_multiple": contract.size_multiple,
            "max_instances_per_request": contract.max_instances_per_request,
            "request_timeout_seconds": spec.request_timeout_seconds,
            "defaults": contract.defaults.model_dump(exclude_none=True),
            "limits": contract.limits.model_dump(),
            "kind": "flow",
            "stages": [
                {
                    "name": stage.name,
                    "model": stage.model,
                    "output": stage.output,
                    "resize": stage.resize.model_dump() if stage.resize else None,
                    "takes": list(flow.takes(stage.name)),
                    "fixes": dict(stage.fixes) or None,
                }
                for stage in flow.stages
            ],
        }


def stage_versions(stages: list[tuple[str, str]]) -> str:
    """A flow's version, from its stages' (name, version): `base=1,refiner=2`."""
    return VERSION_SEPARATOR.join(f"{name}={version}" for name, version in stages)


def planned_flow(catalog: ModelCatalog, context: FlowContext) -> FlowModel | None:
    """The flow a published flow message runs, as the request path's `ModelSpec` (None: no longer in the catalog)."""
    flow = catalog.flow(context.flow)
    units = [catalog.version(plan.model, plan.model_version) for plan in context.stages]
    if flow is None or any(unit is None for unit in units) or len(units) != len(flow.stages):
        return None
    return flow_model(flow, units)  # type: ignore[arg-type]


def flow_model(flow: FlowSpec, units: list[ModelSpec]) -> FlowModel:
    """The flow as the request path's `ModelSpec`, for these units (not validated: a flow has no pipeline)."""
    contract, first = flow.request_contract, units[0]
    version = stage_versions([(stage.name, unit.version) for stage, unit in zip(flow.stages, units, strict=True)])
    values = {name: getattr(first, name) for name in ModelSpec.model_fields}
    values.update(
        name=flow.name,
        version=version,
        versioned=False,
        task=contract.task,
        pipeline=None,
        weights_path="",
        defaults=contract.defaults,
        limits=contract.limits,
        max_instances_per_request=contract.max_instances_per_request,
        # The caller waits for every stage (each within its own model's timeout) before a sync call becomes a job.
        request_timeout_seconds=sum(unit.request_timeout_seconds for unit in units),
        adapters=None,
        first_queue=first.queue,
        first_deployment=first.deployment,
        mask_stages=contract.mask_stages,
    )
    return FlowModel.model_construct(**values)


def _fixed_by(flow: FlowSpec, name: str) -> str:
    fixing = [stage.name for stage in flow.stages if name in stage.fixes]
    if fixing:
        return f"stage {', '.join(fixing)} fixes it"
    return "no stage takes it"


def _guidance(flow: FlowSpec, unit: Callable[[str], ModelSpec]) -> str:
    """`cfg` when a stage takes a negative prompt, else the first stage's guidance."""
    if "negative_prompt" in flow.request_contract.takes:
        return "cfg"
    return unit(flow.stages[0].model).guidance_mode
