"""DeepCache over a running set of SD 1.5 or SDXL images, each deciding alone (model_worker/model/step_cache.py).

`UNet2DConditionModel.forward` in three parts, with its own modules and in its own order, so that a set where every
image runs in full gives exactly the model's output: the time embedding, `conv_in` and the first down block over
every row (the shallow part), the other down blocks, the mid block and every up block but the last over the rows of
the images that run the deep path this step (gathered: the expensive part), and the last up block and the output
convolutions over every row. An image that reuses its deep features takes those its last full step computed (the
last up block's input), as DeepCache does; it runs the deep path every `interval` steps of its own, or, by
`threshold`, when its shallow features (the first down block's output) moved more than that (relative L1, its
guided rows together) since its last full step, as First-Block-Cache decides on its first block's residual.
"""

from __future__ import annotations

from collections.abc import Callable

from model_worker.model.runners import RunningItem
from model_worker.model.step_cache import (
    ForcedPattern,
    TailCalls,
    first_block_skips,
    record_full,
    record_skip,
    scheduled_skips,
)


def unet_parts(unet, compile_with: tuple | None = None) -> tuple:
    """The UNet's three parts as modules over its own layers (the eager modules under a compiled wrapper): the
    shallow part (embeddings, `conv_in`, the first down block), the deep path, and the last up block with the output
    convolutions; compiled (`compile_with`: torch.compile's mode and backend) for a compiled model, as FLUX.1's
    first-block parts are, so each runs at the batch buckets the warm-up compiled."""
    import torch

    from model_worker.model.compiled import compile_model

    model = getattr(unet, "_orig_mod", unet)

    class Shallow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, sample, timestep, context, added_cond_kwargs):
            m = self.model
            emb = m.time_embedding(m.get_time_embed(sample=sample, timestep=timestep), None)
            aug = m.get_aug_embed(emb=emb, encoder_hidden_states=context, added_cond_kwargs=added_cond_kwargs)
            emb = emb + aug if aug is not None else emb
            if m.time_embed_act is not None:
                emb = m.time_embed_act(emb)
            context = m.process_encoder_hidden_states(
                encoder_hidden_states=context, added_cond_kwargs=added_cond_kwargs
            )
            hidden = m.conv_in(sample)
            shallow = (hidden,)
            hidden, res = down(m.down_blocks[0], hidden, emb, context)
            return hidden, emb, context, shallow + res

    class Deep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, hidden, emb, context, res_samples: tuple, upsample: bool):
            return deep_path(self.model, hidden, emb, context, res_samples, upsample)

    class Out(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, features, emb, context, kept: tuple):
            m = self.model
            out = up(m.up_blocks[-1], features, emb, context, kept, None)
            if m.conv_norm_out:
                out = m.conv_act(m.conv_norm_out(out))
            return m.conv_out(out)

    parts = Shallow(), Deep(), Out()
    if compile_with is not None:
        parts = tuple(compile_model(part, *compile_with) for part in parts)
    return (model, *parts)


def deep_cache_unet(parts: tuple, running: list[RunningItem], rows_per_image: list[int], forced: ForcedPattern | None,
                    tail_calls: TailCalls | None, sample, timestep, encoder_hidden_states,
                    added_cond_kwargs: dict | None = None, padded: Callable[[int], int] = lambda rows: rows):  # fmt: skip
    """The UNet's prediction for the call's rows (`unet_parts`' parts; the images' rows are the first
    `sum(rows_per_image)`, rows beyond pad a compiled batch), an image reusing its deep features where its cache says
    so. The shallow part and the output run over the call's rows as given (a compiled bucket's); the deep path over
    the rows of the images that need it, gathered and padded to `padded(count)` rows (a compiled bucket), the padding
    dropped. `added_cond_kwargs`: SDXL's pooled text embeddings and size conditioning, as the UNet takes them."""
    import torch

    model, shallow_part, deep_part, out_part = parts
    rows, size = sum(rows_per_image), sample.shape[0]
    hidden, emb, context, shallow = shallow_part(sample, timestep, encoder_hidden_states, added_cond_kwargs)
    last_up = model.up_blocks[-1]
    kept, deep_res = shallow[: len(last_up.resnets)], shallow[len(last_up.resnets) :]
    by_threshold = running_by_threshold(running)
    if by_threshold:
        skips = first_block_skips(running, hidden[:rows], forced, rows_per_image)
    else:
        skips = scheduled_skips(running, forced)
    full = [i for i, skip in enumerate(skips) if not skip]
    starts = [sum(rows_per_image[:i]) for i in range(len(running))]
    full_rows = [row for i in full for row in range(starts[i], starts[i] + rows_per_image[i])]
    upsample = any(dim % 2**model.num_upsamplers for dim in sample.shape[-2:])
    if len(full_rows) == rows:  # every row, the padding's too: the call's own bucket
        features = deep_part(hidden, emb, context, deep_res, upsample)
        count_rows(tail_calls, rows)
    else:
        features = None
        if full_rows:
            index = torch.tensor(full_rows, device=hidden.device)
            gathered = gather_rows(index, padded(len(full_rows)))
            computed = deep_part(gathered(hidden), gathered(emb), gathered(context),
                                 tuple(gathered(r) for r in deep_res), upsample)[: len(full_rows)]  # fmt: skip
            count_rows(tail_calls, len(full_rows))
            features = computed.new_zeros((size, *computed.shape[1:]))
            features[index] = computed
        else:
            template = running[skips.index(True)].state["step_cache"].tail_residual
            features = template.new_zeros((size, *template.shape[1:]))
    for i, r in enumerate(running):
        span = slice(starts[i], starts[i] + rows_per_image[i])
        if skips[i]:
            features[span] = r.state["step_cache"].tail_residual
            record_skip(r)
        else:
            record_full(r, hidden[span].clone() if by_threshold else None, features[span].clone())
    # One layout whichever rows ran the deep path (a compiled UNet's output is channels-last, a gathered set's
    # buffer not): a compiled part is specialised to its inputs' strides.
    return out_part(features.contiguous(), emb, context, kept)


def gather_rows(index, rows: int) -> Callable:
    """Gathers a tensor's `index` rows and pads them to `rows`, in the layout the tensor had (channels-last stays so),
    each tensor once: a tensor passed twice (the first down block's output is also its last skip) is one gathered
    tensor passed twice, as the full call passes it (a compiled part is specialised to its inputs' aliasing too)."""
    import torch

    from model_worker.model.families.base import pad_rows

    done: dict[int, object] = {}

    def gathered(tensor):
        if id(tensor) not in done:
            rows_of = pad_rows(tensor[index], rows)
            channels_last = tensor.ndim == 4 and not tensor.is_contiguous()
            if channels_last and tensor.is_contiguous(memory_format=torch.channels_last):
                rows_of = rows_of.contiguous(memory_format=torch.channels_last)
            else:
                rows_of = rows_of.contiguous()
            done[id(tensor)] = rows_of
        return done[id(tensor)]

    return gathered


def count_rows(tail_calls: TailCalls | None, rows: int) -> None:
    if tail_calls is not None:
        tail_calls.calls += 1
        tail_calls.rows += rows


def running_by_threshold(running: list[RunningItem]) -> bool:
    """Whether the set's cached images decide by threshold (the model's catalog says one way for all its images)."""
    caches = [r.state["step_cache"] for r in running if r.state.get("step_cache") is not None]
    return bool(caches) and caches[0].settings.interval is None


def deep_path(model, hidden, emb, context, res_samples: tuple, upsample: bool):
    """The other down blocks, the mid block and every up block but the last, as the model's forward runs them."""
    res = res_samples
    for block in model.down_blocks[1:]:
        hidden, block_res = down(block, hidden, emb, context)
        res += block_res
    if model.mid_block is not None:
        if getattr(model.mid_block, "has_cross_attention", False):
            hidden = model.mid_block(hidden, emb, encoder_hidden_states=context)
        else:
            hidden = model.mid_block(hidden, emb)
    for block in model.up_blocks[:-1]:
        block_res, res = res[-len(block.resnets) :], res[: -len(block.resnets)]
        upsample_size = res[-1].shape[2:] if upsample else None  # an input size the up blocks cannot halve evenly
        hidden = up(block, hidden, emb, context, block_res, upsample_size)
    return hidden


def down(block, hidden, emb, context):
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=hidden, temb=emb, encoder_hidden_states=context)
    return block(hidden_states=hidden, temb=emb)


def up(block, hidden, emb, context, res_samples, upsample_size):
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=hidden, temb=emb, res_hidden_states_tuple=res_samples,
                     encoder_hidden_states=context, upsample_size=upsample_size)  # fmt: skip
    return block(hidden_states=hidden, temb=emb, res_hidden_states_tuple=res_samples, upsample_size=upsample_size)
