"""LoRA adapters applied per call, not fused: forward hooks on the targeted Linear modules add
`scale * alpha / rank * B(A(x))` to their output while a set is active.

Every call runs one adapter set (requests with different sets never share a UNet call: the batch key),
so switching is between calls: the hooks of the previous set are removed and the new set's registered.
Switching is all or nothing: every target module and device copy is found before the first hook is attached,
and a failure while attaching removes what was attached, so a set that cannot be applied fails its own
request and leaves the base model behind, never half an adapter.
A base-model call runs with no hook at all, so it is exactly the plain model whatever ran before it, and
an adapter's weights are never merged into (and rounded into) the base weights. The device copies of the
adapters are an LRU of `device_cache` per model; a miss copies from host memory on the device thread
(small next to a step: see `make bench`).
"""

from __future__ import annotations

from collections import OrderedDict

from model_worker.adapters import LoraWeights


class LoraHooks:
    def __init__(self, components: dict, device: str, dtype, device_cache: int) -> None:
        """`components`: the pipeline's modules by the name adapters use (`unet`, `text_encoder`)."""
        self._components = components
        self._device, self._dtype = device, dtype
        self._device_cache = max(1, device_cache)
        self._resident: OrderedDict[tuple[str, str], dict] = OrderedDict()
        self._handles: list = []
        self._active: tuple = ()

    def activate(self, adapters: list[tuple[LoraWeights, float]]) -> None:
        """Makes `adapters` (weights, scale) the set the next calls run with; [] is the base model.

        All or nothing: when it raises (ValueError naming the adapter: its request fails alone), no hook is left
        attached and the next call runs the base model."""
        key = tuple((weights.key, scale) for weights, scale in adapters)
        if key == self._active:
            return
        self._detach()
        try:
            terms = self._terms(adapters)
            for linear, added in terms.values():
                self._handles.append(linear.register_forward_hook(_adds(added)))
        except BaseException:
            self._detach()
            raise
        self._active = key

    def _detach(self) -> None:
        handles, self._handles, self._active = self._handles, [], ()
        for handle in handles:
            handle.remove()

    def _terms(self, adapters: list[tuple[LoraWeights, float]]) -> dict:
        """Per target module: the module and its (A, B, scale x alpha / rank) terms, before anything is attached."""
        terms: dict[tuple[str, str], tuple] = {}
        for weights, scale in adapters:
            for target, (a, b, factor) in self._on_device(weights).items():
                if target not in terms:
                    terms[target] = (self._module(weights, *target), [])
                terms[target][1].append((a, b, scale * factor))
        return terms

    def _module(self, weights: LoraWeights, component: str, module: str):
        import torch

        adapter = f"adapter {weights.name}@{weights.version}"
        root = self._components.get(component)
        if root is None:
            raise ValueError(f"{adapter} targets {component}, which this pipeline does not have")
        try:
            found = root.get_submodule(module)
        except AttributeError as exc:
            raise ValueError(f"{adapter} targets {component}.{module}, which does not exist") from exc
        if not isinstance(found, torch.nn.Linear):
            raise ValueError(f"{adapter} targets {component}.{module} ({type(found).__name__}): not a Linear module")
        return found

    def _on_device(self, weights: LoraWeights) -> dict:
        resident = self._resident.get(weights.key)
        if resident is None:
            resident = {
                target: (a.to(self._device, self._dtype), b.to(self._device, self._dtype), factor)
                for target, (a, b, factor) in weights.targets.items()
            }
            self._resident[weights.key] = resident
            while len(self._resident) > self._device_cache:
                self._resident.popitem(last=False)
        self._resident.move_to_end(weights.key)
        return resident


def _adds(terms: list):
    import torch.nn.functional as functional

    def hook(_module, inputs, output):
        x = inputs[0]
        for a, b, scale in terms:
            output = output + scale * functional.linear(functional.linear(x, a), b)
        return output

    return hook
