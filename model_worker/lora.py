"""LoRA adapter sets activated per call on diffusers' own LoRA layers (PEFT backend), never fused.

Every call runs one adapter set (requests with different sets never share a model call: the batch key), so
switching is between calls. An adapter is put on the device once, by diffusers' `load_lora_weights` under a
name of its own (diffusers converts the file's layout: PEFT, kohya, LoCon, FLUX's), and stays there in an LRU
of `device_cache` per model; eviction is `delete_adapters`. A call's set is `set_adapters(names, scales)`;
a base-model call runs with the LoRA layers disabled, which is exactly the plain model (the base layer alone),
and an adapter is never merged into (and rounded into) the base weights.

Never half an adapter: a load that fails part-way (diffusers loads the denoiser's layers, then each text
encoder's) has its name deleted from every component before the error is raised, and a failed `set_adapters`
leaves the LoRA layers disabled; either way the request fails alone (ValueError naming the adapter) and the
next call runs the base model or its own set.

A compiled model (`MAAS_TORCH_COMPILE=1`) keeps its graph: `enable_lora_hotswap(target_rank=max_rank)` runs
before compiling, and an adapter is swapped into one of a fixed set of slots (one per place in a request's
set) with `hotswap=True`, so loading another adapter changes weights, not modules. diffusers cannot hotswap
text-encoder layers, so a compiled model serves adapters that change the denoiser only.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from model_worker.adapters import LoraWeights

log = logging.getLogger(__name__)

TEXT_ENCODER_PREFIXES = ("text_encoder", "lora_te")


class _OtherAdaptersReport(logging.Filter):
    """Drops transformers' LOAD REPORT of a text-encoder adapter load: transformers 5.23 lists every other resident
    adapter's weights as "MISSING ... newly initialized", which is false (they are untouched) and would alarm
    whoever reads the worker's log; a load that really fails raises, and its request fails with the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


logging.getLogger("transformers.integrations.peft").addFilter(_OtherAdaptersReport())


class LoraSets:
    def __init__(self, pipeline, components: tuple[str, ...], device_cache: int, hotswap_rank: int | None = None):
        """`components`: the pipeline's LoRA components (the family's); `hotswap_rank`: a compiled model's
        largest adapter rank (set before the model is compiled), None when it runs eagerly."""
        self._pipeline = pipeline
        self._components = components
        self._device_cache = max(1, device_cache)
        self._hotswap = hotswap_rank is not None
        # Adapter (name, version) -> its name in the pipeline; a compiled model's slots are fixed names instead.
        self._resident: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._slots: dict[str, tuple[str, str]] = {}
        self._names = itertools.count()
        self._active: tuple | None = ()
        if self._hotswap:
            pipeline.enable_lora_hotswap(target_rank=hotswap_rank)

    @property
    def resident(self) -> list[tuple[str, str]]:
        """The adapters on the device, least recently used first."""
        return list(self._slots.values()) if self._hotswap else list(self._resident)

    def activate(self, adapters: list[tuple[LoraWeights, float]]) -> None:
        """Makes `adapters` (weights, scale) the set the next calls run with; [] is the base model.

        All or nothing: when it raises (ValueError naming the adapter: its request fails alone), the LoRA layers
        are disabled and no partly loaded adapter is left, so the next call runs the base model."""
        key = tuple((weights.key, scale) for weights, scale in adapters)
        if key == self._active:
            return
        self._active = None  # unknown until this completes
        try:
            if adapters:
                names = self._on_device([weights for weights, _ in adapters])
                self._enable(True)
                try:
                    self._pipeline.set_adapters(names, [scale for _, scale in adapters])
                except Exception as exc:
                    sets = ", ".join(f"{weights.name}@{weights.version}" for weights, _ in adapters)
                    raise ValueError(f"adapters {sets} could not be activated: {exc}") from exc
        except BaseException:
            self._enable(False)
            raise
        if not adapters:
            self._enable(False)
        self._active = key

    def _enable(self, enabled: bool) -> None:
        """Turns every LoRA layer of the components on or off (off: each runs its base layer alone). diffusers'
        `disable_lora` refuses a component that holds no adapter; this does not."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for component in self._components:
            model = getattr(self._pipeline, component, None)
            for module in model.modules() if model is not None else ():
                if isinstance(module, BaseTunerLayer):
                    module.enable_adapters(enabled)

    def _on_device(self, adapters: list[LoraWeights]) -> list[str]:
        if self._hotswap:
            return [self._swap_in(f"slot_{index}", weights) for index, weights in enumerate(adapters)]
        names = []
        for weights in adapters:
            name = self._resident.get(weights.key)
            if name is None:
                name = f"adapter_{next(self._names)}"
                self._load(weights, name)
                self._resident[weights.key] = name
            self._resident.move_to_end(weights.key)
            names.append(name)
        while len(self._resident) > self._device_cache:
            oldest = next(iter(self._resident))
            if self._resident[oldest] in names:
                break  # a set larger than the cache stays whole until the next call
            self._delete(self._resident.pop(oldest))
            log.info("adapter %s@%s dropped from the device (least recently used)", *oldest)
        return names

    def _swap_in(self, slot: str, weights: LoraWeights) -> str:
        """A compiled model's slot holding `weights`: swapped in place, or loaded anew (one recompile) when the
        slot is empty or the adapter targets layers the slot's first adapter did not."""
        if self._slots.get(slot) == weights.key:
            return slot
        if any(key.startswith(TEXT_ENCODER_PREFIXES) for key in weights.tensors):
            raise ValueError(f"adapter {weights.name}@{weights.version} changes a text encoder: a compiled model "
                             "serves adapters that change the denoiser only (diffusers cannot hotswap text encoders)")  # fmt: skip
        if slot in self._slots:
            held = self._slots.pop(slot)
            try:
                self._pipeline.load_lora_weights(dict(weights.tensors), adapter_name=slot, hotswap=True)
                self._slots[slot] = weights.key
                return slot
            except Exception as exc:  # noqa: BLE001 - the slot is rebuilt below, whatever it holds now
                log.warning("adapter %s@%s could not be swapped in for %s@%s (%s): loading it anew",
                            weights.name, weights.version, *held, exc)  # fmt: skip
                self._delete(slot)
        self._load(weights, slot)
        self._slots[slot] = weights.key
        return slot

    def _load(self, weights: LoraWeights, name: str) -> None:
        try:
            self._pipeline.load_lora_weights(dict(weights.tensors), adapter_name=name)
        except Exception as exc:
            self._delete(name)  # a load that failed part-way leaves nothing behind
            raise ValueError(f"adapter {weights.name}@{weights.version} could not be loaded: {exc}") from exc

    def _delete(self, name: str) -> None:
        """Deletes the adapter's layers from every component, wherever the load got to."""
        from diffusers.utils.peft_utils import delete_adapter_layers

        for component in self._components:
            model = getattr(self._pipeline, component, None)
            if model is not None:
                delete_adapter_layers(model, name)
                config = getattr(model, "peft_config", None)
                if isinstance(config, dict):
                    config.pop(name, None)
