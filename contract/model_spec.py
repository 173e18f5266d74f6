"""A catalog unit's types: `ModelSpec` and what it is made of, each checked where it is built.

The loader (contract/catalog.py), the flows (contract/flows.py) and the memory plan (contract/memory_plan.py)
all take these from here, so none of them imports another to know what a model is."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract import naming
from contract.architectures import ARCHITECTURES, DEFAULT_ARCHITECTURE, Architecture
from contract.families import Family, Guidance, family_of, unknown_pipeline_error
from contract.generation import defaults_model
from contract.hardware import HARDWARE, HardwareName
from contract.quantization import FLOAT8_MIN_COMPUTE_CAPABILITY, Quantization
from contract.step_cache import StepCache
from contract.step_limits import steps_problem

# `inpaint`: an image, a mask (white repaints, black keeps) and a prompt; outpainting is an inpaint request whose
# image the API pads (api_server/predict/masks.py). `edit`: an image and an instruction (the prompt), FLUX.1 Kontext.
Task = Literal["text-to-image", "image-to-image", "inpaint", "edit"]
# What each instance of a request carries, per task (`GET /v1/models` shows it): a mask is a PNG, white repaints.
TASK_INPUTS: dict[str, tuple[str, ...]] = {
    "text-to-image": ("prompt",),
    "image-to-image": ("prompt", "image"),
    "inpaint": ("prompt", "image", "mask"),
    "edit": ("prompt", "image"),
}
# `noop` and `sleep` are synthetic runners that go through the worker's whole path: benchmarks and tests.
RunnerKind = Literal["diffusers", "noop", "sleep"]
# How the worker batches a model's requests. `request`: a batch starts together and runs all its steps
# before anyone else can join. `step`: a running set shares one denoising call per step; requests join
# between steps and leave when their own last step is done (continuous batching).
Scheduling = Literal["step", "request"]
SCHEDULINGS: tuple[str, ...] = ("step", "request")
# torch.compile's modes a model may be served in (model_worker/model/compiled.py): `default` (inductor's fused
# kernels, no autotuning: what a worker affords at start), `max-autotune-no-cudagraphs` (autotuned kernels, minutes
# per batch bucket the first time), `reduce-overhead` (CUDA graphs per batch bucket: no kernel launch cost).
CompileMode = Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"]
# diffusers schedulers that step one sample set per model call and keep all their state on the instance,
# so each running item can own one and advance it on its own slice of a shared UNet call. The
# second-order ones call the model twice per step with a state machine between the calls (Heun, KDPM2),
# and the SDE solver draws Brownian noise from a tree built for the whole batch's shape: refused for `step`.
STEPPABLE_SCHEDULERS = frozenset({
    "PNDMScheduler", "DDIMScheduler", "DDPMScheduler", "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler", "LMSDiscreteScheduler", "DPMSolverMultistepScheduler",
    "UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler", "LCMScheduler",
})  # fmt: skip
NOT_STEPPABLE_SCHEDULERS = frozenset({
    "HeunDiscreteScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler",
    "DPMSolverSDEScheduler", "DPMSolverSinglestepScheduler",
})  # fmt: skip
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


class AdapterPolicy(BaseModel):
    """LoRA adapters on a model: what a request may name (`parameters.adapters`), what registration accepts,
    and how many the worker keeps loaded. A model without this block takes no adapters."""

    model_config = ConfigDict(extra="forbid")
    max_adapters_per_request: int = Field(default=2, ge=1)
    min_scale: float = -2.0
    max_scale: float = 2.0
    max_rank: int = Field(default=128, ge=1)
    # The adapter file's size cap, checked at registration and again before the worker downloads it.
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    # Adapters the worker keeps in host memory and on the device (least recently used is dropped); the host's are
    # bounded in bytes too, for the whole worker (MAAS_ADAPTER_HOST_CACHE_BYTES, contract/settings.py).
    host_cache: int = Field(default=16, ge=1)
    device_cache: int = Field(default=4, ge=1)
    # Catalog-listed adapters, name -> version (others are registered with the admin call).
    listed: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounds(self) -> AdapterPolicy:
        if self.min_scale > self.max_scale:
            raise ValueError("adapters: min_scale exceeds max_scale")
        return self


class ImagePromptSlots(BaseModel):
    """The shape of a compiled model's IP-Adapter slots (model_worker/controls/ip_adapters.py): made in the denoiser
    before it is compiled, `max_image_prompts_per_request` of them, each a plain image projection from image embeddings
    `embedding_width` wide (its image encoder's `projection_dim`: CLIP ViT-H/14's 1024 for h94's SD 1.5 IP-Adapter,
    ViT-bigG's 1280 for its SDXL one, ViT-L/14's 768 for XLabs' FLUX.1 one) to `tokens` image tokens. An IP-Adapter
    of another shape would need other graphs: it is refused at registration and by the worker."""

    model_config = ConfigDict(extra="forbid")
    embedding_width: int = Field(ge=1)
    tokens: Literal[4, 16] = 4


class ControlPolicy(BaseModel):
    """Control models on a model (ControlNets, IP-Adapters: contract/control_files.py): how many a request may name
    (`parameters.controls`, `parameters.image_prompts`), their scales, what registration accepts. A model without
    this block takes none; its family must serve them (`Family.controls`)."""

    model_config = ConfigDict(extra="forbid")
    max_controls_per_request: int = Field(default=2, ge=1)
    max_image_prompts_per_request: int = Field(default=1, ge=1)
    min_scale: float = 0.0
    max_scale: float = 2.0
    # A control version's files together (an SD 1.5 ControlNet is 1.4 GB in float32, 0.7 GB in float16).
    max_bytes: int = Field(default=2 * 1024**3, ge=1)
    # The control budget: GPU memory for the control models' weights a worker holds (their tensors in the serving
    # dtype), counted by the memory plan beside the base weights; None: what the deployment's plan leaves. A request
    # may name `max_controls_per_request` at once, so a version larger than this over that is refused at
    # registration (contract/memory_plan.py `control_budget`).
    device_bytes: int | None = Field(default=None, ge=1)
    # A compiled model's IP-Adapter slots (`ImagePromptSlots`): required where `compile` is set and the family takes
    # IP-Adapters; a model compiled by MAAS_TORCH_COMPILE=1 without it swaps processors (and recompiles) instead.
    image_prompt_slots: ImagePromptSlots | None = None

    @model_validator(mode="after")
    def _bounds(self) -> ControlPolicy:
        if self.min_scale > self.max_scale:
            raise ValueError("controls: min_scale exceeds max_scale")
        return self


class AdmissionPolicy(BaseModel):
    """Admission by predicted wait (api_server/predict/admission.py): a request whose predicted start (the backlog
    ahead of it over the rate the model answers now) plus its own run time would miss its deadline is refused at
    once (503, `Retry-After`) instead of queued; with `fallback`, a request that allows it is answered by that
    model instead. A model without this block queues every request, as before."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    # The predicted finish is multiplied by this before it is compared with the deadline: above 1 refuses
    # earlier (the estimate is optimistic under a rising burst), 1 trusts it as it is.
    safety_factor: float = Field(default=1.0, ge=1.0, le=10.0)
    # A model of the catalog, same task, that answers an overloaded request whose caller allows it (`allow_fallback`).
    fallback: str | None = None


class SchedulerConfig(BaseModel):
    """Overrides of the scheduler's saved config that a distilled few-step model needs: SDXL-Lightning's and
    Hyper-SD's `timestep_spacing: trailing` (the schedule must start at the last training timestep), LCM's
    `original_inference_steps`. Applied over the weights' saved config when the worker loads the pipeline."""

    model_config = ConfigDict(extra="forbid")
    timestep_spacing: Literal["leading", "trailing", "linspace"] | None = None
    steps_offset: int | None = Field(default=None, ge=0)
    # LCMScheduler only: the distillation's skipping schedule (50 for LCM-LoRA and LCM-distilled models).
    original_inference_steps: int | None = Field(default=None, ge=1)

    def overrides(self) -> dict[str, object]:
        """The keyword arguments of the scheduler's `from_config`: only what the catalog sets."""
        return self.model_dump(exclude_none=True)


class ModelSpec(BaseModel):
    """One servable unit: a single-version model, or one version of a model with `versions`."""

    model_config = ConfigDict(extra="forbid")
    name: str
    version: str
    # Set by the catalog for an entry of a model's `versions`: its queues and deployment are its own.
    versioned: bool = False
    task: Task
    runner: RunnerKind = "diffusers"
    # A diffusers pipeline class of a served family (contract/families.py), which decides the model's rules.
    pipeline: str | None = None
    # How `guidance_scale` is used, over the family's (FLUX.1 [schnell]: `none`, it takes no guidance).
    guidance: Guidance | None = None
    # Pipeline components left out when loading (the family's optional ones: SD 3.5's `text_encoder_3`).
    without: list[str] = Field(default_factory=list)
    weights_path: str = ""
    # Synthetic runners only (tests): the `sleep` runner's seconds per call, and a version that fails every call.
    call_seconds: float | None = Field(default=None, gt=0)
    fails: bool = False
    # The GPU it runs on (contract/hardware.py): the GKE node pool, and the memory its plan must fit.
    hardware: HardwareName
    gpu_sharing: bool
    # Models with the same worker group are served by one worker deployment, one process loading each
    # pipeline once (GPU time-sharing between models); unset means a deployment of its own.
    worker_group: str | None = None
    max_batch_size: int = Field(ge=1)
    # Images per second at a full batch (`max_batch_size`) over images per second alone, for this model on its
    # `hardware` (bench/gpu_pipeline.py's `direct` rates): 1 when batching buys nothing (a compute-bound call),
    # up to `max_batch_size` when a full batch costs no more than one image. The autoscaler's backlog target
    # follows it (infra/k8s/render.py, `backlog_target`); checked in `_batching_gain_fits`.
    batching_gain: float = Field(default=1.0, ge=1.0)
    # `step` (continuous batching) or `request`; see Scheduling. Checked in `_consistent` for a clear message.
    scheduling: str = "step"
    # The diffusers scheduler class the pipeline runs with (its saved config, this class); unset: the one
    # saved with the weights, checked when the pipeline loads.
    scheduler: str | None = None
    # Overrides of the scheduler's saved config (a few-step model's `timestep_spacing: trailing`); empty: as saved.
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    max_instances_per_request: int = Field(ge=1)
    request_timeout_seconds: int = Field(ge=1)
    ack_deadline_seconds: int = Field(ge=10, le=600)
    max_delivery_attempts: int = Field(ge=5, le=100)
    drain_seconds: int = Field(ge=0)
    replicas: Replicas
    defaults: GenerationDefaults
    limits: GenerationLimits
    # LoRA adapters per request (absent: refused with a 422).
    adapters: AdapterPolicy | None = None
    # ControlNets and IP-Adapters per request (absent: refused with a 422).
    controls: ControlPolicy | None = None
    # Overload handling: refuse at once what would miss its deadline, or answer it with a fallback (absent: off).
    admission: AdmissionPolicy | None = None
    # Components quantized at load (contract/quantization.py); absent: every component in the serving dtype.
    quantization: Quantization | None = None
    # torch.compile's mode for the denoiser on a GPU (CompileMode; README "Compiled models"); absent: eager. The
    # worker's MAAS_TORCH_COMPILE overrides it (0: every model eager; 1: every model compiled, `default` where unset).
    # float8 quantization needs it: fp8's scaling and matmul are fused only when compiled.
    compile: CompileMode | None = None
    # The real model its weights are (contract/architectures.py: sd1.5, sdxl, flux.1-dev, flux.1-schnell,
    # sd3.5-medium, sd3.5-large), which sizes its memory plan; unset: its family's usual one.
    architecture: str | None = None
    # A step cache (contract/step_cache.py): denoising work an image skips when it barely changes; absent: off.
    step_cache: StepCache | None = None

    @property
    def queue(self) -> str:
        """The name its request topics, subscriptions and worker key are made from (contract/naming.py)."""
        return naming.version_queue(self.name, self.version) if self.versioned else self.name

    @property
    def family(self) -> Family | None:
        """The model family its pipeline belongs to; None for the synthetic runners."""
        return family_of(self.pipeline)

    @property
    def needs_image(self) -> bool:
        """Its requests carry an input image (image-to-image, inpaint, edit): decoded at intake, passed to the
        pipeline."""
        return self.task in ("image-to-image", "inpaint", "edit")

    @property
    def takes_strength(self) -> bool:
        """Its requests start from their noised image at `strength` (image-to-image, inpaint); an edit model's image
        is a reference beside the noise, not a start."""
        return self.task in ("image-to-image", "inpaint")

    @property
    def takes_mask(self) -> bool:
        """Its requests carry a mask beside the image (inpaint)."""
        return self.task == "inpaint"

    @property
    def guidance_mode(self) -> Guidance:
        family = self.family
        return self.guidance or (family.guidance if family else "cfg")

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data):
        """An entry's defaults over its family's: a FLUX entry that names no size gets 1024x1024."""
        if not isinstance(data, dict) or not data.get("pipeline"):
            return data
        if (family := family_of(data["pipeline"])) is None:
            raise ValueError(unknown_pipeline_error(data.get("name", "?"), data["pipeline"]))
        defaults = dict(family.defaults)
        if data.get("guidance") == "none":
            defaults.update(guidance_scale=0.0, num_inference_steps=4)
        return {**data, "defaults": {**defaults, **(data.get("defaults") or {})}}

    @property
    def loaded_components(self) -> tuple | None:
        """What makes two units' loaded components interchangeable, the same objects in one worker: the same weights,
        family, quantization, left-out components (`without:`) and adapter layers (how many slots, of what rank, and
        how many adapters the device keeps: the LoRA layers live in the shared components). The worker loads a key's
        components once and builds every unit with that key from them (model_worker/serving/service.py); the memory
        plan counts them once (contract/memory_plan.py). None for the synthetic runners, which load nothing."""
        if self.runner != "diffusers":
            return None
        adapters = self.adapters
        return (
            self.weights_path,
            self.pipeline and self.family.name,
            self.quantization.model_dump_json() if self.quantization is not None else None,
            tuple(sorted(self.without)),
            (adapters.max_adapters_per_request, adapters.max_rank, adapters.device_cache) if adapters else None,
        )

    @property
    def deployment(self) -> str:
        """The worker deployment that serves this model (a version: its own, so a canary scales alone)."""
        return self.worker_group or self.queue

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(
                f"{self.name}: scheduling {self.scheduling!r} is not one of {', '.join(SCHEDULINGS)} "
                "(step: requests join a running batch between denoising steps; request: a batch runs to its end)"
            )
        if self.scheduler is not None:
            known = STEPPABLE_SCHEDULERS | NOT_STEPPABLE_SCHEDULERS
            if self.scheduler not in known:
                raise ValueError(f"{self.name}: scheduler {self.scheduler!r} is not one of {', '.join(sorted(known))}")
            if self.scheduling == "step" and self.scheduler not in STEPPABLE_SCHEDULERS:
                raise ValueError(steppable_error(self.name, self.scheduler))
        if self.scheduler_config.original_inference_steps is not None and self.scheduler != "LCMScheduler":
            raise ValueError(
                f"{self.name}: scheduler_config.original_inference_steps is LCMScheduler's; set scheduler: LCMScheduler "
                "or remove it"
            )
        if self.runner == "diffusers" and not (self.pipeline and self.weights_path):
            raise ValueError(f"{self.name}: the diffusers runner needs `pipeline` and `weights_path`")
        self._check_synthetic_fields()
        if self.pipeline is not None:
            self._check_family()
            self._check_step_limit()
        self._check_quantization()
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

    def image_prompt_slots(self, compiled: bool) -> ImagePromptSlots | None:
        """The IP-Adapter slots its denoiser is built with when `compiled` (the catalog's `compile`, or the worker's
        MAAS_TORCH_COMPILE): a model whose family takes IP-Adapters, stepped (its calls are the worker's own) and
        without a step cache (whose cached calls go without image prompts); None: an IP-Adapter swaps the denoiser's
        attention processors when a row first uses it (an eager model's path)."""
        if not compiled or self.controls is None or not self._slotted_image_prompts():
            return None
        return self.controls.image_prompt_slots

    def _slotted_image_prompts(self) -> bool:
        family = self.family
        return (
            family is not None
            and "ip_adapter" in family.controls
            and self.scheduling == "step"
            and self.step_cache is None
        )

    @property
    def scheduler_settings(self) -> tuple[str, dict[str, object]]:
        """The scheduler class and config it runs with, as far as the catalog knows: its family's saved one (the
        published weights') under the catalog's class and overrides; the worker checks the loaded one itself."""
        family = self.family
        return self.scheduler or family.scheduler, {
            **dict(family.scheduler_config),
            **self.scheduler_config.overrides(),
        }

    def _check_step_limit(self) -> None:
        """A request may ask for any step count up to the limit, so the limit must be one its scheduler can run."""
        scheduler, config = self.scheduler_settings
        if (problem := steps_problem(self.name, self.limits.max_inference_steps, scheduler, config)) is not None:
            raise ValueError(problem)

    def _check_synthetic_fields(self) -> None:
        """The synthetic runners' test switches are refused where they would do nothing, so a catalog never
        says a model fails or sleeps when it does not."""
        where = f"{self.name}: version {self.version!r}" if self.versioned else self.name
        if self.fails and self.runner == "diffusers":
            raise ValueError(
                f"{where}: `fails` makes a synthetic runner (noop, sleep) fail every call; the {self.runner} runner "
                "ignores it: remove it"
            )
        if self.compile is not None and self.runner != "diffusers":
            raise ValueError(
                f"{where}: `compile` compiles a diffusers model's denoiser; the {self.runner} runner has none: remove it"
            )
        if self.step_cache is not None and self.runner != "diffusers":
            raise ValueError(f"{where}: `step_cache` skips a diffusers model's denoiser work; the {self.runner} runner "
                             "has none: remove it")  # fmt: skip
        if self.call_seconds is not None and self.runner != "sleep":
            raise ValueError(
                f"{where}: `call_seconds` is the sleep runner's time per call; the {self.runner} runner ignores it: "
                "remove it"
            )

    def _check_quantization(self) -> None:
        if (problem := architecture_problem(self)) is not None:
            raise ValueError(problem)
        if self.quantization is None or not self.quantization.needs_float8:
            return
        if self.compile is None:
            # Eager, torchao's fp8 quantize and dequantize kernels run unfused around each matmul: FLUX.1 [schnell] on
            # an H100 took 1.34 s an image in float8 weight-only against 0.83 s in bf16 (README "Quantization").
            raise ValueError(
                f"{self.name}: quantization {self.quantization.type} runs compiled (its scaling fused with the matmul; "
                "eager fp8 is 1.6x slower than bf16): set `compile: default` (or another mode), or use "
                "int8_weight_only"
            )
        gpu = HARDWARE[self.hardware]
        if gpu.compute_capability < FLOAT8_MIN_COMPUTE_CAPABILITY:
            have, need = ".".join(map(str, gpu.compute_capability)), ".".join(map(str, FLOAT8_MIN_COMPUTE_CAPABILITY))
            raise ValueError(
                f"{self.name}: quantization {self.quantization.type} needs fp8 tensor cores (compute capability "
                f"{need}: l4, h100) and hardware {self.hardware} ({gpu.name}) has compute capability {have}: use "
                "int8_weight_only there, or no quantization"
            )

    @model_validator(mode="after")
    def _batching_gain_fits(self) -> ModelSpec:
        if self.batching_gain > self.max_batch_size:
            raise ValueError(
                f"{self.name}: batching_gain {self.batching_gain:g} exceeds max_batch_size {self.max_batch_size} "
                "(a full batch is at most that many times one image's throughput)"
            )
        return self

    def _check_family(self) -> None:
        family = self.family
        if family is None:
            raise ValueError(unknown_pipeline_error(self.name, self.pipeline))
        if family.pipelines[self.pipeline] != self.task:
            raise ValueError(f"{self.name}: {self.pipeline} serves {family.pipelines[self.pipeline]}, not {self.task}")
        if self.guidance is not None and (self.guidance == "cfg") != (family.guidance == "cfg"):
            raise ValueError(
                f"{self.name}: guidance {self.guidance!r} does not fit {self.pipeline} (its guidance is {family.guidance!r})"
            )
        if unknown := sorted(set(self.without) - set(family.optional_components)):
            allowed = ", ".join(family.optional_components) or "none"
            raise ValueError(f"{self.name}: `without` names {unknown}; {family.name} models may leave out: {allowed}")
        if self.step_cache is not None and self.step_cache.kind not in family.step_caches:
            kinds = ", ".join(family.step_caches) or "none yet"
            raise ValueError(
                f"{self.name}: step_cache kind {self.step_cache.kind!r} is not served for {family.name} models "
                f"(served: {kinds}); remove `step_cache` or pick a served kind"
            )
        if self.step_cache is not None and self.scheduling == "request" and self.step_cache.per_row_only:
            raise ValueError(
                f"{self.name}: step_cache {self.step_cache.kind} with warmup_steps or max_consecutive_skips, and "
                "deepcache at all, need scheduling: step (scheduling: request runs diffusers' own hook, which has "
                "neither, and none for a UNet); remove them or use scheduling: step"
            )
        if self.controls is not None and not family.controls:
            raise ValueError(f"{self.name}: control models are not served for {family.name} models yet; remove "
                             "`controls`")  # fmt: skip
        if self.adapters is not None and not family.adapters:
            raise ValueError(f"{self.name}: adapters are not served for {family.name} models yet; remove `adapters`")
        if (
            self.compile is not None
            and self.controls is not None
            and self.controls.image_prompt_slots is None
            and self._slotted_image_prompts()
        ):
            raise ValueError(
                f"{self.name}: a compiled model that takes image prompts is built with IP-Adapter slots of one shape; "
                "set controls.image_prompt_slots: {embedding_width: <its IP-Adapters' image encoder projection_dim>, "
                "tokens: 4}"
            )
        for axis in ("width", "height"):
            default, limit = getattr(self.defaults, axis), getattr(self.limits, f"max_{axis}")
            if default % family.size_multiple or limit < default:
                raise ValueError(
                    f"{self.name}: defaults.{axis} {default} must be a multiple of {family.size_multiple} for "
                    f"{family.name} models and at most limits.max_{axis} {limit}"
                )


def steppable_error(model: str, scheduler: str) -> str:
    """Why a model cannot use `scheduling: step` with this scheduler (shared by the catalog and the worker)."""
    return (
        f"{model}: scheduling: step needs a scheduler that can be stepped per item, and {scheduler} cannot "
        f"(second-order or batch-wide noise); use one of {', '.join(sorted(STEPPABLE_SCHEDULERS))}, "
        "or scheduling: request"
    )


def architecture_of(spec: ModelSpec) -> Architecture | None:
    """The architecture a diffusers unit serves (its `architecture:`, or its family's usual one); None for the
    synthetic runners, which hold no weights."""
    family = spec.family
    if spec.runner != "diffusers" or family is None:
        return None
    name = spec.architecture or DEFAULT_ARCHITECTURE[family.name]
    if family.name == "flux" and spec.architecture is None and spec.guidance_mode == "none":
        name = "flux.1-schnell"
    return ARCHITECTURES[name]


def architecture_problem(spec: ModelSpec) -> str | None:
    """Why a unit's `architecture:` or `quantization.components` are wrong, or None (checked by the catalog)."""
    if spec.architecture is not None:
        known = ARCHITECTURES.get(spec.architecture)
        if known is None:
            return f"{spec.name}: architecture {spec.architecture!r} is not one of {', '.join(sorted(ARCHITECTURES))}"
        if spec.family is None or known.family != spec.family.name:
            return f"{spec.name}: architecture {spec.architecture!r} is a {known.family} model, not {spec.pipeline}'s"
    architecture = architecture_of(spec)
    if spec.quantization is not None and architecture is not None:
        loaded = [name for name in architecture.components if name not in spec.without]
        if unknown := sorted(set(spec.quantization.components) - set(loaded)):
            return f"{spec.name}: quantization.components names {unknown}; its pipeline loads {', '.join(loaded)}"
    return None
