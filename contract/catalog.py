"""The model catalog: loads `models.yaml`, the single list of served models."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.generation import defaults_model

DEFAULT_CATALOG_PATH = Path(__file__).with_name("models.yaml")

Task = Literal["text-to-image", "image-to-image"]
# `noop` and `sleep` are synthetic runners that go through the worker's whole path: benchmarks and tests.
RunnerKind = Literal["diffusers", "noop", "sleep"]
# The longest ack deadline that still lets a second worker finish a crashed worker's request in time.
ACK_DEADLINE_SHARE_OF_TIMEOUT = 1 / 3


class Replicas(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: int = Field(ge=0)
    max: int = Field(ge=1)


# The parameters whose role (contract/generation.py) has a catalog default.
GenerationDefaults = defaults_model("GenerationDefaults")


class GenerationLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_inference_steps: int
    max_width: int
    max_height: int
    # Input images are refused above this many pixels before they are decoded (decompression bombs).
    max_input_pixels: int = Field(default=2048 * 2048, ge=64 * 64)


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    version: str
    task: Task
    runner: RunnerKind = "diffusers"
    pipeline: Literal["StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"] | None = None
    weights_path: str = ""
    hardware: Literal["l4", "a100"]
    gpu_sharing: bool
    # Models with the same worker group are served by one worker deployment, one process loading each
    # pipeline once (GPU time-sharing between models); unset means a deployment of its own.
    worker_group: str | None = None
    max_batch_size: int = Field(ge=1)
    max_instances_per_request: int = Field(ge=1)
    request_timeout_seconds: int = Field(ge=1)
    ack_deadline_seconds: int = Field(ge=10, le=600)
    max_delivery_attempts: int = Field(ge=5, le=100)
    drain_seconds: int = Field(ge=0)
    replicas: Replicas
    defaults: GenerationDefaults
    limits: GenerationLimits

    @property
    def deployment(self) -> str:
        """The worker deployment that serves this model."""
        return self.worker_group or self.name

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.runner == "diffusers" and not (self.pipeline and self.weights_path):
            raise ValueError(f"{self.name}: the diffusers runner needs `pipeline` and `weights_path`")
        if self.max_instances_per_request > self.max_batch_size:
            raise ValueError(
                f"{self.name}: max_instances_per_request exceeds max_batch_size (one request is one batch)"
            )
        # A crashed worker's request is redelivered only when its ack deadline passes; the lease is extended
        # while it runs, so a short deadline costs nothing and leaves time for a second worker to answer.
        if self.ack_deadline_seconds > self.request_timeout_seconds * ACK_DEADLINE_SHARE_OF_TIMEOUT:
            raise ValueError(
                f"{self.name}: ack_deadline_seconds {self.ack_deadline_seconds} must be at most a third of "
                f"request_timeout_seconds {self.request_timeout_seconds}, or a crashed worker's requests time out"
            )
        return self


class ModelCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int
    models: dict[str, ModelSpec]

    @classmethod
    def from_yaml(cls, path: Path | str = DEFAULT_CATALOG_PATH, overlay: Path | str | None = None) -> ModelCatalog:
        """The catalog, plus the models of an overlay file (the local stack's synthetic models) when given."""
        raw = yaml.safe_load(Path(path).read_text())
        models = dict(raw.get("models") or {})
        if overlay:
            models.update((yaml.safe_load(Path(overlay).read_text()) or {}).get("models") or {})
        # A copy per entry: YAML aliases can make two models share one mapping.
        raw["models"] = {name: {**spec, "name": name} for name, spec in models.items()}
        return cls.model_validate(raw)

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def names(self) -> list[str]:
        return sorted(self.models)

    def deployments(self) -> dict[str, list[ModelSpec]]:
        """Worker deployments and the models each serves, in name order."""
        groups: dict[str, list[ModelSpec]] = {}
        for name in self.names():
            groups.setdefault(self.models[name].deployment, []).append(self.models[name])
        return dict(sorted(groups.items()))


@lru_cache(maxsize=8)
def load_catalog(path: str | None = None, overlay: str | None = None) -> ModelCatalog:
    return ModelCatalog.from_yaml(path or DEFAULT_CATALOG_PATH, overlay)
