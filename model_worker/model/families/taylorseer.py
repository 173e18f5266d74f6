"""TaylorSeer over a running set of FLUX.1 images, each predicting alone (model_worker/model/step_cache.py).

The expensive part is the whole transformer: it runs only over the rows of the images that take a full step this
step (gathered, padded to a compiled bucket where the model is compiled: the compiled model itself, so a changing
count never compiles anything new), and each other image takes its own Taylor prediction of the transformer's output
from the factors its own full steps left. That is diffusers' `TaylorSeerCacheConfig` in its lite mode (the output
projection's output predicted, the blocks skipped), with the schedule counted in each image's own steps. A set where
every image runs in full is the model's own call over every row.

`scheduling: request` runs the pipeline's own call with diffusers' hook enabled for that call only
(`diffusers_taylorseer`): its schedule is by step, the same for every image of the call, so the decisions are the
per-image cache's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from model_worker.model.runners import RunningItem
from model_worker.model.step_cache import (
    ForcedPattern,
    TailCalls,
    record_skip,
    record_taylor,
    taylor_prediction,
    taylor_skips,
)

# The model over the gathered rows `index` of the call's inputs (None: every row of the call as it is): its output.
RowsCall = Callable[[list[int] | None], object]


def taylorseer_rows(running: list[RunningItem], call: RowsCall, forced: ForcedPattern | None = None,
                    tail_calls: TailCalls | None = None):  # fmt: skip
    """The model's output for `running`'s rows (one row an image), each image predicting when its schedule says so."""
    import torch

    rows = len(running)
    skips = taylor_skips(running, forced)
    full = [i for i, skip in enumerate(skips) if not skip]
    if full:
        computed = call(None if len(full) == rows else full)[: len(full)]
        if tail_calls is not None:
            tail_calls.calls += 1
            tail_calls.rows += len(full)
        for slot, i in enumerate(full):  # a copy: an image's factors must not keep the whole call's output alive
            record_taylor(running[i], computed[slot : slot + 1].to(torch.float32, copy=True))
        if len(full) == rows:
            return computed
    outputs, slots = [], {i: slot for slot, i in enumerate(full)}
    dtype = computed.dtype if full else running[0].state["step_cache"].factors[0].dtype
    for i, r in enumerate(running):
        if skips[i]:
            outputs.append(taylor_prediction(r).to(dtype))
            record_skip(r)
        else:
            outputs.append(computed[slots[i] : slots[i] + 1])
    return torch.cat(outputs)


class HookCounts:
    """`scheduling: request`'s count of one pipeline call's steps: the transformer's calls, and those that ran it."""

    def __init__(self) -> None:
        self.calls = 0
        self.full = 0

    @property
    def skipped(self) -> int:
        return self.calls - self.full


@contextmanager
def diffusers_taylorseer(transformer, interval: int, warmup_steps: int, max_order: int) -> Iterator[HookCounts]:
    """diffusers' own TaylorSeer hook (`enable_cache`, lite mode, float32 factors) on `transformer` for one pipeline
    call: enabled fresh, so no call predicts from another's outputs, and removed after it. Counts the transformer's
    calls and the output projection's own forwards (a full step's). The cache context is set here for the pipelines
    that name none (FLUX.1's image-to-image, Kontext, Fill: diffusers_first_block)."""
    import torch
    from diffusers.hooks import HookRegistry, TaylorSeerCacheConfig
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    model = getattr(transformer, "_orig_mod", transformer)
    model.enable_cache(
        TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=warmup_steps, max_order=max_order,
                              taylor_factors_dtype=torch.float32, use_lite_mode=True)
    )  # fmt: skip
    _set_cache_context(model, CacheContext("cond"))
    counts = HookCounts()
    handle = model.register_forward_pre_hook(lambda module, args: setattr(counts, "calls", counts.calls + 1))
    try:
        hook = HookRegistry.check_if_exists_or_initialize(model.proj_out).get_hook("taylorseer_cache")
        forward = hook.fn_ref.original_forward

        def forward_counted(*args, **kwargs):
            counts.full += 1
            return forward(*args, **kwargs)

        hook.fn_ref.original_forward = forward_counted
        yield counts
    finally:
        handle.remove()
        model.disable_cache()
