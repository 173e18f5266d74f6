"""Splits each request's time into consecutive stages from the client's clock and the response's `timings_ms`.

The API reports `subscribe`, `publish`, `wait`, `cleanup` and `total` (its own clocks) and the worker's
`queue` (publish of the request object to the start of its pipeline call) and `inference` (the pipeline
call). `queue` starts when the API builds the request, before it subscribes, so the time the request spent
in Pub/Sub and the worker's pool is `queue - subscribe - publish`. Consecutive stages, summing to the
client's latency:

    http        client latency - API total (connection, request and response transfer, gunicorn)
    api         API total - subscribe - publish - wait - cleanup (auth, validation, JSON, PNG base64)
    subscribe   reply subscription created (per-request mode) or registered (per-instance mode)
    publish     request published, future resolved
    to worker   Pub/Sub delivery, the worker's pull, its pool, until the pipeline call starts
    inference   the pipeline call (shared by every request in the batch)
    reply       PNG encode, result store, reply publish, delivery to the waiting API request
    cleanup     reply subscription deleted (per-request mode)
"""

from __future__ import annotations

STAGES = ("http", "api", "subscribe", "publish", "to worker", "inference", "reply", "cleanup")


def stages(client_ms: float, timings: dict[str, float]) -> dict[str, float]:
    """The consecutive stages of one request; small negative remainders (clock jitter) clamp to zero."""
    subscribe = timings.get("subscribe", 0.0)
    publish = timings.get("publish", 0.0)
    wait = timings.get("wait", 0.0)
    cleanup = timings.get("cleanup", 0.0)
    total = timings.get("total", client_ms)
    inference = timings.get("inference", 0.0)
    to_worker = max(0.0, timings.get("queue", 0.0) - subscribe - publish)
    return {
        "http": max(0.0, client_ms - total),
        "api": max(0.0, total - subscribe - publish - wait - cleanup),
        "subscribe": subscribe,
        "publish": publish,
        "to worker": min(to_worker, wait),
        "inference": inference,
        "reply": max(0.0, wait - to_worker - inference),
        "cleanup": cleanup,
    }


def median_stages(rows: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """The median of each stage over (client_ms, timings) rows: where the typical request's time goes."""
    from bench.loadgen import percentile

    split = [stages(client_ms, timings) for client_ms, timings in rows if timings]
    return {stage: round(percentile([s[stage] for s in split], 0.5), 2) for stage in STAGES} if split else {}
