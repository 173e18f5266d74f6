"""Pub/Sub admin operations against the project quota: counted per request, turned into a sustainable rate.

The counts come from `bench.counted_api`, which the benchmark's API process runs instead of
`api_server.process.wsgi`: it wraps the Google clients' admin methods and counts every call in Redis.
"""

from __future__ import annotations

# Pub/Sub's administrator-operations quota per project; it cannot be raised.
ADMIN_OPS_PER_MINUTE = 6000
COUNTER_PREFIX = "bench:pubsub-admin:"


def read_counts(client) -> dict[str, int]:
    """Admin operations counted so far, by method (a redis.Redis client on the stack's Redis)."""
    keys = sorted(key.decode() for key in client.scan_iter(f"{COUNTER_PREFIX}*"))
    values = client.mget(keys) if keys else []
    return {key[len(COUNTER_PREFIX) :]: int(value or 0) for key, value in zip(keys, values, strict=True)}


def difference(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}


# Below this many admin operations per request, the operations counted are the process's own start-up
# (per-instance mode creates its subscription once), not a cost that grows with traffic.
PER_REQUEST_THRESHOLD = 0.05


def sustainable_rps(ops_per_request: float) -> float | None:
    """Requests/s one project sustains under the admin quota; None when requests make no admin calls of their own."""
    if ops_per_request < PER_REQUEST_THRESHOLD:
        return None
    return ADMIN_OPS_PER_MINUTE / 60 / ops_per_request
