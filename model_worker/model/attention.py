"""Diffusers' attention modules without their per-call introspection.

`Attention.forward` (UNets, SD 3.5's MMDiT, the VAEs) and `FluxAttention.forward` call
`inspect.signature(self.processor.__call__)` on every call, to warn about and drop keyword arguments the processor
does not take: about 20 us of host time each, 32 times a call of an SD-1.5 UNet and 57 of a FLUX transformer. On a
GPU, a small batch's step is bound by the host launching its kernels, so that time is the step's. The worker passes
attention no extra keyword arguments but the image prompts' (a LoRA scale is taken off before the blocks), so for a
call with no others each module here calls its processor directly, with exactly the arguments the original forward
would pass it; a call with any other goes through the original forward, warning and all. A compiled model traces the
same calls once (Dynamo cannot trace the original forward's call through `type(self)`: a graph break per module).
"""

from __future__ import annotations

import types


def without_attention_introspection(pipeline) -> int:
    """Gives every introspecting attention module of the pipeline's components the direct forward; returns how many
    it changed. A module already given it, or wrapped by accelerate (an offload hook owns its forward), is left."""
    import torch
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_flux import FluxAttention

    # The classes themselves, not subclasses (one may forward otherwise), and how each calls its processor.
    direct = {Attention: plain_attention_forward, FluxAttention: flux_attention_forward}
    changed = 0
    for component in pipeline.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for module in component.modules():
            forward = direct.get(type(module))
            if forward is None or "forward" in vars(module) or hasattr(module, "_hf_hook"):
                continue
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed


# The image prompts' arguments (model_worker/controls/ip_adapters.py): the IP-Adapter processors take them, and the
# original forwards drop them without a warning for the others.
IMAGE_PROMPT_ARGUMENTS = frozenset({"ip_adapter_masks", "ip_hidden_states"})


def image_prompt_arguments(self, kwargs: dict) -> dict | None:
    """What of `kwargs` the module's processor takes when they are image prompts' arguments only (those an IP-Adapter
    processor takes, none for the others, as the original forward filters them); None for any other arguments."""
    if not kwargs.keys() <= IMAGE_PROMPT_ARGUMENTS:
        return None
    return kwargs if hasattr(self.processor, "to_k_ip") else {}


def plain_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
    extra = image_prompt_arguments(self, kwargs)
    if extra is None:
        return type(self).forward(self, hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    return self.processor(
        self, hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask, **extra
    )


def flux_attention_forward(
    self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None, **kwargs
):
    extra = image_prompt_arguments(self, kwargs)
    if extra is None:
        return type(self).forward(
            self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs
        )
    return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **extra)
