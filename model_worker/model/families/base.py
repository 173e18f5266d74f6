"""The denoiser interface: what the runner and the step scheduler need of a model family, and nothing else.

A family's denoiser prepares a request's images (text encoding, initial latents, one scheduler instance per
image with its own timesteps), runs one batched model call over any set of prepared images of one latent
shape with per-sample timesteps and guidance, steps each image's own scheduler on its slice, and decodes.
For `scheduling: request` it also says which arguments the diffusers pipeline call takes for the family. The
step scheduler, the runner and the rest of the worker see only this; which images may share a call is the
pool's batch key (model, size, adapter set), the same for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from contract.messages import GenerationParameters
from contract.model_spec import STEPPABLE_SCHEDULERS, ModelSpec, steppable_error
from contract.step_cache import StepCache
from model_worker.model.compiled import batch_buckets, compile_model
from model_worker.model.families.linear_steps import (
    coefficient_table,
    linear_coefficients,
    noise_table,
    scaled_input,
    step_linear,
)
from model_worker.model.runners import GenerationItem, RunningItem
from model_worker.model.step_cache import ForcedPattern, TailCalls, caching, forget


class Denoiser:
    """One family's arithmetic around a loaded diffusers pipeline. Subclasses fill in the family's parts."""

    # The pipeline component that denoises (and is compiled): `unet` or `transformer`.
    model_attribute = "unet"
    # Arguments of the pipeline's `from_pretrained` for the whole family (SD 1.5: no safety checker).
    extra_load_kwargs: dict[str, Any] = {}
    # The torch.compile backend `compile` uses: None is inductor (the runner's, on CUDA); `eager` in the tests.
    compile_backend: str | None = None
    # torch.compile's mode (compiled.py; None: its default), set by the runner from the catalog's `compile`.
    compile_mode: str | None = None

    def __init__(self, spec: ModelSpec, pipeline, device: str) -> None:
        import torch

        self.spec = spec
        self.pipeline = pipeline
        self.device = device
        self._torch = torch
        # Set by `compile`: the model's rows are padded up to a compiled batch size.
        self._compiled_buckets: list[int] | None = None
        # The step cache's (model_worker/model/step_cache.py): a forced skip pattern in place of the threshold (tests,
        # benchmarks), and the count of the expensive part's calls and rows.
        self.forced_skips: ForcedPattern | None = None
        self.tail_calls = TailCalls()

    @property
    def model(self):
        return getattr(self.pipeline, self.model_attribute)

    # --- loading -------------------------------------------------------------------------------------------

    @classmethod
    def load_kwargs(cls, spec: ModelSpec) -> dict[str, Any]:
        """Extra arguments of the pipeline's `from_pretrained`: the components the catalog entry leaves out."""
        kwargs: dict[str, Any] = dict(cls.extra_load_kwargs)
        for component in spec.without:
            kwargs[component] = None
            kwargs[component.replace("text_encoder", "tokenizer")] = None
        return kwargs

    def check_loaded(self) -> None:
        """Refuses a loaded pipeline that contradicts its catalog entry (a clear error at start-up, not per request)."""

    def check_steppable(self) -> None:
        """Refuses `scheduling: step` for a pipeline whose scheduler cannot be stepped per item."""
        name = type(self.pipeline.scheduler).__name__
        if name not in STEPPABLE_SCHEDULERS:
            raise ValueError(steppable_error(self.spec.name, name))

    # During a compiled model's warm-up: its calls pass zero ControlNet residuals (`traces_control_calls`).
    tracing_controls = False

    def traces_control_calls(self) -> bool:
        """Whether a compiled model's warm-up traces its ControlNet calls apart (a transformer family that takes
        ControlNets: its calls without one pass no residuals, whose zeros would take as much memory as the residuals
        themselves); the UNet families pass zeros on every call instead."""
        return False

    def lora_components(self) -> tuple[str, ...]:
        """The pipeline components diffusers' LoRA loading changes for this family; empty: no adapters."""
        family = self.spec.family
        return family.lora_components if family.adapters else ()

    def compile(self) -> None:
        """Compiles the denoising model for static shapes (batches padded to `batch_buckets`): with inductor in
        `compile_mode`, or with `compile_backend` when one is named (the tests' `eager`)."""
        # Fused q/k/v would bypass the LoRA layers diffusers puts on to_q, to_k and to_v: not with adapters. Nor on
        # quantized weights: diffusers fuses by concatenating the weights, which torchao's tensors do not implement.
        quantization = self.spec.quantization
        quantized = quantization is not None and self.model_attribute in quantization.components
        adapters = self.lora_components() and self.spec.adapters
        if hasattr(self.pipeline, "fuse_qkv_projections") and not adapters and not quantized:
            self.pipeline.fuse_qkv_projections()
        self.make_slots()
        setattr(self.pipeline, self.model_attribute, compile_model(self.model, self.compile_mode, self.compile_backend))
        self._compiled_buckets = batch_buckets(self.spec.max_batch_size)

    # The image prompts' rows (model_worker/controls/ip_adapters.py) of a family that takes IP-Adapters, made on first
    # use, or by `make_slots` when compiled.
    _ip_adapters = None

    def make_slots(self) -> None:
        """A compiled model's IP-Adapter slots (`ModelSpec.image_prompt_slots`), made in the model before it is
        compiled (after its projections are fused, which would replace their processors)."""
        slots = self.spec.image_prompt_slots(compiled=True)
        if slots is not None and self._ip_adapters is None:  # not a shared model's, made by the runner it came with
            from model_worker.controls.ip_adapters import IPAdapterRows

            count = self.spec.controls.max_image_prompts_per_request
            self._ip_adapters = IPAdapterRows(self.pipeline, slots, count, self.spec.name)

    @staticmethod
    def schedule_cut(scheduler, fraction: float) -> int:
        """The training timestep where diffusers cuts a schedule at `denoising_end`/`denoising_start`."""
        train = scheduler.config.num_train_timesteps
        return int(round(train - fraction * train))

    def requested_steps(self, params: GenerationParameters) -> int:
        """The steps a request's progress counts to: `num_inference_steps`, or for image-to-image the share of them
        its strength runs, as the img2img pipeline's own `get_timesteps` counts it (SD's and SDXL's
        `int(steps x strength)`, FLUX's `steps - int(steps x (1 - strength))`: one more for 25 at 0.5)."""
        steps = params.num_inference_steps
        if not self.spec.takes_strength or params.strength is None:  # an edit model runs every step
            return steps
        # The class's own method over a stand-in pipeline whose scheduler has no schedule: it only counts.
        counting = SimpleNamespace(scheduler=SimpleNamespace(timesteps=(), order=1))
        _, run = type(self.pipeline).get_timesteps(counting, steps, params.strength, self.device)
        return max(1, min(run, steps))

    # --- scheduling: request -------------------------------------------------------------------------------

    def call_kwargs(self, items: list[GenerationItem], params: GenerationParameters) -> dict[str, Any]:
        """The family's own arguments of one pipeline call (prompts, seeds, steps and callback are the runner's)."""
        raise NotImplementedError

    @contextmanager
    def call_step_cache(self, settings: StepCache | None) -> Iterator[Callable[[], int]]:
        """The step cache around one pipeline call (`settings` None: none); yields the count of steps it skipped. A
        family whose step cache runs in `scheduling: request` overrides it (the catalog allows no other)."""
        if settings is not None:
            raise ValueError(f"{self.spec.name}: no {settings.kind} step cache in scheduling: request")
        yield lambda: 0

    # --- scheduling: step ----------------------------------------------------------------------------------

    def start(self, items: list[GenerationItem], params: GenerationParameters) -> list[RunningItem]:
        """Encodes the prompts (one encoder call for the request) and prepares each image as the pipeline would
        for it alone: its latents from its own generator, its own scheduler and timesteps."""
        raise NotImplementedError

    def denoise(self, running: list[RunningItem]) -> None:
        """One model call over every item, then each item's own scheduler step. Raises only before any item
        changed; a failure of one item's scheduler step is kept on that item."""
        raise NotImplementedError

    def decode(self, running: list[RunningItem]) -> list:
        """Float arrays (height x width x 3, in [0, 1]) of finished items, in one decoder call; a flow's stage that
        hands its latents on (`latent_output`) gets its latents (1, C, h, w) instead, undecoded."""
        torch = self._torch
        outputs: list = [r.state["latents"] if r.item.latent_output else None for r in running]
        decoded = [r for r in running if not r.item.latent_output]
        if decoded:
            with torch.inference_mode():
                latents = torch.cat([r.state["latents"] for r in decoded])
                images = self.decode_latents(latents, decoded)
                arrays = iter(self.pipeline.image_processor.postprocess(images, output_type="np"))
            outputs = [output if output is not None else next(arrays) for output in outputs]
        self.finished(running)
        return outputs

    def decode_latents(self, latents, running: list[RunningItem]):
        """The VAE's images of the model's latents, as the family's pipeline decodes them."""
        raise NotImplementedError

    # --- shared by the families ----------------------------------------------------------------------------

    @contextmanager
    def using(self, scheduler) -> Iterator[None]:
        """The pipeline's own helpers (`get_timesteps`, img2img's `prepare_latents`) read `pipeline.scheduler`:
        lend them an image's own scheduler, so its schedule is set exactly as the pipeline sets it."""
        saved = self.pipeline.scheduler
        self.pipeline.scheduler = scheduler
        try:
            yield
        finally:
            self.pipeline.scheduler = saved

    @staticmethod
    def one_size(running: list[RunningItem]) -> None:
        """Refuses a running set of several sizes: a transformer call takes one token count."""
        sizes = {r.state["size"] for r in running}
        if len(sizes) > 1:
            raise ValueError(f"images of different sizes {sorted(sizes)} cannot share a transformer call")

    def image_to_image_start(self, scheduler, item, params: GenerationParameters, steps: int, channels: int, dtype,
                             generator):  # fmt: skip
        """An img2img pipeline's start for one image: its strength's share of `scheduler`'s schedule and the latents
        of its noised input, set exactly as the pipeline sets them (its own `get_timesteps` and `prepare_latents`)."""
        pipe = self.pipeline
        device = pipe._execution_device
        with self.using(scheduler):
            timesteps, _ = pipe.get_timesteps(steps, params.strength, device)
            image = pipe.image_processor.preprocess(item.image, height=params.height, width=params.width)
            latents = pipe.prepare_latents(
                image.to(self._torch.float32), timesteps[:1].repeat(1), 1, channels, params.height, params.width,
                dtype, device, [generator],
            )  # fmt: skip
        return timesteps, latents

    def new_scheduler(self):
        """A fresh instance of the pipeline's scheduler: each image steps its own."""
        return type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)

    def padded_rows(self, rows: int, rows_per_image: int = 1) -> int:
        """The row count a compiled model runs for `rows` (unchanged when eager)."""
        if self._compiled_buckets is None:
            return rows
        return rows_per_image * next(b for b in self._compiled_buckets if rows_per_image * b >= rows)

    def prepared(self, running: list[RunningItem]) -> list[RunningItem]:
        """Computes once per image what its steps need, so that a step reads nothing back from the device: its
        timesteps as Python numbers (its own scheduler's `step` takes them), and, where its scheduler's step is
        one formula (`linear_steps`), its per-step coefficients (Python numbers, which say which terms a step
        needs, and the same as one small device tensor) and the noise its stochastic scheduler (Euler ancestral,
        LCM) adds at each step, drawn now from its generator."""
        for r in running:
            state = r.state
            state["step_timesteps"] = state["timesteps"].tolist()
            coefficients = linear_coefficients(state["scheduler"], state["step_timesteps"], state["step_kwargs"])
            linear = coefficients is not None
            state["steps"] = coefficients
            state["linear"] = coefficient_table(coefficients, state["latents"].device) if linear else None
            steps = len(state["step_timesteps"])
            state["noise"] = (
                noise_table(state["scheduler"], state["step_kwargs"], steps, state["latents"]) if linear else None
            )
        return running

    def step_items(self, running: list[RunningItem], predictions: list) -> None:
        """The running set's scheduler steps on its slices of the shared call's output: one vectorised step for
        the images whose scheduler is a formula, each other image's own scheduler with its timestep as a number."""
        linear = [(r, p) for r, p in zip(running, predictions, strict=True) if r.state["linear"] is not None]
        if linear:
            step_linear([r for r, _ in linear], [p for _, p in linear])
        for r, prediction in zip(running, predictions, strict=True):
            if r.state["linear"] is not None:
                continue
            try:
                t = r.state["step_timesteps"][r.done]
                step = r.state["scheduler"].step(
                    prediction, t, r.state["latents"], **r.state["step_kwargs"], return_dict=False
                )
                r.state["latents"] = step[0]
                r.done += 1
            except Exception as exc:  # noqa: BLE001 - this item fails alone; the others have stepped
                r.failure = exc

    @staticmethod
    def finished(running: list[RunningItem]) -> None:
        for r in running:
            r.state.clear()  # the latents and scheduler are done with: free them now, not when the reply is sent


class GuidedDenoiser(Denoiser):
    """The classifier-free-guidance families (SD 1.5, SDXL, SD 3.5): a guided image takes two rows of the shared
    model call (negative, then positive), an unguided one (guidance scale 1 or less) one, so images with and
    without guidance share a call; each row gets its image's timestep. Each image's `state` has its
    `condition` (tensors in model rows, `guided_rows`) and its `guidance` (None: unguided)."""

    def denoise(self, running: list[RunningItem]) -> None:
        torch = self._torch
        inputs, timesteps = [], []
        with torch.inference_mode():
            for r in running:
                t = r.state["timesteps"][r.done]
                latents = r.state["latents"]
                x = guided_rows(latents, latents if r.state["guidance"] is not None else None)
                if r.state["linear"] is not None:
                    x = scaled_input(r, x)
                else:
                    x = self.model_input(r.state["scheduler"], x, r.state["step_timesteps"][r.done])
                inputs.append(self.conditioned_input(r, x))
                timesteps.append(t.reshape(1).to(torch.float32).repeat(x.shape[0]))
            sample, timestep = torch.cat(inputs), torch.cat(timesteps).to(inputs[0].device)
            condition = {key: torch.cat([r.state["condition"][key] for r in running])
                         for key in running[0].state["condition"]}  # fmt: skip
            rows = sample.shape[0]
            size = self.padded_rows(rows, rows_per_image=2)  # static shapes when compiled: padded, then dropped
            if size != rows:
                sample, timestep = pad_rows(sample, size), pad_rows(timestep, size)
                condition = {key: pad_rows(value, size) for key, value in condition.items()}
            controls = self.control_residuals(running, inputs, sample, timestep, condition)
            if caching(running) and not controls:  # each image's step cache picks the rows of the expensive part
                widths = [x.shape[0] for x in inputs]
                predicted = self.cached_call(running, widths, sample, timestep, condition)[:rows]
            else:
                forget(running)  # a call with control models runs in full; no image reuses what predates it
                predicted = self.call_model(sample, timestep, condition, **controls)[:rows]
            self.step_items(running, guided_predictions(running, inputs, predicted))

    def cached_call(self, running: list[RunningItem], rows_per_image: list[int], sample, timestep, condition: dict):
        """`call_model` with the family's step cache (model_worker/model/step_cache.py), each image deciding alone."""
        raise NotImplementedError

    def control_residuals(self, running: list[RunningItem], inputs: list, sample, timestep, condition: dict) -> dict:
        """The control models' inputs of the shared call, per row (model_worker/controls/controlnets.py); {} (the
        base model's call) for a family that serves none, or when no row uses one."""
        return {}

    def model_input(self, scheduler, sample, timestep):
        """The model's input rows for an image's latents (the UNet schedulers scale them; flow matching does not)."""
        return sample

    def conditioned_input(self, r: RunningItem, rows):
        """An image's scaled input rows with the channels its family adds to them per image (an inpainting UNet's
        mask and masked-image latents); as they are for the others."""
        return rows

    def call_model(self, sample, timestep, condition: dict):
        """The family's model on the shared rows: its noise (or velocity) prediction, one row per input row."""
        raise NotImplementedError


def guided_rows(positive, negative=None):
    """An image's rows of the model call: negative then positive when guided, the positive alone when not."""
    import torch

    return positive if negative is None else torch.cat([negative, positive])


def conditions(positive: dict, negative: dict | None) -> list[dict]:
    """Each image's conditioning in model rows, from the request's batched encoder outputs (one row per image;
    `negative` None when unguided)."""
    count = len(next(iter(positive.values())))
    return [
        {key: guided_rows(value[i : i + 1], None if negative is None else negative[key][i : i + 1])
         for key, value in positive.items()}
        for i in range(count)
    ]  # fmt: skip


def guided_predictions(running: list[RunningItem], inputs: list, predicted) -> list:
    """Each item's slice of a shared call's output, with its own classifier-free guidance applied (a guided
    item has two rows, negative then positive; an unguided one, one)."""
    predictions, offset = [], 0
    for r, x in zip(running, inputs, strict=True):
        noise = predicted[offset : offset + x.shape[0]]
        offset += x.shape[0]
        if r.state["guidance"] is not None:
            uncond, text = noise.chunk(2)
            noise = uncond + r.state["guidance"] * (text - uncond)
        predictions.append(noise)
    return predictions


def pad_rows(tensor, rows: int):
    """Repeats the last row up to `rows` (a compiled model's fixed batch)."""
    import torch

    if tensor is None or tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])])
