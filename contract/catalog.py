"""The model catalog: loads `models.yaml`, the single list of served models."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_CATALOG_PATH = Path(__file__).with_name("models.yaml")

Task = Literal["text-to-image", "image-to-image"]


class Replicas(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: int = Field(ge=0)
    max: int = Field(ge=1)


class GenerationDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    strength: float | None = None


class GenerationLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_inference_steps: int
    max_width: int
    max_height: int


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    version: str
    task: Task
    pipeline: Literal["StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"]
    weights_path: str
    hardware: Literal["l4", "a100"]
    gpu_sharing: bool
    max_batch_size: int = Field(ge=1)
    max_instances_per_request: int = Field(ge=1)
    request_timeout_seconds: int = Field(ge=1)
    ack_deadline_seconds: int = Field(ge=10, le=600)
    max_delivery_attempts: int = Field(ge=5, le=100)
    drain_seconds: int = Field(ge=0)
    replicas: Replicas
    defaults: GenerationDefaults
    limits: GenerationLimits


class ModelCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int
    models: dict[str, ModelSpec]

    @classmethod
    def from_yaml(cls, path: Path | str = DEFAULT_CATALOG_PATH) -> ModelCatalog:
        raw = yaml.safe_load(Path(path).read_text())
        # A copy per entry: YAML aliases can make two models share one mapping.
        raw["models"] = {name: {**spec, "name": name} for name, spec in (raw.get("models") or {}).items()}
        return cls.model_validate(raw)

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def names(self) -> list[str]:
        return sorted(self.models)


@lru_cache(maxsize=4)
def load_catalog(path: str | None = None) -> ModelCatalog:
    return ModelCatalog.from_yaml(path or DEFAULT_CATALOG_PATH)
