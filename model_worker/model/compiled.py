"""Compiled denoisers: torch.compile's mode, the static batch sizes they are compiled for, PyTorch's saved compile
artifacts, and a count of the graphs compiled.

A compiled model's shapes must be static, so batches are padded up to fixed bucket sizes; the artifacts are
saved to the model bucket next to the weights and loaded by the next pod, so it does not pay minutes of
compilation. The mode is the catalog's (`compile:` on a model, `contract.model_spec.CompileMode`):

- `default`: inductor's fused kernels, no autotuning. What a worker can afford at start: each batch bucket
  compiles once (tens of seconds on a GPU), where `max-autotune` benchmarks kernel choices per shape (inductor at
  max-autotune and four buckets did not finish in a 10-minute run on an H100).
- `max-autotune-no-cudagraphs`: autotuned kernels (matmul and convolution choices, Triton templates); minutes
  per bucket the first time, then from the saved artifacts.
- `reduce-overhead`: `default`'s kernels replayed as one CUDA graph per batch bucket (no launch cost per kernel:
  what a launch-bound batch-1 step needs). Each call marks a new CUDA-graph step and its outputs are copied out
  of the graph's pool, so a scheduler that keeps a model output (PNDM's history) never reads one a later replay
  overwrote. Static shapes per bucket: a step-level running set must be padded to its bucket.

`graphs_compiled()` counts Dynamo's graphs in the process (a recompile is one more): the warm-up compiles one per
bucket, and after it the count must not move (no adapter, no request compiles).
"""

from __future__ import annotations

import logging
from typing import get_args

from contract.model_spec import CompileMode, ModelSpec

log = logging.getLogger(__name__)

# The mode a model is compiled in when the catalog names none and the worker is told to compile every model
# (MAAS_TORCH_COMPILE=1): the one whose compile time a worker can afford at start (the module docstring).
DEFAULT_COMPILE_MODE = "default"
COMPILE_MODES = get_args(CompileMode)


def compile_mode(spec: ModelSpec, override: bool | None = None) -> str | None:
    """The torch.compile mode `spec` is served in, or None for eager. `override` is MAAS_TORCH_COMPILE: None (unset)
    follows the catalog's `compile:`; False runs every model eager (a rollback without a catalog change); True
    compiles every diffusers model, in its catalog mode or `DEFAULT_COMPILE_MODE`."""
    if spec.runner != "diffusers" or override is False:
        return None
    if override is True:
        return spec.compile or DEFAULT_COMPILE_MODE
    return spec.compile


def compile_options(mode: str | None, backend: str | None) -> dict:
    """torch.compile's keyword arguments: inductor in `mode` (None: `DEFAULT_COMPILE_MODE`) when no backend is
    named or the named one is inductor (which the CPU test names); another backend (the tests' `eager`: Dynamo's
    tracing and guards, no code generation) takes no mode."""
    mode = mode or DEFAULT_COMPILE_MODE
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if backend is None:
        return {"mode": mode}
    if backend == "inductor":
        return {"backend": backend, "mode": mode}
    return {"backend": backend}


def compile_model(model, mode: str | None, backend: str | None = None):
    """`model` compiled for static shapes in `mode` (see `compile_options`); under `reduce-overhead`, each call
    starts a new CUDA-graph step and returns copies of the graph's outputs (the module docstring)."""
    import torch

    options = compile_options(mode, backend)
    compiled = torch.compile(model, dynamic=False, **options)
    if options.get("mode") == "reduce-overhead":
        compiled.register_forward_pre_hook(lambda _module, _args: torch.compiler.cudagraph_mark_step_begin())
        compiled.register_forward_hook(lambda _module, _args, output: _copied(output))
    return compiled


def _copied(output):
    """A model output with its tensors copied: a tuple, a diffusers output (dict-like, e.g. `.sample`), a tensor."""
    import torch

    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, tuple):
        return tuple(_copied(value) for value in output)
    if hasattr(output, "items"):
        for key, value in list(output.items()):
            output[key] = _copied(value)
    return output


def graphs_compiled() -> int:
    """Graphs torch.compile (Dynamo) has compiled in this process so far; a recompile (a guard failing: a new shape,
    an adapter that changed a layer) is one more. Read it after the warm-up and again after serving: equal means
    nothing compiled meanwhile. Works on torch 2.11 and 2.13 (`torch._dynamo.utils.counters`)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to the model's batch limit (and the limit itself): the compiled shapes."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch_size]


def pad_to_bucket(items: list, max_batch_size: int) -> list:
    """Repeats the last item up to the next compiled batch size; the extra images are dropped after the call."""
    size = next(bucket for bucket in batch_buckets(max_batch_size) if bucket >= len(items))
    return items + [items[-1]] * (size - len(items))


class CompileCache:
    """PyTorch's saved compile artifacts, kept in the model bucket next to the weights they were built for."""

    def __init__(self, bucket, object_name: str) -> None:
        self._blob = bucket.blob(object_name)
        self._name = object_name

    def load(self) -> bool:
        import torch

        try:
            data = self._blob.download_as_bytes()
        except Exception as exc:  # noqa: BLE001 - a missing cache means compiling from scratch, not failing
            log.info("no compile cache at %s (%s): compiling from scratch", self._name, type(exc).__name__)
            return False
        torch.compiler.load_cache_artifacts(data)
        log.info("loaded %.1f MB of compile artifacts from %s", len(data) / 1e6, self._name)
        return True

    def save(self) -> None:
        import torch

        artifacts = torch.compiler.save_cache_artifacts()
        if not artifacts:
            return
        data, _info = artifacts
        try:
            self._blob.upload_from_string(data)
            log.info("saved %.1f MB of compile artifacts to %s", len(data) / 1e6, self._name)
        except Exception:  # noqa: BLE001 - the next pod compiles again; serving goes on
            log.warning("could not save compile artifacts to %s", self._name, exc_info=True)


def compile_cache_key(spec: ModelSpec, mode: str | None = None) -> str:
    """Artifacts are only valid for the same torch build, GPU model, bucket shapes, compile mode (None: the
    catalog's, or the default), adapter slots and quantization (a quantized model's graphs are others: a version
    that changes `quantization:` on the same weights gets its own). A model with adapters is compiled with its
    hotswap slots in every layer, `max_adapters_per_request` of them at rank `max_rank` (`adapters/lora.py`):
    other slots are other graphs, so a catalog change of either never loads the artifacts of the old shapes; so are
    its IP-Adapter slots (`controls.image_prompt_slots`)."""
    import torch

    device = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    buckets = "-".join(str(size) for size in batch_buckets(spec.max_batch_size))
    mode = mode or spec.compile or DEFAULT_COMPILE_MODE
    key = f"torch-{torch.__version__}-{device}-{spec.defaults.width}x{spec.defaults.height}-b{buckets}-{mode}"
    if spec.adapters is not None:
        key += f"-lora{spec.adapters.max_adapters_per_request}r{spec.adapters.max_rank}"
    if (slots := spec.image_prompt_slots(compiled=True)) is not None:  # its IP-Adapter slots (controls/ip_adapters.py)
        key += f"-ip{spec.controls.max_image_prompts_per_request}x{slots.embedding_width}t{slots.tokens}"
    if spec.quantization is not None:
        key += f"-{spec.quantization.type}-{'+'.join(sorted(spec.quantization.components))}"
    return key
