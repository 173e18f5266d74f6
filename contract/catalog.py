"""The model catalog: loads `models.yaml`, the single list of served models (and the local stack's overlays)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract import naming
from contract.flows import FlowSpec, build_flows
from contract.memory_plan import DeploymentPlan, deployment_plan, unit_plan
from contract.model_spec import ModelSpec

DEFAULT_CATALOG_PATH = Path(__file__).with_name("models.yaml")


class Shadow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str
    percent: float = Field(gt=0, le=100)


class RollbackPolicy(BaseModel):
    """When a canary is taken to 0%: over the last `window_seconds`, once both versions have `min_requests`,
    its error rate exceeds the stable one's by more than `max_error_rate_delta`, or its p95 latency is more
    than `max_p95_ratio` times the stable one's."""

    model_config = ConfigDict(extra="forbid")
    window_seconds: int = Field(ge=5, le=86400)
    min_requests: int = Field(ge=1)
    max_error_rate_delta: float = Field(ge=0, le=1)
    max_p95_ratio: float = Field(gt=1)


class Rollout(BaseModel):
    """A model's versions and how traffic is shared between them (the catalog's default split)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    versions: dict[str, ModelSpec]
    traffic: dict[str, float]
    shadow: Shadow | None = None
    sticky: Literal["api_key"] | None = None
    rollback: RollbackPolicy | None = None
    # The version the others are measured against and that takes a rolled-back canary's share.
    stable: str

    @model_validator(mode="after")
    def _consistent(self) -> Rollout:
        if self.stable not in self.versions:
            raise ValueError(f"{self.name}: stable version {self.stable!r} is not one of {sorted(self.versions)}")
        problem = split_problem(self.versions, self.traffic, self.shadow, self.stable)
        if problem:
            raise ValueError(f"{self.name}: {problem[1]}")
        stable = self.versions[self.stable]
        for version, spec in self.versions.items():
            if (difference := request_contract_difference(stable, spec)) is not None:
                field, want, have = difference
                raise ValueError(
                    f"{self.name}: version {version!r} sets {field} to {have!r} where the stable version "
                    f"{self.stable!r} has {want!r}; every version of a model must accept and resolve "
                    f"the same requests ({', '.join(REQUEST_CONTRACT)} are the model's, not a version's), or a "
                    "request's answer would depend on the split: serve the narrower one as a model of its own"
                )
        return self

    @property
    def canaries(self) -> list[str]:
        return [version for version in self.versions if version != self.stable]


def split_problem(
    versions: dict[str, ModelSpec], traffic: dict[str, float], shadow: Shadow | None, stable: str
) -> tuple[str, str] | None:
    """(field, message) of what is wrong with a split, or None: shared by the catalog and the runtime PUT."""
    unknown = sorted(set(traffic) - set(versions))
    if unknown:
        return "traffic", f"traffic names unknown versions {unknown}; the model has {sorted(versions)}"
    if any(share < 0 for share in traffic.values()):
        return "traffic", "traffic shares must be 0 to 100"
    if abs(sum(traffic.values()) - 100) > 1e-6:
        return "traffic", f"traffic shares must sum to 100, not {sum(traffic.values()):g}"
    if shadow is not None:
        if shadow.version not in versions:
            return (
                "shadow.version",
                f"shadow names unknown version {shadow.version!r}; the model has {sorted(versions)}",
            )
        if shadow.version == stable:
            return "shadow.version", f"shadow version {shadow.version!r} is the stable version"
    return None


# What decides whether a request is accepted and what it means once resolved (api_server/predict/schemas.py and
# adapters.py read these): the same for every version of a model, so the split never changes a request's fate,
# and the stable version can take any request a canary failed. The adapter caches are the worker's business.
REQUEST_CONTRACT = ("task", "max_instances_per_request", "defaults", "limits", "adapters")
WORKER_ONLY_ADAPTER_FIELDS = frozenset({"host_cache", "device_cache"})


def _request_contract(spec: ModelSpec) -> dict[str, object]:
    view = spec.model_dump(include=set(REQUEST_CONTRACT))
    if view["adapters"] is not None:
        view["adapters"] = {k: v for k, v in view["adapters"].items() if k not in WORKER_ONLY_ADAPTER_FIELDS}
    return view


def request_contract_difference(stable: ModelSpec, other: ModelSpec) -> tuple[str, object, object] | None:
    """(field, stable's value, other's value) of the first request-contract field where they differ, or None."""
    want, have = _request_contract(stable), _request_contract(other)
    for name in REQUEST_CONTRACT:
        mine, theirs = want[name], have[name]
        if isinstance(mine, dict) and isinstance(theirs, dict):
            for key in [*mine, *(key for key in theirs if key not in mine)]:
                if mine.get(key) != theirs.get(key):
                    return f"{name}.{key}", mine.get(key), theirs.get(key)
        elif mine != theirs:
            return name, mine, theirs
    return None


VERSIONED_ONLY = ("traffic", "shadow", "sticky", "rollback", "stable")


def _expand(name: str, entry: dict) -> tuple[list[dict], dict | None]:
    """A catalog entry as its units (one per version) and, for a versioned entry, its rollout fields."""
    if problem := naming.model_name_problem(name):
        raise ValueError(problem)
    entry = {**entry, "name": name}
    if "versions" not in entry:
        stray = [key for key in VERSIONED_ONLY if key in entry]
        if stray:
            raise ValueError(f"{name}: {', '.join(stray)} need `versions`")
        return [entry], None
    versions = entry.pop("versions") or {}
    rollout = {key: entry.pop(key) for key in VERSIONED_ONLY if key in entry}
    entry.pop("version", None)
    units = [{**entry, **(override or {}), "name": name, "version": str(v), "versioned": True}
             for v, override in versions.items()]  # fmt: skip
    for unit in units:
        if problem := naming.version_name_problem(unit["version"]):
            raise ValueError(f"{name}: {problem}")
    if not versions:
        raise ValueError(f"{name}: `versions` lists no version")
    # No split given: the first version takes everything (the others are reachable pinned, or by a PUT).
    traffic = {str(v): share for v, share in (rollout.get("traffic") or {str(next(iter(versions))): 100}).items()}
    rollout["traffic"] = traffic
    rollout.setdefault("stable", max(traffic, key=lambda v: traffic[v]))
    rollout["stable"] = str(rollout["stable"])
    return units, rollout


# What an overlay file may hold: `models` adds (or replaces) entries; `overrides` changes fields of entries a file
# before it lists (the local stack's small defaults for its tiny models); `templates` holds YAML anchors only;
# `flows` adds (or replaces) flows (contract/flows.py).
OVERLAY_KEYS = ("models", "overrides", "templates", "flows")


def overlay_paths(overlay: Path | str | Sequence[Path | str] | None) -> list[Path]:
    """Overlay files: a path, a list of paths, or one string of paths separated by commas (MAAS_CATALOG_OVERLAY)."""
    if not overlay:
        return []
    items = overlay.split(",") if isinstance(overlay, str) else [overlay] if isinstance(overlay, Path) else overlay
    return [Path(str(item).strip()) for item in items if str(item).strip()]


# The keys of a model entry (ModelSpec's fields, and a versioned entry's), to tell one that landed under `flows:`.
MODEL_ENTRY_KEYS = frozenset(ModelSpec.model_fields) - {"name", "versioned"} | {"versions", *VERSIONED_ONLY}


def _misplaced_models(path: Path, raw: dict, models: dict) -> None:
    """A model entry in a file's `flows:` section (lines appended at the end of a file whose last section is
    `flows:` land there) is refused naming the section and what a model entry needs, rather than as a flow
    without `stages`."""
    for name, entry in (raw.get("flows") or {}).items():
        model_keys = sorted(set(entry) & MODEL_ENTRY_KEYS) if isinstance(entry, dict) else []
        if not model_keys or "stages" in entry:
            continue
        needed = [key for key, field in ModelSpec.model_fields.items() if field.is_required() and key != "name"
                  and not (key == "version" and "versions" in entry)]  # fmt: skip
        missing = [key for key in needed if key not in entry]
        lacks = f"it lacks {', '.join(missing)}" if len(missing) < len(needed) else "it has none of them"
        override = f"; or, to change the listed model {name!r}, under `overrides:`" if name in models else ""
        raise ValueError(
            f"{path}: {name!r} sits in the `flows:` section (the file's last section: lines appended at the end of "
            f"the file land in it), but it is a model entry ({', '.join(model_keys)}), and a flow needs `stages`. "
            f"Move it under `models:`, where a model entry needs {', '.join(needed)}"
            + (f" ({lacks}: a YAML merge `<<: *anchor` of another entry gives them)" if missing else "")
            + override
        )  # fmt: skip


def _apply_overlay(entries: dict, flows: dict, path: Path) -> None:
    raw = yaml.safe_load(path.read_text()) or {}
    if unknown := sorted(set(raw) - set(OVERLAY_KEYS)):
        raise ValueError(f"{path}: unknown keys {unknown}; an overlay holds {', '.join(OVERLAY_KEYS)}")
    _misplaced_models(path, raw, {**entries, **(raw.get("models") or {})})
    entries.update(raw.get("models") or {})
    flows.update(raw.get("flows") or {})
    for name, changes in (raw.get("overrides") or {}).items():
        if name not in entries:
            raise ValueError(f"{path}: overrides {name!r}, which no catalog file before it lists")
        entries[name] = _merged(entries[name], changes)


def _merged(base: dict, changes: dict) -> dict:
    """`base` with `changes`: mappings merged key by key, anything else replaced."""
    merged = dict(base)
    for key, value in changes.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both else value
    return merged


class ModelCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int
    # One spec per model as clients see it: a versioned model's stable version.
    models: dict[str, ModelSpec]
    # Versioned models only (`versions:` in the catalog).
    rollouts: dict[str, Rollout] = Field(default_factory=dict)
    # Flows: several served models called as one (contract/flows.py), checked against `models` at load.
    flows: dict[str, FlowSpec] = Field(default_factory=dict)

    @classmethod
    def from_yaml(
        cls, path: Path | str = DEFAULT_CATALOG_PATH, overlay: Path | str | Sequence[Path | str] | None = None
    ) -> ModelCatalog:
        """The catalog, plus overlay files (the local stack's) applied in order, when given (`overlay_paths`)."""
        raw = yaml.safe_load(Path(path).read_text())
        entries = dict(raw.get("models") or {})
        _misplaced_models(Path(path), raw, entries)
        flows = dict(raw.get("flows") or {})
        for overlay_path in overlay_paths(overlay):
            _apply_overlay(entries, flows, overlay_path)
        models, rollouts = {}, {}
        for name, entry in entries.items():
            # A copy per entry: YAML aliases can make two models share one mapping.
            units, rollout = _expand(name, dict(entry))
            if rollout is None:
                models[name] = units[0]
                continue
            versions = {unit["version"]: ModelSpec.model_validate(unit) for unit in units}
            rollouts[name] = Rollout.model_validate({**rollout, "name": name, "versions": versions})
            models[name] = versions[rollouts[name].stable]
        raw["models"], raw["rollouts"] = models, rollouts
        raw.pop("flows", None)
        catalog = cls.model_validate(raw)
        catalog.flows = build_flows(flows, catalog.models)
        return catalog

    @model_validator(mode="after")
    def _plans_fit(self) -> ModelCatalog:
        """Every unit, then every worker deployment (its units' weights summed), fits its GPU (contract/memory_plan.py)."""
        for spec in self.units():
            if (problem := deployment_plan(spec.queue, [spec]).problem()) is not None:
                raise ValueError(problem)
        for plan in self.deployment_plans().values():
            if (problem := plan.problem()) is not None:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _fallbacks_exist(self) -> ModelCatalog:
        """An admission fallback is another served model of the same task, without a fallback of its own (one hop)."""
        for spec in self.units():
            fallback = spec.admission.fallback if spec.admission is not None else None
            if fallback is None:
                continue
            target = self.models.get(fallback)
            if target is None or fallback == spec.name:
                raise ValueError(f"{spec.name}: admission.fallback {fallback!r} is not another model of the catalog")
            if target.task != spec.task:
                raise ValueError(f"{spec.name}: admission.fallback {fallback!r} is {target.task}, not {spec.task}")
            if target.admission is not None and target.admission.fallback is not None:
                raise ValueError(f"{spec.name}: admission.fallback {fallback!r} has a fallback of its own (one hop)")
        return self

    def memory_plan(self, spec: ModelSpec) -> dict[str, object] | None:
        """A unit's memory plan and its worker deployment's (what `GET /v1/models` shows); None for a synthetic one."""
        plan = unit_plan(spec)
        if plan is None:
            return None
        return {**plan.as_dict(), "worker_deployment": self.deployment_plans()[spec.deployment].as_dict()}

    def deployment_plans(self) -> dict[str, DeploymentPlan]:
        """The memory plan of every worker deployment, by deployment name."""
        return {name: deployment_plan(name, specs) for name, specs in self.deployments().items()}

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def names(self) -> list[str]:
        return sorted(self.models)

    def flow(self, name: str) -> FlowSpec | None:
        return self.flows.get(name)

    def flow_runs_in_one_worker(self, flow: FlowSpec) -> bool:
        """Whether one worker deployment serves every stage (each stage's stable unit; a version with a
        deployment of its own is forwarded to like another group)."""
        return len({self.models[stage.model].deployment for stage in flow.stages}) == 1

    def rollout(self, name: str) -> Rollout | None:
        return self.rollouts.get(name)

    def version(self, name: str, version: str) -> ModelSpec | None:
        """One version of a model (a single-version model has only its own)."""
        rollout = self.rollouts.get(name)
        if rollout is not None:
            return rollout.versions.get(version)
        spec = self.models.get(name)
        return spec if spec is not None and spec.version == version else None

    def units(self) -> list[ModelSpec]:
        """Every servable unit (each version of a versioned model), in catalog order."""
        units: list[ModelSpec] = []
        for name, spec in self.models.items():
            rollout = self.rollouts.get(name)
            units.extend(rollout.versions.values() if rollout else [spec])
        return units

    def unit(self, queue: str) -> ModelSpec | None:
        """The unit whose queues are named after `queue` (a model name, or a version's queue name)."""
        return next((spec for spec in self.units() if spec.queue == queue), None)

    def deployments(self) -> dict[str, list[ModelSpec]]:
        """Worker deployments and the units each serves, in catalog order (the files' order, the overlay's
        last): the local stack numbers the workers' probe ports in this order."""
        groups: dict[str, list[ModelSpec]] = {}
        for spec in self.units():
            groups.setdefault(spec.deployment, []).append(spec)
        return groups


@lru_cache(maxsize=8)
def load_catalog(path: str | None = None, overlay: str | None = None) -> ModelCatalog:
    return ModelCatalog.from_yaml(path or DEFAULT_CATALOG_PATH, overlay)
