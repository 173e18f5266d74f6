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

A compiled model (the catalog's `compile:`, or `MAAS_TORCH_COMPILE=1`) is never recompiled by an adapter: before it is compiled, every slot
(one per place in a request's set) is made on the denoiser, an empty adapter of rank `max_rank` (zeros, so
exactly the base model) on every Linear and Conv2d layer, each layer's scaling a tensor (diffusers'
`enable_lora_hotswap`), every slot active in every layer; the warm-up traces the model with them. An adapter is
then swapped into its slot with `load_lora_weights(..., hotswap=True)`, which copies its weights into the slot's
(zero-padded to `max_rank`; the layers it leaves out zeroed), and a call's scales are written into the scaling
tensors in place (a slot the set leaves out, and every slot on a base call, at 0), so no module, no active set and
no value the graph was traced with changes. Each layer's scaling at scale 1 is the adapter's own alpha / rank for
that layer, read from the LoRA config diffusers makes for it (PEFT's hotswap applies only the config's default
alpha and rank, and refuses a file whose alphas differ per layer). A swap that fails leaves its slot zeroed and
its request fails alone; diffusers' own cleanup of a failed hotswap, which deletes the slot's layers, never runs.
diffusers cannot hotswap text-encoder layers, so a compiled model serves adapters that change the denoiser only.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

from model_worker.adapters.loader import LoraWeights

log = logging.getLogger(__name__)

TEXT_ENCODER_PREFIXES = ("text_encoder", "lora_te")


@dataclass(frozen=True)
class Slots:
    """A compiled model's hotswap slots: `count` adapters a set may hold, each of rank up to `rank`, on the pipeline
    component `component` (the denoiser: the one compiled)."""

    count: int
    rank: int
    component: str

    def names(self) -> list[str]:
        # One width for every name: PEFT's hotswap finds a slot's weights by substring (`slot_1` is in `slot_10`).
        width = len(str(self.count - 1))
        return [f"slot_{index:0{width}d}" for index in range(self.count)]


class _OtherAdaptersReport(logging.Filter):
    """Drops transformers' LOAD REPORT of a text-encoder adapter load: transformers 5.23 lists every other resident
    adapter's weights as "MISSING ... newly initialized", which is false (they are untouched) and would alarm
    whoever reads the worker's log; a load that really fails raises, and its request fails with the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


logging.getLogger("transformers.integrations.peft").addFilter(_OtherAdaptersReport())


class LoraSets:
    """One pipeline's adapters on the device and the set its next calls run with."""

    def __init__(self, pipeline, components: tuple[str, ...], device_cache: int, slots: Slots | None = None):
        """`components`: the pipeline's LoRA components (the family's); `slots`: a compiled model's hotswap slots,
        made here (call this before the model is compiled), None when it runs eagerly."""
        self._pipeline = pipeline
        self._components = components
        self._device_cache = max(1, device_cache)
        self._hotswap = slots is not None
        # Adapter (name, version, digest) -> its name in the pipeline (an eager model's).
        self._resident: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._names = itertools.count()
        # A compiled model's: slot -> the adapter it holds; slot -> [(LoRA layer, its scaling at scale 1)].
        self._slot_names: list[str] = []
        self._slots: dict[str, tuple[str, str, str]] = {}
        self._units: dict[str, list] = {}
        self._active: tuple | None = ()
        if slots is not None:
            self._make_slots(slots)

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

    # --- a compiled model's slots ---------------------------------------------------------------------------

    def _make_slots(self, slots: Slots) -> None:
        """Every slot on the denoiser before it is compiled: an empty adapter (zeros) of rank `slots.rank` on each
        Linear and Conv2d layer, so any adapter up to that rank swaps in without a new module; the scalings made
        tensors and set to 0, every slot active in every layer."""
        import torch

        model = getattr(self._pipeline, slots.component)
        shapes = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                down, up = (slots.rank, module.in_features), (module.out_features, slots.rank)
            elif isinstance(module, torch.nn.Conv2d) and module.groups == 1:
                down, up = (
                    (slots.rank, module.in_channels, *module.kernel_size),
                    (module.out_channels, slots.rank, 1, 1),
                )
            else:
                continue
            shapes[name] = (down, up, {"dtype": module.weight.dtype, "device": module.weight.device})
        self._slot_names = slots.names()
        for slot in self._slot_names:
            # Zeros of its own for each slot: the loaded layers keep the tensors they are given, not copies.
            empty = {}
            for name, (down, up, like) in shapes.items():
                empty[f"{slots.component}.{name}.lora_A.weight"] = torch.zeros(down, **like)
                empty[f"{slots.component}.{name}.lora_B.weight"] = torch.zeros(up, **like)
            # diffusers makes the scalings tensors (and pads to the rank) on the first load after this call only.
            self._pipeline.enable_lora_hotswap(target_rank=slots.rank, check_compiled="ignore")
            with warnings.catch_warnings():  # PEFT's "multiple adapters" notice for every slot after the first
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                self._pipeline.load_lora_weights(empty, adapter_name=slot)
        layers = list(self._lora_layers())
        for module in layers:
            module.set_adapter(self._slot_names)
        self._units = {
            slot: [(module, 0.0) for module in layers if slot in module.scaling] for slot in self._slot_names
        }
        self._scale_slots({})
        log.info("%d adapter slots of rank %d on %d layers of the %s, made before compiling",
                 slots.count, slots.rank, len(layers), slots.component)  # fmt: skip

    def _set_slots(self, adapters: list[tuple[LoraWeights, float]]) -> None:
        """A compiled model's set: each adapter swapped into its slot, then every slot's scaling written in place
        (0 for the slots the set leaves out: a base call is every slot at 0). Which adapters run, and the values the
        graph was traced with, never change: no `set_adapters`, no layers switched off (either would recompile)."""
        if len(adapters) > len(self._slot_names):
            raise ValueError(f"{len(adapters)} adapters in one set: a compiled model has {len(self._slot_names)} slots")
        for slot, (weights, _) in zip(self._slot_names, adapters, strict=False):
            self._swap_in(slot, weights)
        self._scale_slots({slot: scale for slot, (_, scale) in zip(self._slot_names, adapters, strict=False)})

    def _scale_slots(self, scales: dict[str, float]) -> None:
        import torch

        for slot, layers in self._units.items():
            for module, unit in layers:
                value, current = unit * scales.get(slot, 0.0), module.scaling[slot]
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    module.scaling[slot] = value

    def _swap_in(self, slot: str, weights: LoraWeights) -> None:
        """`weights` copied into `slot`'s layers in place (diffusers' hotswap: it converts the file's layout), with
        each layer's scaling at scale 1 as the adapter's own config gives it. A failed swap leaves the slot empty."""
        if self._slots.get(slot) == weights.key:
            return
        if any(key.startswith(TEXT_ENCODER_PREFIXES) for key in weights.tensors):
            raise ValueError(f"adapter {weights.name}@{weights.version} changes a text encoder: a compiled model "
                             "serves adapters that change the denoiser only (diffusers cannot hotswap text encoders)")  # fmt: skip
        self._slots.pop(slot, None)
        self._units[slot] = [(module, 0.0) for module, _ in self._units[slot]]
        try:
            with _hotswaps() as swaps:
                self._pipeline.load_lora_weights(dict(weights.tensors), adapter_name=slot, hotswap=True)
            if swaps.error is not None:
                raise swaps.error
            if not swaps.done:
                raise ValueError("diffusers swapped no layer in (or no longer through peft.utils.hotswap)")
            units = _layer_scalings(swaps.done, slot)
            self._units[slot] = [(module, units.get(id(module), 0.0)) for module, _ in self._units[slot]]
        except Exception as exc:
            self._empty(slot)
            raise ValueError(f"adapter {weights.name}@{weights.version} could not be swapped into a compiled "
                             f"model's slot: {exc}") from exc  # fmt: skip
        self._slots[slot] = weights.key

    def _empty(self, slot: str) -> None:
        """Zeros the slot's weights in place, wherever a failed swap got to (the modules stay: no recompile)."""
        for module, _ in self._units[slot]:
            for part in (module.lora_A, module.lora_B):
                part[slot].weight.data.zero_()

    # --- an eager model's adapters ----------------------------------------------------------------------------

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


class _Swaps:
    """What diffusers' hotswap did in one `_hotswaps()` context: each component's swap (its model, the state dict in
    PEFT's names, the LoRA config diffusers made from the file), and the first error of a check or swap."""

    def __init__(self) -> None:
        self.done: list[tuple] = []
        self.error: Exception | None = None

    def compatible(self, check, config0, config1) -> None:
        from peft.utils import hotswap

        keys = hotswap.CONFIG_KEYS_TO_CHECK.get(config0.peft_type)
        try:
            if keys is None or config0.peft_type != config1.peft_type:
                check(config0, config1)  # PEFT's own refusal of another adapter type
            for key in keys or ():
                if key != "alpha_pattern" and getattr(config0, key, None) != getattr(config1, key, None):
                    raise ValueError(f"a compiled model's slots take no adapter with {key} {getattr(config1, key)!r}")
        except Exception as exc:  # noqa: BLE001 - raised by the caller, after diffusers returns
            self.error = self.error or exc

    def swapped(self, swap, model, state_dict, adapter_name, config, *args, **kwargs) -> None:
        if self.error is not None:
            return
        try:
            swap(model, state_dict, adapter_name, config, *args, **kwargs)
            self.done.append((model, state_dict, config))
        except Exception as exc:  # noqa: BLE001 - raised by the caller, after diffusers returns
            self.error = exc


class _HotswapHooks:
    """PEFT's two hotswap functions, replaced in `peft.utils.hotswap` while at least one `_hotswaps()` context is
    open anywhere, by hooks that hand each call to the innermost context of the calling thread (or to PEFT's own
    function on a thread without one). Counted under a lock: the first context in installs them, the last one out
    puts PEFT's back, so overlapping contexts on one or several threads neither lose a call nor leave a dead
    context's hook behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._originals: tuple | None = None
        self._local = threading.local()

    @contextmanager
    def recording(self):
        from peft.utils import hotswap

        swaps = _Swaps()
        with self._lock:
            if self._open == 0:
                self._originals = (hotswap.check_hotswap_configs_compatible, hotswap.hotswap_adapter_from_state_dict)
                hotswap.check_hotswap_configs_compatible = self._compatible
                hotswap.hotswap_adapter_from_state_dict = self._swapped
            self._open += 1
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(swaps)
        try:
            yield swaps
        finally:
            stack.remove(swaps)
            with self._lock:
                self._open -= 1
                if self._open == 0:
                    hotswap.check_hotswap_configs_compatible, hotswap.hotswap_adapter_from_state_dict = self._originals

    def _innermost(self) -> _Swaps | None:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    def _compatible(self, config0, config1) -> None:
        check, _ = self._originals
        swaps = self._innermost()
        return check(config0, config1) if swaps is None else swaps.compatible(check, config0, config1)

    def _swapped(self, model, state_dict, adapter_name, config, *args, **kwargs) -> None:
        _, swap = self._originals
        swaps = self._innermost()
        if swaps is None:
            return swap(model, state_dict, adapter_name, config, *args, **kwargs)
        return swaps.swapped(swap, model, state_dict, adapter_name, config, *args, **kwargs)


_HOOKS = _HotswapHooks()


def _hotswaps():
    """While diffusers hotswaps, records each component's swap and keeps its error instead of raising it: diffusers
    answers an error inside its hotswap by deleting the adapter's layers from every module (a compiled model's
    slot would be gone, and the model recompiled), so the caller raises it once diffusers has returned. An adapter
    whose alphas differ per layer passes PEFT's config check (every other key it checks must still match): PEFT's
    swap writes the config's default alpha / rank into every layer, and `_layer_scalings` then gives each its own.
    diffusers imports both functions from `peft.utils.hotswap` when it hotswaps, so they are replaced there while
    any context is open (`_HotswapHooks`: re-entrant, and each thread's calls reach its own context)."""
    return _HOOKS.recording()


def _layer_scalings(swaps: list[tuple], slot: str) -> dict[int, float]:
    """id(LoRA layer) -> its scaling at scale 1 for the adapter just swapped into `slot`, as PEFT gives a layer it
    injects: the config's rank and alpha patterns matched against the layer's name (alpha / rank, or alpha /
    sqrt(rank) for rsLoRA). Layers the adapter leaves out are not in it (their weights were zeroed)."""
    from peft.utils.other import get_pattern_key

    units: dict[int, float] = {}
    for model, state_dict, config in swaps:
        targeted = {key.rsplit(".", 3)[0] for key in state_dict if f".{slot}." in key}
        root = getattr(model, "_orig_mod", model)  # a compiled model's own modules
        for name in targeted:
            module = root.get_submodule(name)
            rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r)
            alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha)
            units[id(module)] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    return units
