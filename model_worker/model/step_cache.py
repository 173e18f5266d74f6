"""Per-image step caches: each running image keeps its own cache state and decides alone whether a step may skip the
denoiser's expensive part (contract/step_cache.py says what the catalog sets).

diffusers' cache hooks keep one state per module: one image's history, so in a running set of images at different
steps of different requests a row would be compared with another request's residual. Here each image's state lives
with the image (`RunningItem.state["step_cache"]`), starts empty (a joining image's first step is full), and goes
with it when it finishes or is cancelled; the cheap part runs for every row, each row decides on its own numbers, the
expensive part runs only over the rows that need it (gathered), and the others take their cached residual. An image
gets the same decisions, and so the same answer, alone and in any running set.

`deepcache` (SD 1.5) reuses the UNet's deep features for `interval - 1` steps after each full one, per image.

`taylorseer` (FLUX.1) runs the whole transformer on an image's full steps, by diffusers' `TaylorSeerCacheConfig`
schedule counted in the image's own steps, and predicts its output in between from its own Taylor factors
(families/taylorseer.py).

`first_block` decides as diffusers' `FirstBlockCacheConfig` does (its `FBCHeadBlockHook`): the relative L1 change
of the first block's residual since the image's last full step, `mean|r - r_last| / mean|r_last|`, skips when at
most `threshold`; the residual compared with is the last full step's (a skipped step does not move it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.step_cache import StepCache, running_step_cache
from model_worker.model.runners import RunningItem

# A test's or a benchmark's decision in place of the threshold's (the GPU check forces the published hit rates):
# (image, step) -> skip. The first step and the warm-up still run in full, and `max_consecutive_skips` still holds.
ForcedPattern = Callable[[RunningItem, int], bool]


@dataclass(eq=False)
class RowCache:
    """One image's step cache: its settings and what its last full step left."""

    settings: StepCache
    # The first block's residual at the image's last full step (what the next step is compared with).
    head_residual: Any = None
    # What the remaining blocks added at that step (the image's hidden states), reused by a skipped step.
    tail_residual: Any = None
    consecutive_skips: int = 0
    # taylorseer: the Taylor factors of the image's output (order 0 first) at its last full step, and that step.
    factors: list | None = None
    last_full: int | None = None

    @property
    def primed(self) -> bool:
        """Whether a full step has left something a skipped step can reuse."""
        return self.tail_residual is not None or self.factors is not None


class TailCalls:
    """Counts the expensive part's calls and the rows they ran (the tests' and the benchmark's view)."""

    def __init__(self) -> None:
        self.calls = 0
        self.rows = 0


def row_cache(catalog: StepCache | None, asked: bool | None, batch_line: bool = False) -> RowCache | None:
    """A new image's cache state: empty, so its first step is full; None when the request runs without one. A batch
    line's decides by the catalog's `batch_threshold` (each row by its own settings, whatever else runs beside it)."""
    settings = running_step_cache(catalog, asked, batch_line)
    return RowCache(settings) if settings is not None else None


def may_skip(r: RunningItem) -> bool:
    """Whether the image's settings and history allow a skip at all this step (before its numbers are looked at)."""
    cache: RowCache | None = r.state.get("step_cache")
    if cache is None or not cache.primed or r.done < cache.settings.warmup_steps:
        return False
    bound = cache.settings.max_consecutive_skips
    return bound is None or cache.consecutive_skips < bound


def first_block_skips(running: list[RunningItem], residuals, forced: ForcedPattern | None = None,
                      rows_per_image: list[int] | None = None) -> list[bool]:  # fmt: skip
    """Each image's decision from its first block's residual (`residuals[i]`: row i's; with `rows_per_image`, image
    i's rows, its guided pair deciding together) against its own last full step's: one device-to-host read for the
    whole set. Threshold 0 never skips (exactly no cache)."""
    import torch

    skips = [False] * len(running)
    candidates = [i for i, r in enumerate(running) if may_skip(r)]
    if forced is not None:
        return [i in candidates and forced(running[i], running[i].done) for i in range(len(running))]
    candidates = [i for i in candidates if running[i].state["step_cache"].settings.threshold > 0]
    if not candidates:
        return skips
    if rows_per_image is not None:  # an image's means over all its rows, as diffusers' hook takes them for one image
        starts = [sum(rows_per_image[:i]) for i in range(len(running))]
        moved, sizes = [], []
        for i in candidates:
            previous = running[i].state["step_cache"].head_residual
            current = residuals[starts[i] : starts[i] + rows_per_image[i]]
            moved.append((current - previous).abs().mean())
            sizes.append(previous.abs().mean())
        changes = (torch.stack(moved) / torch.stack(sizes)).tolist()
        for i, change in zip(candidates, changes, strict=True):
            skips[i] = change <= running[i].state["step_cache"].settings.threshold
        return skips
    previous = torch.cat([running[i].state["step_cache"].head_residual for i in candidates])
    current = residuals[candidates]
    dims = tuple(range(1, previous.ndim))
    changes = ((current - previous).abs().mean(dim=dims) / previous.abs().mean(dim=dims)).tolist()
    for i, change in zip(candidates, changes, strict=True):
        skips[i] = change <= running[i].state["step_cache"].settings.threshold
    return skips


def scheduled_skips(running: list[RunningItem], forced: ForcedPattern | None = None) -> list[bool]:
    """Each image's decision by its own count (DeepCache's): the deep path runs every `interval` steps of the image,
    reused in between. Interval 1 never skips (exactly no cache)."""
    skips = []
    for r in running:
        if not may_skip(r):
            skips.append(False)
        elif forced is not None:
            skips.append(forced(r, r.done))
        else:
            cache: RowCache = r.state["step_cache"]
            skips.append(cache.consecutive_skips + 1 < (cache.settings.interval or 1))
    return skips


def taylor_skips(running: list[RunningItem], forced: ForcedPattern | None = None) -> list[bool]:
    """Each image's decision by its own step (TaylorSeer's schedule, as diffusers' `TaylorSeerCacheHook` counts its
    calls): full for the first `warmup_steps`, then at every `interval`-th step after them, predicted in between.
    Interval 1 never predicts (exactly no cache)."""
    skips = []
    for r in running:
        if not may_skip(r):
            skips.append(False)
        elif forced is not None:
            skips.append(forced(r, r.done))
        else:
            settings = r.state["step_cache"].settings
            skips.append((r.done - settings.warmup_steps - 1) % (settings.interval or 1) != 0)
    return skips


def record_taylor(r: RunningItem, output) -> None:
    """A full step of a TaylorSeer image: its output (one row, float32) becomes its order-0 factor, and each higher
    order the divided difference with the last full step's factor of the order below (diffusers' update)."""
    cache: RowCache | None = r.state.get("step_cache")
    if cache is None:
        return
    factors = [output]
    if cache.factors is not None:
        delta = r.done - cache.last_full
        for previous in cache.factors[: cache.settings.max_order or 1]:
            factors.append((factors[-1] - previous) / delta)
    cache.factors, cache.last_full, cache.consecutive_skips = factors, r.done, 0


def taylor_prediction(r: RunningItem):
    """A skipped step's output for a TaylorSeer image: its Taylor expansion from its last full step (float32)."""
    import math

    cache: RowCache = r.state["step_cache"]
    offset = r.done - cache.last_full
    output = cache.factors[0]
    for order, factor in enumerate(cache.factors[1:], start=1):
        output = output + factor * (offset**order / math.factorial(order))
    return output


def record_full(r: RunningItem, head_residual, tail_residual) -> None:
    """A full step: the image's cache now holds this step's residuals."""
    cache: RowCache | None = r.state.get("step_cache")
    if cache is not None:
        cache.head_residual, cache.tail_residual, cache.consecutive_skips = head_residual, tail_residual, 0


def record_skip(r: RunningItem) -> None:
    cache: RowCache = r.state["step_cache"]
    cache.consecutive_skips += 1
    r.skipped += 1


def caching(running: list[RunningItem]) -> bool:
    """Whether any image of the set runs with a step cache (otherwise the plain model call is made)."""
    return any(r.state.get("step_cache") is not None for r in running)


def forget(running: list[RunningItem]) -> None:
    """After a step that ran in full outside the cache: the next step of each image is full too."""
    for r in running:
        cache: RowCache | None = r.state.get("step_cache")
        if cache is not None:
            cache.head_residual = cache.tail_residual = cache.factors = cache.last_full = None
            cache.consecutive_skips = 0
