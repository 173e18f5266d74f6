"""The memory plan: what each catalog unit and worker deployment needs on its GPU (weights per component in the
serving dtype or quantized, plus the activation peak of a full batch at the largest allowed size), against the
hardware's room, known before a pod is scheduled. The catalog refuses what does not fit; the renderer sizes pods'
host memory from it; the worker re-checks it against the real device at load.

Weights are counted from the recorded parameter counts (contract/architectures.py). The activation peak is
computed, not measured (no GPU was lent for this work): the larger of
- the denoiser call over a full batch (rows doubled by classifier-free guidance) at the largest size, from the
  element count per token in the architecture's record, in the serving dtype (an edit model's input image adds as
  many tokens as the output has: FLUX.1 Kontext's sequence doubles); and
- the VAE decode of one image at the largest size (the worker decodes a batch one image at a time on a GPU, as
  diffusers' `vae.enable_slicing()` does), from one published measurement scaled by pixels: FLUX.1-dev at 1024x1024
  peaks 4.8 GiB above its loaded weights on an H100 (diffusers' quantization blog: 31.4 GiB loaded, 36.2 GiB peak),
  and the denoiser's share of that call is under 0.5 GiB, so the rest is the decode's. All four families share the
  decoder's layout (128/256/512/512 channels). SDXL's VAE decodes in float32 (`force_upcast`): twice the bytes, and
  a float32 copy of the VAE's weights beside its half-precision ones.
The text encoders' activations (77 to 512 tokens) are small beside both and are not counted. A UNet model that takes
ControlNets adds their down residuals for every row of the call (the running sum over its ControlNets and the one just
run: twice the UNet's skip tensors) to the denoiser's, and its control budget (`controls.device_bytes`, the control
models' weights a worker holds) to the weights; without a budget, what the plan leaves is the budget
(`control_budget`), which a registration must fit. A FLUX.1 or SD 3.5 model that takes them holds a residual per
transformer block for every row, beside the outputs of the call's ControlNets, whose own call can be the peak
(`transformer_controlnet_peak`), counted up to a depth a registration must not pass. A first-block step
cache adds each image's two cached residuals to the denoiser's (DeepCache's features, one up block's input per row,
are small beside the call and are not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.architectures import TRANSFORMER_WIDTHS_PER_TOKEN, Architecture
from contract.hardware import GIB, HARDWARE, MAX_SHARED_CLIENTS_PER_GPU, RESERVE_BYTES
from contract.model_spec import architecture_of
from contract.quantization import QUANTIZED_BYTES_PER_PARAMETER

if TYPE_CHECKING:
    from contract.model_spec import ModelSpec

# A UNet's first and second block widths (block_out_channels[0] and [1]), what its DeepCache features are made of.
DEEPCACHE_WIDTHS = {"sd15": (320, 640), "sdxl": (320, 640)}  # by family: the ones deepcache is served for
# A FLUX.1 transformer's output channels per image token: 16 latent channels packed 2x2.
FLUX_PACKED_CHANNELS = 64
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# torchao keeps one float32 scale per output row of a quantized Linear (per-row fp8, per-channel int8).
SCALE_BYTES_PER_ROW = 4
# The decode's bytes per output pixel in a 2-byte dtype: 4.8 GiB at 1024x1024 (see the module's docstring).
DECODE_BYTES_PER_PIXEL = round(4.8 * GIB / (1024 * 1024))


@dataclass(frozen=True)
class ComponentPlan:
    name: str
    parameters: int
    # The serving dtype, or the quantization type for a quantized component.
    dtype: str
    bytes: int


@dataclass(frozen=True)
class UnitPlan:
    """One catalog unit's memory on its GPU."""

    queue: str
    architecture: str
    hardware: str
    components: tuple[ComponentPlan, ...]
    activation_bytes: int
    # Which call peaks: "denoiser" (a full batch's model call) or "decode" (one image's VAE decode).
    activation_phase: str
    batch: int
    width: int
    height: int
    serving_dtype: str = "float16"
    # Its catalog's control budget (`controls.device_bytes`): GPU memory for its control models' weights; 0 without.
    control_bytes: int = 0
    # Its loaded components' identity (`ModelSpec.loaded_components`): units of a deployment with the same one are
    # built from one copy of the components, which the deployment counts once.
    loaded_as: tuple | None = None

    @property
    def weights_bytes(self) -> int:
        return sum(component.bytes for component in self.components)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.control_bytes + self.activation_bytes

    @property
    def file_bytes(self) -> int:
        """Its safetensors in the bucket (and the worker's disk cache): every component in the serving dtype, as
        quantization happens at load."""
        return sum(c.parameters * DTYPE_BYTES[self.serving_dtype] for c in self.components)

    def as_dict(self) -> dict[str, object]:
        """The plan as `GET /v1/models` and `make status` show it."""
        return {
            "architecture": self.architecture,
            "hardware": self.hardware,
            "weights_bytes": self.weights_bytes,
            "control_bytes": self.control_bytes,
            "activation_bytes": self.activation_bytes,
            "activation_phase": self.activation_phase,
            "activation_at": {"batch": self.batch, "width": self.width, "height": self.height},
            "total_bytes": self.total_bytes,
            "components": {c.name: {"parameters": c.parameters, "dtype": c.dtype, "bytes": c.bytes}
                           for c in self.components},
        }  # fmt: skip


@dataclass(frozen=True)
class DeploymentPlan:
    """A worker deployment (a worker group or a unit alone): one process loads every unit's weights once, and its
    device runs one call at a time, so weights add up and the largest activation counts once. Units whose loaded
    components are the same (`loaded_as`: SD 1.5's image-to-image beside its text-to-image) share one copy: it
    counts once."""

    name: str
    hardware: str
    gpu_sharing: bool
    units: tuple[UnitPlan, ...]
    clients_per_gpu: int = MAX_SHARED_CLIENTS_PER_GPU

    @property
    def loading_units(self) -> tuple[UnitPlan, ...]:
        """The units that load components: the first of each `loaded_as`; the others are built from its."""
        seen: set[tuple] = set()
        loading = []
        for unit in self.units:
            if unit.loaded_as is None or unit.loaded_as not in seen:
                loading.append(unit)
                seen.add(unit.loaded_as)
        return tuple(loading)

    def sharing(self, unit: UnitPlan) -> UnitPlan | None:
        """The unit whose loaded components `unit` is built from; None when it loads its own."""
        if unit.loaded_as is None:
            return None
        loader = next(other for other in self.units if other.loaded_as == unit.loaded_as)
        return None if loader is unit else loader

    @property
    def weights_bytes(self) -> int:
        return sum(unit.weights_bytes for unit in self.loading_units)

    @property
    def activation_bytes(self) -> int:
        return max((unit.activation_bytes for unit in self.units), default=0)

    @property
    def control_bytes(self) -> int:
        """Every unit's control budget: each model's control models are its own (registered per model)."""
        return sum(unit.control_bytes for unit in self.units)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.control_bytes + self.activation_bytes

    @property
    def room_bytes(self) -> int:
        return HARDWARE[self.hardware].share_bytes(self.gpu_sharing, self.clients_per_gpu)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.room_bytes

    @property
    def host_staging_bytes(self) -> int:
        """Host memory the weights pass through at load, at most: a pipeline loaded on the CPU before it moves to the
        GPU holds all its loaded weights there (one loaded straight to the GPU holds less), one unit after another,
        so the largest unit's loaded weights."""
        return max((unit.weights_bytes for unit in self.units), default=0)

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "models": [unit.queue for unit in self.units],
            "weights_bytes": self.weights_bytes,
            "control_bytes": self.control_bytes,
            "activation_bytes": self.activation_bytes,
            "total_bytes": self.total_bytes,
            "room_bytes": self.room_bytes,
            "fits": self.fits,
        }

    def problem(self) -> str | None:
        """Why it does not fit, with the numbers; None when it does."""
        if self.fits:
            return None
        gpu = HARDWARE[self.hardware]
        room = f"{gib(self.room_bytes)} usable: {gib(gpu.memory_bytes)} less a {gib(RESERVE_BYTES)} reserve"
        if self.gpu_sharing:
            room += f", shared by {self.clients_per_gpu} time-sharing pods"
        weights = "; ".join(
            f"{unit.queue} {gib(unit.weights_bytes)} ("
            + ", ".join(f"{c.name} {gib(c.bytes)} {c.dtype}" for c in unit.components)
            + ")"
            + "".join(f", shared by {other.queue}" for other in self.units if self.sharing(other) is unit)
            for unit in self.loading_units
        )
        peak = max(self.units, key=lambda unit: unit.activation_bytes)
        what = "worker_group" if len(self.units) > 1 else "model"
        return (
            f"{what} {self.name!r} does not fit its GPU: it needs {gib(self.total_bytes)} on {self.hardware} "
            f"({gpu.name}, {room}): weights {gib(self.weights_bytes)} [{weights}]"
            + (f" + control budgets {gib(self.control_bytes)}" if self.control_bytes else "")
            + " + activation "
            f"{gib(self.activation_bytes)} ({peak.queue}'s {peak.activation_phase} at batch {peak.batch}, "
            f"{peak.width}x{peak.height}). Quantize components (`quantization:`), lower max_batch_size or "
            "limits, split the worker_group, or name larger hardware"
        )


def gib(count: int) -> str:
    return f"{count / GIB:.2f} GiB"


def component_plans(spec: ModelSpec, architecture: Architecture) -> tuple[ComponentPlan, ...]:
    dtype = spec.family.gpu_dtype
    serving = DTYPE_BYTES[dtype]
    quantized = set(spec.quantization.components) if spec.quantization else set()
    plans = []
    for name, size in architecture.components.items():
        if name in spec.without:
            continue
        if name in quantized:
            kind = spec.quantization.type
            count = (
                size.linear_weights * QUANTIZED_BYTES_PER_PARAMETER[kind]
                + size.linear_rows * SCALE_BYTES_PER_ROW
                + (size.parameters - size.linear_weights) * serving
            )
            plans.append(ComponentPlan(name, size.parameters, kind, count))
        else:
            plans.append(ComponentPlan(name, size.parameters, dtype, size.parameters * serving))
    return tuple(plans)


def activation(spec: ModelSpec, architecture: Architecture, batch: int, width: int, height: int) -> tuple[int, str]:
    """(bytes, phase) of the activation peak of a batch at a size (see the module's docstring)."""
    serving = DTYPE_BYTES[spec.family.gpu_dtype]
    rows = batch * (2 if spec.guidance_mode == "cfg" else 1)
    # An edit model's input image joins the sequence at the output's size (FLUX.1 Kontext): twice the image tokens.
    images = 2 if spec.task == "edit" else 1
    tokens = images * math.ceil(width * height / architecture.pixels_per_token) + architecture.text_tokens
    denoiser = rows * tokens * architecture.denoiser_elements_per_token * serving
    decode = width * height * DECODE_BYTES_PER_PIXEL * serving // 2
    if spec.family.name == "sdxl":  # decoded in float32 (force_upcast): twice the bytes, and the VAE's float32 copy
        decode = 2 * decode + architecture.components["vae"].parameters * 4
    if spec.controls is not None and architecture.skip_elements_per_token:
        # ControlNets' down residuals for every row, beside the UNet's own activations: the running sum over the
        # call's ControlNets and the one just run (model_worker/controls/controlnets.py).
        denoiser += 2 * rows * tokens * architecture.skip_elements_per_token * serving
    elif spec.controls is not None and architecture.control_blocks:
        denoiser = transformer_controlnet_peak(
            denoiser, controlnet_residual_bytes(architecture, rows, tokens - architecture.text_tokens, serving),
            architecture.control_blocks, architecture.controlnet_blocks, spec.controls.max_controls_per_request,
        )  # fmt: skip
    cache = 0
    if spec.step_cache is not None and spec.step_cache.kind == "first_block":
        # Each running image keeps two residuals between its steps (its first block's and the other blocks', its image
        # tokens x the hidden width each, for each of its rows: SD 3.5's guided two: model_worker/model/step_cache.py),
        # through every call and decode.
        hidden = architecture.denoiser_elements_per_token // TRANSFORMER_WIDTHS_PER_TOKEN
        cache = rows * 2 * (tokens - architecture.text_tokens) * hidden * serving
    elif spec.step_cache is not None and spec.step_cache.kind == "deepcache":
        # Each running image keeps its deep features between its steps, for each of its rows: the last up block's
        # input, the UNet's second width at the full latent size; by threshold also its first down block's output,
        # the first width at a quarter of the latent pixels (model_worker/model/families/deep_cache.py).
        first, second = DEEPCACHE_WIDTHS[spec.family.name]
        shallow = first * tokens // 4 if spec.step_cache.interval is None else 0
        cache = rows * (second * tokens + shallow) * serving
    elif spec.step_cache is not None and spec.step_cache.kind == "taylorseer":
        # Each running image keeps its output's Taylor factors (orders 0 to max_order, float32) between its steps: its
        # image tokens x the packed latent channels (FLUX's 16 x 2x2) each (model_worker/model/step_cache.py).
        factors = (spec.step_cache.max_order or 1) + 1
        cache = batch * factors * (tokens - architecture.text_tokens) * FLUX_PACKED_CHANNELS * 4
    return (denoiser + cache, "denoiser") if denoiser > decode else (decode + cache, "decode")


def controlnet_residual_bytes(architecture: Architecture, rows: int, image_tokens: int, serving: int) -> int:
    """One ControlNet residual of a FLUX.1 or SD 3.5 transformer's call: a block's hidden states, its image tokens x
    the hidden width for every row of the call, in the transformer's dtype (flux_controlnets.py
    `zero_flux_residuals`, sd3_controlnets.py `zero_sd3_residuals`)."""
    return rows * image_tokens * (architecture.denoiser_elements_per_token // TRANSFORMER_WIDTHS_PER_TOKEN) * serving


def transformer_controlnet_peak(denoiser: int, residual: int, blocks: int, deepest: int, at_once: int) -> int:
    """The peak of a FLUX.1 or SD 3.5 call with ControlNets (model_worker/controls/flux_controlnets.py,
    sd3_controlnets.py), in `residual`s (one block's residual over every row): `denoiser` is the transformer's own
    call, `blocks` its residuals (one per block: a compiled transformer's always, `every_block`, and any call mixing
    ControlNets of different depths), `deepest` the residuals a ControlNet hands on (at most
    `Architecture.controlnet_blocks`), `at_once` the ControlNets a row may name. Each ControlNet of the call runs over
    the rows that use it, and its scaled residuals are kept until all have run, then summed into the per-block
    totals; no row is in two calls of one ControlNet (a request names each once), so the outputs kept add up to
    `at_once x deepest` residuals at most. The largest of four moments:
    - the transformer's call: its own activations and the summed residuals, `denoiser + blocks`;
    - a ControlNet's blocks: the earlier ControlNets' outputs, its own blocks' outputs so far and its working
      activations, which are the transformer's per row (the same blocks, widths and tokens) over no more rows:
      `denoiser + at_once x deepest`;
    - a ControlNet's return (diffusers' `FluxControlNetModel`/`SD3ControlNetModel.forward`): its blocks' hidden
      states, their projections and the projections times the conditioning scale, three of its residuals at once
      beside the earlier ones, `(at_once + 2) x deepest`: with FLUX.1's 57 blocks, 28 deep and two at once, 112
      residuals against `denoiser + 57` (20 x 4,352 / 4,096 = 21.25 residuals of activations a row at 1024x1024
      with 256 text tokens, so 78.25): a ControlNet's own call, not the transformer's, can be the peak;
    - the sum: every ControlNet's outputs, the per-block totals and one scaled product, `blocks + at_once x deepest
      + 1` (FLUX.1: 114 residuals, its peak; SD 3.5 Large: 38 + 2 x 19 + 1 = 77, against 21.6 of activations a row).
    The gathered inputs (hidden states, text, pooled projections of the rows) are small beside these."""
    return max(
        denoiser + blocks * residual,
        denoiser + at_once * deepest * residual,
        (at_once + 2) * deepest * residual,
        (blocks + at_once * deepest + 1) * residual,
    )


def controlnet_depth_problem(spec: ModelSpec, blocks: int) -> str | None:
    """Why a ControlNet handing on `blocks` residuals (a FLUX.1 one's double and single blocks, an SD 3.5 one's
    blocks) is deeper than `spec`'s memory plan counts (`Architecture.controlnet_blocks`), or None: a registration's
    check, a 413 with the numbers."""
    architecture = architecture_of(spec)
    if architecture is None or not architecture.control_blocks or blocks <= architecture.controlnet_blocks:
        return None
    return (f"the ControlNet hands on {blocks} residuals (one per block); {spec.name}'s memory plan counts ControlNets "
            f"of up to {architecture.controlnet_blocks}, half its {architecture.name} transformer's "
            f"{architecture.control_blocks} blocks (contract/memory_plan.py `transformer_controlnet_peak`)")  # fmt: skip


def unit_plan(spec: ModelSpec) -> UnitPlan | None:
    """A diffusers unit's plan at its max_batch_size and largest allowed size; None for the synthetic runners."""
    architecture = architecture_of(spec)
    if architecture is None:
        return None
    width, height = spec.limits.max_width, spec.limits.max_height
    width -= width % spec.family.size_multiple
    height -= height % spec.family.size_multiple
    count, phase = activation(spec, architecture, spec.max_batch_size, width, height)
    return UnitPlan(
        spec.queue, architecture.name, spec.hardware, component_plans(spec, architecture), count, phase,
        spec.max_batch_size, width, height, spec.family.gpu_dtype,
        spec.controls.device_bytes or 0 if spec.controls else 0, spec.loaded_components,
    )  # fmt: skip


def control_budget(plan: DeploymentPlan, spec: ModelSpec) -> tuple[int, str]:
    """(bytes, where from) of the GPU memory `spec`'s control models' weights may take in its deployment `plan`: its
    catalog's `controls.device_bytes`, or what the plan leaves (its room less its weights, budgets and activation,
    the ControlNets' residuals counted)."""
    if spec.controls is not None and spec.controls.device_bytes is not None:
        return spec.controls.device_bytes, "its catalog's controls.device_bytes"
    left = max(plan.room_bytes - plan.total_bytes, 0)
    return left, (f"what its worker's memory plan leaves: {gib(plan.room_bytes)} of room less "
                  f"{gib(plan.total_bytes)} planned")  # fmt: skip


def deployment_plan(
    name: str, specs: list[ModelSpec], clients_per_gpu: int = MAX_SHARED_CLIENTS_PER_GPU
) -> DeploymentPlan:
    units = tuple(plan for plan in (unit_plan(spec) for spec in specs) if plan is not None)
    return DeploymentPlan(name, specs[0].hardware, specs[0].gpu_sharing, units, clients_per_gpu)


def plan_rows(plans: dict[str, DeploymentPlan]) -> list[tuple[str, ...]]:
    """One row per planned unit (its deployment's sum and room beside it): `make status` and the memory plan's page (docs/concepts/memory-plan.md)."""
    rows = [("model", "architecture", "hardware", "quantized", "weights", "activation (at)", "total", "deployment / room", "fits")]  # fmt: skip
    for plan in plans.values():
        for unit in plan.units:
            quantized = sorted({c.dtype for c in unit.components} - set(DTYPE_BYTES))
            loader = plan.sharing(unit)
            weights = gib(unit.weights_bytes) + (f" (shares {loader.queue}'s)" if loader is not None else "")
            rows.append((
                unit.queue, unit.architecture, unit.hardware, ", ".join(quantized) or "-", weights,
                f"{gib(unit.activation_bytes)} ({unit.activation_phase}, {unit.batch} x {unit.width}x{unit.height})",
                gib(unit.total_bytes), f"{gib(plan.total_bytes)} / {gib(plan.room_bytes)}", "yes" if plan.fits else "NO",
            ))  # fmt: skip
    return rows


def plan_table(plans: dict[str, DeploymentPlan], markdown: bool = False) -> str:
    rows = plan_rows(plans)
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join([lines[0], "|" + "---|" * len(rows[0]), *lines[1:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


if __name__ == "__main__":  # python -m contract.memory_plan [--markdown]: the catalog's plan
    import sys

    from contract.catalog import load_catalog

    print(plan_table(load_catalog().deployment_plans(), markdown="--markdown" in sys.argv))
