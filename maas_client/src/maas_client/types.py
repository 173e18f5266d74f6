"""The API's bodies as pydantic models (checked against the server's /openapi.json by the project's tests)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field

JobStatus = Literal["queued", "running", "succeeded", "failed", "expired", "cancelled"]


class _Body(BaseModel):
    # A newer server may add fields: an older SDK keeps working.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class GenerationDefaults(_Body):
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    strength: float | None = None


class GenerationLimits(_Body):
    max_inference_steps: int
    max_width: int
    max_height: int
    max_input_pixels: int | None = None


class FlowStage(_Body):
    """One stage of a flow as `GET /v1/models` lists it: the served model that runs it and how it goes on."""

    name: str
    model: str
    output: Literal["image", "latent"]
    resize: dict[str, Any] | None = None
    takes: list[str] | None = None
    fixes: dict[str, Any] | None = None


class Control(TypedDict):
    """A ControlNet of `predict(controls=[...])` (`parameters.controls`): a registered ControlNet's name, its control
    image (a path, bytes or a PIL image), its scale and `start`/`end` window, `preprocess: "canny"` (with
    `low_threshold`, `high_threshold`), and for a ControlNet Union its `mode` (the index its model card numbers)."""

    name: str
    image: Any
    scale: NotRequired[float]
    start: NotRequired[float]
    end: NotRequired[float]
    mode: NotRequired[int]
    preprocess: NotRequired[Literal["canny"]]
    low_threshold: NotRequired[int]
    high_threshold: NotRequired[int]


class ImagePrompt(TypedDict):
    """An image prompt of `predict(image_prompts=[...])` (`parameters.image_prompts`): a registered IP-Adapter's name,
    its reference image (a path, bytes or a PIL image) and its scale."""

    name: str
    image: Any
    scale: NotRequired[float]


class ControlInfo(_Body):
    """A control model registered for a model (PUT /v1/models/{model}/controls/{name})."""

    name: str
    kind: str  # controlnet, ip_adapter
    version: str


class ModelInfo(_Body):
    name: str
    version: str  # the stable one
    versions: list[str]  # every live version
    task: Literal["text-to-image", "image-to-image", "inpaint", "edit"]
    # What each instance carries (prompt; image; mask); None from servers older than inpainting.
    inputs: list[Literal["prompt", "image", "mask"]] | None = None
    family: str | None  # sd15, sdxl, flux, sd3; None for the synthetic models
    guidance: Literal["cfg", "embedded", "none"]  # what guidance_scale means for the model
    size_multiple: int  # width and height must be multiples of this
    max_instances_per_request: int
    request_timeout_seconds: int
    defaults: GenerationDefaults
    limits: GenerationLimits
    # What the model needs on its GPU (weights per component, activation peak, its worker's sum and room);
    # None for the synthetic models and from servers older than the memory plan (docs/concepts/memory-plan.md).
    memory_plan: dict | None = None
    # `flow`: several served models in one call (its stages, in order); called like a model.
    kind: Literal["model", "flow"] = "model"
    stages: list[FlowStage] | None = None
    # The control models it takes (`controlnet`: `controls=`, `ip_adapter`: `image_prompts=`); empty from older servers.
    control_kinds: list[str] = Field(default_factory=list)


class ModelDetail(ModelInfo):
    """One model's own page (`model(name)`, GET /v1/models/{model}): the listing's fields, its stable version and
    the split in force, and the control models registered for it."""

    stable_version: str
    sticky: Literal["api_key"] | None = None
    traffic: dict | None = None  # percent per version, and a shadow
    controls: list[ControlInfo] = Field(default_factory=list)


class ModelList(_Body):
    models: list[ModelInfo]


class Prediction(_Body):
    image_b64: str = Field(repr=False)
    mime_type: str
    seed: int
    width: int
    height: int

    @property
    def image_bytes(self) -> bytes:
        return base64.b64decode(self.image_b64)


class StageTimings(_Body):
    stage: str
    model: str
    model_version: str
    queue_ms: float
    inference_ms: float
    # The stage a flow ended in without finishing (a worker held it): error, expired or cancelled; None: finished.
    status: str | None = None
    error_kind: str | None = None


class FallbackFrom(_Body):
    """The model asked for, when it was overloaded and the request allowed a fallback (`allow_fallback`)."""

    model: str
    model_version: str
    reason: str


class PredictResponse(_Body):
    predictions: list[Prediction]
    model: str
    model_version: str
    request_id: str
    timings_ms: dict[str, float]
    stages: list[StageTimings] | None = None  # a flow's: every stage that ran, in order
    fallback_from: FallbackFrom | None = None  # `model` and `model_version` are then the fallback's


class JobLinks(_Body):
    self_: str = Field(alias="self")


class JobAccepted(_Body):
    id: str
    status: Literal["queued", "succeeded"]  # succeeded at once when the cache held the answer
    model: str
    links: JobLinks
    message: str | None = None


class JobProgress(_Body):
    step: int
    total: int
    # A flow's job: the stage running (step and total count all its stages' steps).
    stage: str | None = None
    stage_index: int | None = None


class JobResult(_Body):
    predictions: list[Prediction]
    timings_ms: dict[str, float]
    stages: list[StageTimings] | None = None  # a flow's job: every stage that ran, in order


class JobError(_Body):
    code: int
    message: str
    kind: str | None = None
    stages: list[StageTimings] | None = None  # a flow's that did not finish: the stages that ran, in order


class JobView(_Body):
    id: str
    status: JobStatus
    model: str
    model_version: str
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    links: JobLinks
    progress: JobProgress | None = None
    result: JobResult | None = None
    error: JobError | None = None

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed", "expired", "cancelled")


class JobList(_Body):
    """A page of `GET /v1/jobs`: the caller's jobs, newest first, without results."""

    jobs: list[JobView]
    next_cursor: str | None


class UsageRow(_Body):
    day: str
    model: str
    requests: int
    succeeded: int
    images: int
    cache_hits: int
    gpu_seconds: float


class UsageTotals(_Body):
    requests: int
    succeeded: int
    images: int
    cache_hits: int
    gpu_seconds: float


class BatchUsage(_Body):
    batch_job_id: str
    model: str
    lines: int
    succeeded: int
    images: int
    gpu_seconds: float


class Usage(_Body):
    api_key_id: str
    since: str
    days: list[UsageRow]
    totals: UsageTotals
    batches: list[BatchUsage]


BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired"
]
BATCH_ENDED = ("completed", "failed", "cancelled", "expired")


class RequestCounts(_Body):
    total: int
    succeeded: int
    failed: int
    cancelled: int
    expired: int

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled + self.expired


class BatchError(_Body):
    code: int
    message: str


class BatchView(_Body):
    """A batch job (`POST /v1/batches`) as `GET /v1/batches/{id}` shows it."""

    id: str
    object: Literal["batch"]
    status: BatchStatus
    input_file: str | None = None  # the gs:// file; None for a table's batch
    input_table: str | None = None  # the bq:// table, for a table's batch
    completion_window: str
    request_counts: RequestCounts
    created_at: str
    expires_at: str
    in_progress_at: str | None = None
    finalizing_at: str | None = None
    cancelling_at: str | None = None
    completed_at: str | None = None
    failed_at: str | None = None
    cancelled_at: str | None = None
    expired_at: str | None = None
    output: dict[str, str]
    links: dict[str, str]
    metadata: dict[str, str]
    error: BatchError | None = None

    @property
    def ended(self) -> bool:
        return self.status in BATCH_ENDED


class BatchList(_Body):
    batches: list[BatchView]
    next_before: str | None


class Result(BaseModel):
    """A finished generation: the images (PNG bytes, or PIL images with the `pil` extra), seeds and timings."""

    model: str
    model_version: str
    request_id: str
    predictions: list[Prediction]
    timings_ms: dict[str, float]
    job_id: str | None = None
    cache: str | None = Field(default=None, description="`hit` or `miss` for seeded requests (X-Cache)")

    @property
    def images(self) -> list[bytes]:
        return [prediction.image_bytes for prediction in self.predictions]

    @property
    def seed(self) -> int:
        return self.predictions[0].seed

    @property
    def seeds(self) -> list[int]:
        return [prediction.seed for prediction in self.predictions]

    def pil_images(self) -> list[Any]:
        """The images as PIL images (needs Pillow: `pip install maas-client[pil]`)."""
        import io

        from PIL import Image

        return [Image.open(io.BytesIO(data)) for data in self.images]

    def save(self, directory: str | Path) -> list[Path]:
        """Writes `<request id>-<i>.png` per image into `directory` (created if missing); returns the paths."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for index, data in enumerate(self.images):
            path = out / f"{self.request_id}-{index}.png"
            path.write_bytes(data)
            paths.append(path)
        return paths
