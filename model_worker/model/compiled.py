"""Compiled denoisers: the static batch sizes they are compiled for, and PyTorch's saved compile artifacts.

A compiled model's shapes must be static, so batches are padded up to fixed bucket sizes; the artifacts are
saved to the model bucket next to the weights and loaded by the next pod, so it does not pay minutes of
compilation.
"""

from __future__ import annotations

import logging

from contract.model_spec import ModelSpec

log = logging.getLogger(__name__)


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


def compile_cache_key(spec: ModelSpec) -> str:
    """Artifacts are only valid for the same torch build, GPU model, bucket shapes, adapter slots and quantization
    (a quantized model's graphs are others: a version that changes `quantization:` on the same weights gets its
    own). A model with adapters is compiled with its hotswap slots in every layer, `max_adapters_per_request` of
    them at rank `max_rank` (`adapters/lora.py`): other slots are other graphs, so a catalog change of either
    never loads the artifacts of the old shapes."""
    import torch

    device = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    buckets = "-".join(str(size) for size in batch_buckets(spec.max_batch_size))
    key = f"torch-{torch.__version__}-{device}-{spec.defaults.width}x{spec.defaults.height}-b{buckets}"
    if spec.adapters is not None:
        key += f"-lora{spec.adapters.max_adapters_per_request}r{spec.adapters.max_rank}"
    if spec.quantization is not None:
        key += f"-{spec.quantization.type}-{'+'.join(sorted(spec.quantization.components))}"
    return key
