"""Replies kept in Redis by request id, so a missed notification or a redelivery is answered without rerunning the model."""

from __future__ import annotations

import redis

from contract.messages import InferenceReply, result_key


class ResultStore:
    def __init__(self, client: redis.Redis, ttl_seconds: int) -> None:
        self._redis = client
        self._ttl = ttl_seconds

    def put(self, reply: InferenceReply) -> None:
        self._redis.set(result_key(reply.request_id), reply.model_dump_json(), ex=self._ttl)

    def get(self, request_id: str) -> InferenceReply | None:
        raw = self._redis.get(result_key(request_id))
        return InferenceReply.model_validate_json(raw) if raw else None
