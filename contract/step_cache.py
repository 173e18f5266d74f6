"""A model's step cache (the catalog's `step_cache:`): which denoising work an image may skip when it barely changes.

`first_block` (FLUX.1; ParaAttention's First-Block-Cache, diffusers' `FirstBlockCacheConfig`): the transformer's
first block runs for every image at every step; when its residual moved less than `threshold` (relative L1, as
diffusers measures it) since the image's last full step, the image reuses the residual the other blocks added then.
Every image keeps its own history and decides alone (model_worker/model/step_cache.py), so its answer is the same
alone and in any running set.

`deepcache` (SD 1.5, SDXL; DeepCache, Ma et al. 2023): the UNet's deep path (every down block but the first, the
mid block, every up block but the last) runs every `interval` steps of an image, and its output is reused in
between; the shallow path runs every step. Interval 1 never skips. Or by `threshold` (instead of `interval`): the
deep path runs when the first down block's output moved more than that (relative L1, as first_block measures) since
the image's last full step; threshold 0 never skips. `scheduling: step` only (diffusers has no UNet hook).

`taylorseer` (FLUX.1; TaylorSeer, Liu et al. 2025, diffusers' `TaylorSeerCacheConfig` in its lite mode): the whole
transformer runs on an image's first `warmup_steps` steps and then every `interval` steps (diffusers' schedule:
`cache_interval`, `disable_cache_before_step`); in between, the image's output is predicted by a Taylor expansion
(to `max_order`) of the outputs of its last full steps, divided differences by step. Interval 1 never predicts.

Off unless the catalog entry has the block; a request may turn it off
(`"step_cache": false`), never on.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StepCacheKind = Literal["first_block", "taylorseer", "deepcache"]
# first_block's threshold unless the catalog sets one: ParaAttention's published setting for FLUX.1 [dev].
DEFAULT_THRESHOLD = 0.08


class StepCache(BaseModel):
    """The catalog's step cache for one model. `threshold` 0 never skips: the images are those of no cache."""

    model_config = ConfigDict(extra="forbid")
    kind: StepCacheKind
    # first_block: a step is skipped when the first block's residual moved at most this much (mean |r - r_last| over
    # mean |r_last|, r_last the image's at its last full step) since. ParaAttention published 0.08 for FLUX.1 [dev].
    threshold: float = Field(default=DEFAULT_THRESHOLD, ge=0.0, le=1.0)
    # deepcache: the deep path runs every this many steps of an image (1: every step, exactly no cache). DeepCache's
    # paper reports about 2.3x on SD 1.5 (its `cache_interval` is this). taylorseer: the transformer runs every this
    # many steps after the warm-up (diffusers' `cache_interval`, default 5), predicted in between.
    interval: int | None = Field(default=None, ge=1, le=50)
    # taylorseer: the Taylor expansion's order (diffusers' `max_order`, default 1: the last full output plus its
    # slope). Absent from the cache key of the other kinds (they have none).
    max_order: int | None = Field(default=None, ge=1, le=4, exclude_if=lambda order: order is None)
    # The first steps of each image always run in full (the layout forms there); 0: only the first step.
    warmup_steps: int = Field(default=0, ge=0)
    # At most this many skipped steps in a row (then a full step refreshes the cache); None: no bound (diffusers').
    max_consecutive_skips: int | None = Field(default=None, ge=1)
    # A more aggressive threshold for batch lines (POST /v1/batches); None: the interactive one.
    batch_threshold: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _kind_settings(self) -> StepCache:
        # A threshold is "given" when it is not the default: an entry dumped and validated again (a worker's
        # scheduling override, model_worker/serving/service.py) carries every field, the default threshold too.
        threshold_given = self.threshold != DEFAULT_THRESHOLD or self.batch_threshold is not None
        if self.kind == "deepcache":
            if self.interval is None and "threshold" not in self.model_fields_set:
                raise ValueError("step_cache: deepcache runs the deep path every `interval` steps or when its "
                                 "shallow features moved more than `threshold`: set interval or threshold")  # fmt: skip
            if self.interval is not None and threshold_given:
                raise ValueError("step_cache: deepcache decides by interval or by threshold, one of them; by interval "
                                 "it has no threshold (nor batch_threshold for batch lines to raise)")  # fmt: skip
        if self.kind == "first_block" and self.interval is not None:
            raise ValueError("step_cache: first_block decides by threshold; interval is deepcache's")
        if self.kind == "taylorseer":
            if self.interval is None or threshold_given:
                raise ValueError("step_cache: taylorseer runs the transformer every `interval` steps after its "
                                 "warm-up: set interval (and warmup_steps), not threshold")  # fmt: skip
            if self.warmup_steps < 1:
                raise ValueError("step_cache: taylorseer predicts from earlier full steps: warmup_steps must be at "
                                 "least 1 (diffusers' disable_cache_before_step, default 3)")  # fmt: skip
        elif self.max_order is not None:
            raise ValueError("step_cache: max_order is taylorseer's (the order of its prediction)")
        return self

    @model_validator(mode="after")
    def _batch_not_stricter(self) -> StepCache:
        if self.batch_threshold is not None and self.batch_threshold < self.threshold:
            raise ValueError(
                f"step_cache: batch_threshold {self.batch_threshold:g} is below threshold {self.threshold:g} "
                "(batch lines may trade more quality for time than interactive requests, not less)"
            )
        return self

    @property
    def per_row_only(self) -> bool:
        """Settings only the worker's own per-image cache honours (`scheduling: step`), not diffusers' hook (whose
        TaylorSeer has a warm-up: `disable_cache_before_step`)."""
        warmup = self.warmup_steps > 0 and self.kind != "taylorseer"
        return self.kind == "deepcache" or warmup or self.max_consecutive_skips is not None

    def cache_key_part(self) -> dict:
        """What of it changes an image: part of the result cache key (api_server/predict/cache.py)."""
        return self.model_dump(mode="json")


def running_step_cache(catalog: StepCache | None, asked: bool | None, batch_line: bool = False) -> StepCache | None:
    """The step cache a request runs with: its model's (`catalog`), unless the request turned it off (`asked` False);
    a batch line's decides by the catalog's `batch_threshold` where it has one."""
    if catalog is None or asked is False:
        return None
    if batch_line and catalog.batch_threshold is not None:
        return catalog.model_copy(update={"threshold": catalog.batch_threshold})
    return catalog
