"""First-Block-Cache over a running set of FLUX.1 images, each deciding alone (model_worker/model/step_cache.py).

`FluxTransformer2DModel.forward` in three parts, with its own modules and in its own order, so that a set where
every row runs in full gives exactly the model's output: the embeddings and the first block over every row (the
cheap part), the remaining double- and single-stream blocks over the rows that need them (gathered: the expensive
part), and the output norm and projection over every row. A skipping row's hidden states are its first block's
output plus the residual the remaining blocks added at its last full step, as diffusers' `FBCHeadBlockHook` does.

`scheduling: request` runs the pipeline's own call, with diffusers' hook enabled for that call only
(`diffusers_first_block`): one decision per call for all its images, no warm-up and no bound on skips in a row (the
catalog refuses those settings there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from model_worker.model.runners import RunningItem
from model_worker.model.step_cache import ForcedPattern, TailCalls, first_block_skips, record_full, record_skip


def flux_parts(transformer, compile_with: tuple | None = None) -> tuple:
    """The transformer's cheap part (embeddings and first block) and expensive part (the other blocks) as modules over
    its own layers; compiled (`compile_with`: torch.compile's mode and backend, compiled.py) for a compiled model, so
    each runs at the batch buckets the warm-up compiled and a changing count of full rows never recompiles."""
    import torch

    from model_worker.model.compiled import compile_model

    model = getattr(transformer, "_orig_mod", transformer)  # the eager modules under a compiled wrapper

    class FirstBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, hidden_states, timestep, guidance, pooled_projections, encoder_hidden_states, txt_ids,
                    img_ids):  # fmt: skip
            m = self.model
            hidden = m.x_embedder(hidden_states)
            timestep = timestep.to(hidden.dtype) * 1000
            if guidance is not None:
                temb = m.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled_projections)
            else:
                temb = m.time_text_embed(timestep, pooled_projections)
            encoder = m.context_embedder(encoder_hidden_states)
            rotary = m.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
            encoder, first = m.transformer_blocks[0](
                hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, image_rotary_emb=rotary
            )
            return hidden, first, encoder, temb, rotary

    class RemainingBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, hidden, encoder, temb, rotary):
            m = self.model
            for block in [*m.transformer_blocks[1:], *m.single_transformer_blocks]:
                encoder, hidden = block(
                    hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, image_rotary_emb=rotary
                )
            return hidden

    head, tail = FirstBlock(), RemainingBlocks()
    if compile_with is not None:
        head, tail = compile_model(head, *compile_with), compile_model(tail, *compile_with)
    return model, head, tail


def first_block_flux(parts: tuple, running: list[RunningItem], forced: ForcedPattern | None = None,
                     tail_calls: TailCalls | None = None, padded: Callable[[int], int] = lambda rows: rows, *,
                     hidden_states, timestep, guidance, pooled_projections, encoder_hidden_states, txt_ids,
                     img_ids):  # fmt: skip
    """The transformer's prediction for `running`'s rows (the first `len(running)` rows of the inputs; rows beyond
    them pad a compiled batch and are dropped), each image skipping the remaining blocks when its cache says so. The
    full rows are gathered and padded to `padded(count)` rows (a compiled bucket) for the remaining blocks."""
    import torch

    model, head, tail = parts
    rows = len(running)
    hidden, first, encoder, temb, rotary = head(
        hidden_states, timestep, guidance, pooled_projections, encoder_hidden_states, txt_ids, img_ids
    )  # fmt: skip
    hidden, first, encoder, temb = hidden[:rows], first[:rows], encoder[:rows], temb[:rows]
    residual = first - hidden
    skips = first_block_skips(running, residual, forced)
    full = [i for i, skip in enumerate(skips) if not skip]
    if len(full) == rows:
        computed = run_tail(tail, padded, first, encoder, temb, rotary, tail_calls)
        for i in full:  # copies: a row's cache must not keep the whole set's tensors alive
            record_full(running[i], residual[i : i + 1].clone(), (computed - first)[i : i + 1].clone())
        return model.proj_out(model.norm_out(computed, temb))
    out = first.clone()
    if full:
        index = torch.tensor(full, device=first.device)
        start = first[index]
        computed = run_tail(tail, padded, start, encoder[index], temb[index], rotary, tail_calls)
        out[index] = computed
        for slot, i in enumerate(full):
            record_full(running[i], residual[i : i + 1].clone(), (computed[slot : slot + 1] - start[slot : slot + 1]))
    for i, skip in enumerate(skips):
        if skip:
            out[i : i + 1] = first[i : i + 1] + running[i].state["step_cache"].tail_residual
            record_skip(running[i])
    return model.proj_out(model.norm_out(out, temb))


def run_tail(tail, padded: Callable[[int], int], hidden, encoder, temb, rotary, tail_calls: TailCalls | None):
    """The remaining blocks (the expensive part) over the rows that need them, padded to `padded(rows)` rows and
    the padding dropped: their hidden states."""
    from model_worker.model.families.base import pad_rows

    rows = hidden.shape[0]
    size = padded(rows)
    if size != rows:
        hidden, encoder, temb = pad_rows(hidden, size), pad_rows(encoder, size), pad_rows(temb, size)
    computed = tail(hidden, encoder, temb, rotary)[:rows]
    if tail_calls is not None:
        tail_calls.calls += 1
        tail_calls.rows += rows
    return computed


class HookCounts:
    """`scheduling: request`'s count of one pipeline call's steps: how many ran the first block, how many the rest."""

    def __init__(self) -> None:
        self.head = 0
        self.tail = 0

    @property
    def skipped(self) -> int:
        """Steps the whole call skipped (diffusers' hook decides once per call: every image of it skipped them)."""
        return self.head - self.tail


@contextmanager
def diffusers_first_block(transformer, threshold: float) -> Iterator[HookCounts]:
    """diffusers' own First-Block-Cache hook (`enable_cache`) on `transformer` for one pipeline call: enabled fresh,
    so no call compares with another's residual (the hooks keep one state per module, never reset by the pipeline),
    and removed after it. Counts the calls of the first and of the last block's own forward. FluxPipeline names its
    calls' cache context itself; its image-to-image, Kontext and Fill pipelines do not, so it is set for them here
    (the hooks refuse to run without one)."""
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    model = getattr(transformer, "_orig_mod", transformer)
    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(model, CacheContext("cond"))
    counts = HookCounts()
    try:
        head, *_, last = [*model.transformer_blocks, *model.single_transformer_blocks]
        for block, name, attribute in ((head, "fbc_leader_block_hook", "head"), (last, "fbc_block_hook", "tail")):
            hook = HookRegistry.check_if_exists_or_initialize(block).get_hook(name)
            hook.fn_ref.original_forward = counted(hook.fn_ref.original_forward, counts, attribute)
        yield counts
    finally:
        model.disable_cache()


def counted(forward, counts: HookCounts, attribute: str):
    def forward_counted(*args, **kwargs):
        setattr(counts, attribute, getattr(counts, attribute) + 1)
        return forward(*args, **kwargs)

    return forward_counted


def sd3_parts(transformer, compile_with: tuple | None = None) -> tuple:
    """SD 3.5's transformer (`SD3Transformer2DModel.forward`) in its parts over its own layers (the eager modules
    under a compiled wrapper): the cheap part (patch and time/text embeddings, the first joint block) and the
    expensive part (the other blocks) as modules, compiled (`compile_with`: torch.compile's mode and backend) for a
    compiled model, as FLUX.1's are (`flux_parts`); the output layers, eager (a norm and a projection)."""
    import torch

    from model_worker.model.compiled import compile_model

    model = getattr(transformer, "_orig_mod", transformer)

    class FirstBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, sample, timestep, context, pooled):
            m = self.model
            hidden = m.pos_embed(sample).contiguous()
            temb = m.time_text_embed(timestep, pooled)
            encoder = m.context_embedder(context)
            encoder, first = m.transformer_blocks[0](
                hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, joint_attention_kwargs=None
            )
            return hidden, first, encoder, temb

    class RemainingBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, hidden, encoder, temb):
            for block in self.model.transformer_blocks[1:]:
                encoder, hidden = block(
                    hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, joint_attention_kwargs=None
                )
            return hidden

    def out(hidden, temb, height: int, width: int):
        hidden = model.proj_out(model.norm_out(hidden, temb))
        patch, channels = model.config.patch_size, model.out_channels
        height, width = height // patch, width // patch
        hidden = hidden.reshape(shape=(hidden.shape[0], height, width, patch, patch, channels))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(shape=(hidden.shape[0], channels, height * patch, width * patch))

    head, tail = FirstBlock(), RemainingBlocks()
    if compile_with is not None:
        head, tail = compile_model(head, *compile_with), compile_model(tail, *compile_with)
    return model, head, tail, out


def first_block_sd3(parts: tuple, running: list[RunningItem], rows_per_image: list[int],
                    forced: ForcedPattern | None = None, tail_calls: TailCalls | None = None,
                    padded: Callable[[int], int] = lambda rows: rows, *, sample, timestep, context,
                    pooled):  # fmt: skip
    """SD 3.5's prediction for the images' rows (the first `sum(rows_per_image)` rows; rows beyond pad a compiled
    batch and are dropped), each image skipping the remaining blocks when its cache says so. A guided image's two rows
    (negative, positive) decide together, as one image alone in diffusers' hook does (its means over both rows). The
    cheap part runs over the call's rows as given (a compiled bucket's), the full rows are gathered and padded to
    `padded(count)` rows (a compiled bucket) for the remaining blocks."""
    import torch

    model, head, tail, out = parts
    rows = sum(rows_per_image)
    height, width = sample.shape[-2:]

    def sd3_tail(hidden, encoder, temb, _rotary):  # run_tail's FLUX.1 signature: SD 3.5's blocks take no rotary
        return tail(hidden, encoder, temb)

    hidden, first, encoder, temb = head(sample, timestep, context, pooled)
    # A one-block transformer's first block is its last (context_pre_only): no text stream after it, nothing behind
    # it to skip (the tiny models the GPU check builds).
    hidden, first, temb = hidden[:rows], first[:rows], temb[:rows]
    encoder = encoder[:rows] if encoder is not None else None
    residual = first - hidden
    skips = first_block_skips(running, residual, forced, rows_per_image)
    starts = [sum(rows_per_image[:i]) for i in range(len(running))]
    spans = [slice(start, start + width_) for start, width_ in zip(starts, rows_per_image, strict=True)]
    full_rows = [row for i, skip in enumerate(skips) if not skip for row in range(spans[i].start, spans[i].stop)]
    if len(full_rows) == rows:
        computed = run_tail(sd3_tail, padded, first, encoder, temb, None, tail_calls)
        for i, span in enumerate(spans):  # copies: an image's cache must not keep the whole set's tensors alive
            record_full(running[i], residual[span].clone(), (computed[span] - first[span]).clone())
        return out(computed, temb, height, width)
    hidden_out = first.clone()
    if full_rows:
        index = torch.tensor(full_rows, device=first.device)
        encoder_rows = encoder[index] if encoder is not None else None
        hidden_out[index] = run_tail(sd3_tail, padded, first[index], encoder_rows, temb[index], None, tail_calls)
    for i, span in enumerate(spans):
        if skips[i]:
            hidden_out[span] = first[span] + running[i].state["step_cache"].tail_residual
            record_skip(running[i])
        else:
            record_full(running[i], residual[span].clone(), (hidden_out[span] - first[span]).clone())
    return out(hidden_out, temb, height, width)


@contextmanager
def diffusers_first_block_sd3(transformer, threshold: float) -> Iterator[HookCounts]:
    """diffusers' First-Block-Cache hooks (`apply_first_block_cache`) on SD 3.5's transformer for one pipeline call.
    The transformer has no `enable_cache` (not a `CacheMixin`) and its pipeline sets no cache context, so the context
    is set here; its last block gives no text stream back (`context_pre_only`), which the hook's tail residual needs,
    so for the call it gives back the text stream it was given (the model reads none after its last block)."""
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    model = getattr(transformer, "_orig_mod", transformer)
    head, *_, last = model.transformer_blocks
    forward = last.forward

    def forward_keeping_text(*args, **kwargs):
        encoder, hidden = forward(*args, **kwargs)
        return (kwargs["encoder_hidden_states"] if encoder is None else encoder), hidden

    last.forward = forward_keeping_text
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(model, CacheContext("cond"))
    counts = HookCounts()
    registry = HookRegistry.check_if_exists_or_initialize(model)
    try:
        for block, name, attribute in ((head, "fbc_leader_block_hook", "head"), (last, "fbc_block_hook", "tail")):
            hook = HookRegistry.check_if_exists_or_initialize(block).get_hook(name)
            hook.fn_ref.original_forward = counted(hook.fn_ref.original_forward, counts, attribute)
        yield counts
    finally:
        _set_cache_context(model, None)
        registry.remove_hook("fbc_leader_block_hook", recurse=True)
        registry.remove_hook("fbc_block_hook", recurse=True)
        del last.forward  # the block's own forward again
