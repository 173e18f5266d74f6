"""Replies and progress kept in Redis by request id, so a missed notification or a redelivery is answered without rerunning the model."""

from __future__ import annotations

import time

import redis

from contract import naming
from contract.messages import InferenceReply, Progress


class ResultStore:
    """Thin typed access to the worker's Redis keys; callers decide what a Redis failure means."""

    def __init__(self, client: redis.Redis, ttl_seconds: int) -> None:
        self._redis = client
        self._ttl = ttl_seconds

    def put(self, reply: InferenceReply, keep_until_ms: int | None = None) -> bool:
        """Stores the request's first answer; False when one was already stored (by a worker the request was
        re-dispatched to, or the watchdog's `expired`): that one stands, so a request has one answer.
        `keep_until_ms`: a batch line's answer is kept until then at least (its batch's end: the collector may come
        later than the usual TTL), and the usual TTL past it."""
        ttl = self._ttl
        if keep_until_ms:
            ttl = max(ttl, int(keep_until_ms / 1000 - time.time()) + self._ttl)
        return bool(self._redis.set(naming.result_key(reply.request_id), reply.model_dump_json(), ex=ttl, nx=True))

    def collected(self, request_ids: list[str]) -> None:
        """Answers taken by their batch's collector go back to the usual TTL (long enough for a redelivery)."""
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.expire(naming.result_key(request_id), self._ttl, lt=True)
        pipe.execute()

    def get(self, request_id: str) -> InferenceReply | None:
        raw = self._redis.get(naming.result_key(request_id))
        return InferenceReply.model_validate_json(raw) if raw else None

    def note_failure(self, request_id: str, cause: str) -> int:
        """Counts a failed run handed back for a retry and keeps its cause; the runs failed so far."""
        key = naming.failure_key(request_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hincrby(key, "count", 1)
        pipe.hset(key, "cause", cause[:512])
        pipe.expire(key, self._ttl)
        return int(pipe.execute()[0])

    def failure_cause(self, request_id: str) -> str | None:
        raw = self._redis.hget(naming.failure_key(request_id), "cause")
        return raw.decode() if raw else None

    def put_progress(self, progress: list[Progress]) -> None:
        """One round trip for a whole batch's progress."""
        pipe = self._redis.pipeline(transaction=False)
        for item in progress:
            pipe.set(naming.progress_key(item.request_id), item.model_dump_json(), ex=self._ttl)
        pipe.execute()

    def get_progress(self, request_id: str) -> Progress | None:
        raw = self._redis.get(naming.progress_key(request_id))
        return Progress.model_validate_json(raw) if raw else None

    def cancelled(self, request_ids: list[str]) -> set[str]:
        """The ids among `request_ids` that the API marked cancelled."""
        if not request_ids:
            return set()
        flags = self._redis.mget([naming.cancel_key(request_id) for request_id in request_ids])
        return {request_id for request_id, flag in zip(request_ids, flags, strict=True) if flag}

    def cancel(self, request_id: str) -> None:
        self._redis.set(naming.cancel_key(request_id), "1", ex=self._ttl)
