"""LoRA adapter sets activated per call on diffusers' own LoRA layers (PEFT backend), never fused.

Every call runs one adapter set (requests with different sets never share a model call: the batch key), so
switching is between calls. An adapter is put on the device once, by diffusers' `load_lora_weights` under a
name of its own (diffusers converts the file's layout: PEFT, kohya, LoCon, FLUX's), and stays there in an LRU
of `device_cache` per model; eviction deletes its layers (what `delete_adapters` does, component by component,
tolerating one the adapter never reached). A call's set is `set_adapters(names, scales)`;
a base-model call runs with the LoRA layers disabled, which is exactly the plain model (the base layer alone),
and an adapter is never merged into (and rounded into) the base weights.

Never half an adapter: a load that fails part-way (diffusers loads the denoiser's layers, then each text
encoder's) has its name deleted from every component before the error is raised, and a failed `set_adapters`
leaves the LoRA layers disabled; either way the request fails alone (ValueError naming the adapter) and the
next call runs the base model or its own set.

A compiled model (`MAAS_TORCH_COMPILE=1`) keeps its graph: `enable_lora_hotswap(target_rank=max_rank)` runs
before compiling, and an adapter is swapped into one of a fixed set of slots (one per place in a request's
set) with `hotswap=True`, so loading another adapter changes weights, not modules; every slot stays active
and a call's scales are written into PEFT's scaling tensors in place (a slot the set leaves out, or a base
call's, at 0), so nothing the graph was traced with changes. diffusers cannot hotswap text-encoder layers,
so a compiled model serves adapters that change the denoiser only.
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
    """One pipeline's adapters on the device and the set its next calls run with."""

    def __init__(self, pipeline, components: tuple[str, ...], device_cache: int, hotswap_rank: int | None = None):
        """`components`: the pipeline's LoRA components (the family's); `hotswap_rank`: a compiled model's
        largest adapter rank (set before the model is compiled), None when it runs eagerly."""
        self._pipeline = pipeline
        self._components = components
        self._device_cache = max(1, device_cache)
        self._hotswap = hotswap_rank is not None
        self._target_rank = hotswap_rank
        # Adapter (name, version, digest) -> its name in the pipeline; a compiled model's slots are fixed names instead.
        self._resident: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._slots: dict[str, tuple[str, str, str]] = {}
        self._units: dict[str, list] = {}  # a compiled model's slot -> [(LoRA layer, its scaling at scale 1)]
        self._names = itertools.count()
        self._active: tuple | None = ()
        if self._hotswap:
            pipeline.enable_lora_hotswap(target_rank=hotswap_rank)

    def activate(self, adapters: list[tuple[LoraWeights, float]]) -> None:
        """Makes `adapters` (weights, scale) the set the next calls run with; [] is the base model.

        All or nothing: when it raises (ValueError naming the adapter: its request fails alone), the model is left
        running its base weights and no partly loaded adapter is left, so the next call runs the base model."""
        key = tuple((weights.key, scale) for weights, scale in adapters)
        if key == self._active:
            return
        self._active = None  # unknown until this completes
        try:
            if self._hotswap:
                self._set_slots(adapters)
            elif adapters:
                names = self._on_device([weights for weights, _ in adapters])
                self._enable(True)
                try:
                    self._pipeline.set_adapters(names, [scale for _, scale in adapters])
                except Exception as exc:
                    sets = ", ".join(f"{weights.name}@{weights.version}" for weights, _ in adapters)
                    raise ValueError(f"adapters {sets} could not be activated: {exc}") from exc
            else:
                self._enable(False)
        except BaseException:
            self._to_base()
            raise
        self._active = key

    def _to_base(self) -> None:
        if self._hotswap:
            self._scale_slots({})
        else:
            self._enable(False)

    def _set_slots(self, adapters: list[tuple[LoraWeights, float]]) -> None:
        """A compiled model's set: each adapter swapped into its slot, then every slot's scaling written in place
        (0 for the slots the set leaves out: a base call is every slot at 0). Which adapters run, and the values the
        graph was traced with, never change: no `set_adapters`, no layers switched off (either would recompile)."""
        for index, (weights, _) in enumerate(adapters):
            self._swap_in(f"slot_{index}", weights)
        self._scale_slots({f"slot_{index}": scale for index, (_, scale) in enumerate(adapters)})

    def _scale_slots(self, scales: dict[str, float]) -> None:
        import torch

        for slot, layers in self._units.items():
            for module, unit in layers:
                value, current = unit * scales.get(slot, 0.0), module.scaling[slot]
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    module.scaling[slot] = value

    def _record_slot(self, slot: str) -> None:
        """After a load into `slot`: each layer's scaling at scale 1 (alpha / rank, as PEFT set it), and every slot
        active in every layer."""
        layers = list(self._lora_layers())
        self._units[slot] = [(module, float(module.scaling[slot])) for module in layers if slot in module.scaling]
        for module in layers:
            module.set_adapter(sorted(self._slots))

    def _lora_layers(self):
        from peft.tuners.tuners_utils import BaseTunerLayer

        for component in self._components:
            model = getattr(self._pipeline, component, None)
            for module in model.modules() if model is not None else ():
                if isinstance(module, BaseTunerLayer):
                    yield module

    def _enable(self, enabled: bool) -> None:
        """Turns every LoRA layer of the components on or off (off: each runs its base layer alone). diffusers'
        `disable_lora` refuses a component that holds no adapter; this does not."""
        for module in self._lora_layers():
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
            log.info("adapter %s@%s dropped from the device (least recently used)", *oldest[:2])
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
            self._scale_slots({slot: 1.0})  # the scaling PEFT compares with and overwrites: alpha / rank, as loaded
            try:
                self._pipeline.load_lora_weights(dict(weights.tensors), adapter_name=slot, hotswap=True)
                self._slots[slot] = weights.key
                self._record_slot(slot)
                return slot
            except Exception as exc:  # noqa: BLE001 - the slot is rebuilt below, whatever it holds now
                log.warning("adapter %s@%s could not be swapped in for %s@%s (%s): loading it anew",
                            weights.name, weights.version, *held[:2], exc)  # fmt: skip
                self._units.pop(slot, None)
                self._delete(slot)
        # diffusers pads a fresh adapter to the target rank and makes its scalings tensors on the first load after
        # `enable_lora_hotswap` only: asked again for every slot, so each can take any adapter up to max_rank.
        self._pipeline.enable_lora_hotswap(target_rank=self._target_rank, check_compiled="warn")
        self._load(weights, slot)
        self._slots[slot] = weights.key
        self._record_slot(slot)
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
