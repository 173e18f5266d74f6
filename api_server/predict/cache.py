"""The predict result cache: a seeded request is deterministic, so its whole response is kept under a key
made from the model, its version, the canonical parameters and the digests of the prompts and input images.

Memory is bounded three ways: a TTL on every entry, no entry above `MAAS_CACHE_MAX_ENTRY_BYTES`, and the
Redis instance's own cap (`maxmemory` with `maxmemory-policy allkeys-lru` on a cache-only instance named
by `MAAS_CACHE_REDIS_URL`; see the README).
"""

from __future__ import annotations

import hashlib
import json

from api_server.predict.flights import FlightPolicy, ResponseRecord
from contract.messages import GenerationParameters
from contract.model_spec import ModelSpec
from contract.step_cache import running_step_cache

CACHE_KEY_VERSION = "v1"


def cache_key(
    spec: ModelSpec,
    params: GenerationParameters,
    prompts: list[str],
    images: list[bytes | None],
    masks: list[bytes | None] | None = None,
) -> str:
    """`maas:cache:v1:{model}:{version}:{sha256}` of the canonical request; equal requests, equal keys. An inpaint
    request's mask digests are part of it (other requests' keys are as before masks existed), and so is the model's
    step cache when it runs (its threshold changes the image)."""
    instances = [
        {"prompt": prompt, "image_sha256": hashlib.sha256(image).hexdigest() if image is not None else None}
        for prompt, image in zip(prompts, images, strict=True)
    ]
    for instance, mask in zip(instances, masks or [], strict=False):
        if mask is not None:
            instance["mask_sha256"] = hashlib.sha256(mask).hexdigest()
    # The request's `step_cache` counts as what it runs with (below): turned off, a key is a cache-less model's.
    canonical = {"parameters": params.model_dump(mode="json", exclude={"step_cache"}), "instances": instances}
    if (step_cache := running_step_cache(spec.step_cache, params.step_cache)) is not None:
        canonical["step_cache"] = step_cache.cache_key_part()  # a model without one keeps its keys as before
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"maas:cache:{CACHE_KEY_VERSION}:{spec.name}:{spec.version}:{digest}"


def cache_policy(spec: ModelSpec, ttl_seconds: int, max_entry_bytes: int) -> FlightPolicy:
    """Keeps successes that fit; failures reach only the identical requests already waiting for them."""

    def keep_for(record: ResponseRecord) -> int | None:
        return ttl_seconds if record.status == 200 and len(record.body) <= max_entry_bytes else None

    return FlightPolicy(
        keep_for=keep_for,
        lease_seconds=spec.request_timeout_seconds + 10,
        wait_seconds=spec.request_timeout_seconds + 5,
    )
