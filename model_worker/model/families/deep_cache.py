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

from model_worker.model.runners import RunningItem
from model_worker.model.step_cache import (
    ForcedPattern,
    TailCalls,
    first_block_skips,
    record_full,
    record_skip,
    scheduled_skips,
)


def deep_cache_unet(unet, running: list[RunningItem], rows_per_image: list[int], forced: ForcedPattern | None,
                    tail_calls: TailCalls | None, sample, timestep, encoder_hidden_states,
                    added_cond_kwargs: dict | None = None):  # fmt: skip
    """The UNet's prediction for the images' rows (the first `sum(rows_per_image)` rows; rows beyond pad a compiled
    batch and are dropped), an image reusing its deep features where its cache says so. `added_cond_kwargs`: SDXL's
    pooled text embeddings and size conditioning, as the UNet takes them."""
    import torch

    model = getattr(unet, "_orig_mod", unet)  # the eager modules under a compiled wrapper
    rows = sum(rows_per_image)
    sample, timestep, context = sample[:rows], timestep[:rows], encoder_hidden_states[:rows]
    if added_cond_kwargs is not None:
        added_cond_kwargs = {key: value[:rows] for key, value in added_cond_kwargs.items()}
    emb = model.time_embedding(model.get_time_embed(sample=sample, timestep=timestep), None)
    aug = model.get_aug_embed(emb=emb, encoder_hidden_states=context, added_cond_kwargs=added_cond_kwargs)
    emb = emb + aug if aug is not None else emb
    if model.time_embed_act is not None:
        emb = model.time_embed_act(emb)
    context = model.process_encoder_hidden_states(encoder_hidden_states=context, added_cond_kwargs=added_cond_kwargs)
    hidden = model.conv_in(sample)
    shallow = (hidden,)
    hidden, res = down(model.down_blocks[0], hidden, emb, context)
    shallow += res
    last_up = model.up_blocks[-1]
    kept, deep_res = shallow[: len(last_up.resnets)], shallow[len(last_up.resnets) :]
    by_threshold = running_by_threshold(running)
    if by_threshold:
        skips = first_block_skips(running, hidden, forced, rows_per_image)
    else:
        skips = scheduled_skips(running, forced)
    full = [i for i, skip in enumerate(skips) if not skip]
    starts = [sum(rows_per_image[:i]) for i in range(len(running))]
    full_rows = [row for i in full for row in range(starts[i], starts[i] + rows_per_image[i])]
    upsample = any(dim % 2**model.num_upsamplers for dim in sample.shape[-2:])
    if len(full_rows) == rows:
        features = deep_path(model, hidden, emb, context, deep_res, upsample, tail_calls)
    else:
        computed = None
        if full_rows:
            index = torch.tensor(full_rows, device=hidden.device)
            computed = deep_path(
                model, hidden[index], emb[index], context[index], tuple(r[index] for r in deep_res), upsample,
                tail_calls,
            )  # fmt: skip
        template = computed if computed is not None else running[skips.index(True)].state["step_cache"].tail_residual
        features = hidden.new_empty((rows, *template.shape[1:]))
        if computed is not None:
            features[index] = computed
    for i, r in enumerate(running):
        span = slice(starts[i], starts[i] + rows_per_image[i])
        if skips[i]:
            features[span] = r.state["step_cache"].tail_residual
            record_skip(r)
        else:
            record_full(r, hidden[span].clone() if by_threshold else None, features[span].clone())
    out = up(last_up, features, emb, context, kept, None)
    if model.conv_norm_out:
        out = model.conv_act(model.conv_norm_out(out))
    return model.conv_out(out)


def running_by_threshold(running: list[RunningItem]) -> bool:
    """Whether the set's cached images decide by threshold (the model's catalog says one way for all its images)."""
    caches = [r.state["step_cache"] for r in running if r.state.get("step_cache") is not None]
    return bool(caches) and caches[0].settings.interval is None


def deep_path(model, hidden, emb, context, res_samples: tuple, upsample: bool, tail_calls: TailCalls | None):
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
    if tail_calls is not None:
        tail_calls.calls += 1
        tail_calls.rows += hidden.shape[0]
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
