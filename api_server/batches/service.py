"""What the batch routes do: submit (checked at once: input, window, webhook, metadata), read, list, cancel, and
read the results and errors files back. The work itself is the runner's (`runner.py`)."""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator

import redis

from api_server.batches.inputs import BatchInputPolicy
from api_server.batches.runner import BatchRunner
from api_server.batches.store import ENDED, Batch, BatchStore, view
from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.core.redis_state import RedisState
from api_server.jobs.webhooks import WebhookTargetPolicy
from contract import naming

DEFAULT_WINDOW = "24h"
WINDOW = re.compile(r"(\d{1,6})([smh])")
MIN_WINDOW_SECONDS, MAX_WINDOW_SECONDS = 5, naming.BATCH_MAX_WINDOW_SECONDS
MAX_METADATA_KEYS, MAX_METADATA_VALUE = 16, 512
BODY_FIELDS = ("input_file", "requests", "input_table", "completion_window", "webhook_url", "metadata")
BATCH_ID = re.compile(r"batch-[0-9a-f]{20}")


def window_seconds(value: object) -> int:
    """`24h` (the default), `30m`, `90s`: from 5 s to 7 days; a bad one is a 422 naming the field."""
    match = WINDOW.fullmatch(value) if isinstance(value, str) else None
    seconds = int(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]] if match else 0
    if not MIN_WINDOW_SECONDS <= seconds <= MAX_WINDOW_SECONDS:
        raise ApiError(
            422, "completion_window: a duration such as 24h, 30m or 90s, from 5s to 168h", "completion_window"
        )
    return seconds


class BatchService:
    def __init__(
        self,
        store: BatchStore,
        redis_state: RedisState,
        inputs: BatchInputPolicy,
        webhook_targets: WebhookTargetPolicy,
        inline_max_lines: int,
        runner: BatchRunner | None = None,
        max_active_per_key: int = 10,
    ) -> None:
        self._store = store
        self._redis = redis_state
        self._inputs = inputs
        self._targets = webhook_targets
        self._inline_max_lines = inline_max_lines
        self._runner = runner
        self._max_active = max_active_per_key

    def submit(self, body: object, caller: Caller) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object (Content-Type: application/json)")
        unknown = sorted(set(body) - set(BODY_FIELDS))
        if unknown:
            raise ApiError(422, f"{unknown[0]}: unknown field; expected {', '.join(BODY_FIELDS)}", unknown[0])
        sources = [name for name in ("input_file", "requests", "input_table") if name in body]
        if len(sources) != 1:
            message = (
                "input_file: give one of input_file (gs:// JSONL), requests (inline lines), input_table "
                "(bq://project.dataset.table)"
            )
            raise ApiError(422, message, "input_file")
        window = body.get("completion_window", DEFAULT_WINDOW)
        seconds = window_seconds(window)
        webhook = body.get("webhook_url")
        if webhook is not None:
            if not isinstance(webhook, str):
                raise ApiError(422, "webhook_url: an https:// URL", "webhook_url")
            self._targets.check(webhook)
        metadata = self._metadata(body.get("metadata", {}))
        if self._stored(lambda: self._store.active_count(caller.key_id)) >= self._max_active:
            raise self._at_cap()  # before writing inline lines; `create` checks again, atomically
        batch_id = f"batch-{uuid.uuid4().hex[:20]}"
        now_ms = int(time.time() * 1000)
        snapshot = {}
        if "requests" in body:
            input_file = self._inline(batch_id, body["requests"])
        elif "input_table" in body:
            input_file = self._inputs.check_table(body["input_table"], caller)  # the record's input: a bq:// URI
            # What the batch reads: the table as it is now (rows added or changed later are not the batch's).
            snapshot["input_snapshot"] = self._inputs.snapshot(input_file, batch_id, now_ms + seconds * 1000)
        else:
            input_file = self._inputs.check(body["input_file"], caller)
        fields = {
            "owner": caller.key_id,
            "digest": caller.digest,
            "status": "validating",
            "created_ms": now_ms,
            "expires_ms": now_ms + seconds * 1000,
            "input_file": input_file,
            "completion_window": window,
            "metadata": json.dumps(metadata),
            "cursor_offset": 0,
            "cursor_line": 0,
            **snapshot,
            **({"webhook_url": webhook} if webhook else {}),
        }
        batch = self._stored(lambda: self._store.create(batch_id, fields, self._max_active))
        if batch is None:
            if "requests" in body:  # the inline lines written for a batch that is not created
                with contextlib.suppress(Exception):
                    self._store.bucket.blob(self._store.object_name(batch_id, "input.jsonl")).delete()
            raise self._at_cap()
        if self._runner is not None:
            self._runner.wake()
        return view(batch, self._store)

    def _at_cap(self) -> ApiError:
        return ApiError(
            429,
            f"this key has {self._max_active} batches not yet ended, its cap (MAAS_BATCH_MAX_ACTIVE_PER_KEY); "
            "submit again once one has ended, or cancel one",
            headers={"Retry-After": "60"},
        )

    @staticmethod
    def _metadata(metadata: object) -> dict[str, str]:
        if (
            not isinstance(metadata, dict)
            or len(metadata) > MAX_METADATA_KEYS
            or not all(
                isinstance(key, str) and isinstance(value, str) and len(key) <= 64 and len(value) <= MAX_METADATA_VALUE
                for key, value in metadata.items()
            )
        ):
            message = (
                f"metadata: at most {MAX_METADATA_KEYS} string keys (64 characters) and values ({MAX_METADATA_VALUE})"
            )
            raise ApiError(422, message, "metadata")
        return metadata

    def _inline(self, batch_id: str, requests: object) -> str:
        """Inline lines are written as the batch's own input file, then read like any other."""
        if not isinstance(requests, list) or not 1 <= len(requests) <= self._inline_max_lines:
            message = f"requests: a list of 1 to {self._inline_max_lines} lines (larger batches: input_file)"
            raise ApiError(422, message, "requests")
        name = self._store.object_name(batch_id, "input.jsonl")
        text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in requests)
        self._store.bucket.blob(name).upload_from_string(text, content_type="application/jsonl")
        return f"gs://{self._store.bucket.name}/{name}"

    def get(self, batch_id: str, caller: Caller) -> Batch:
        """The caller's batch, or a 404 (another key's batch is as absent as one that never existed)."""
        batch = self._stored(lambda: self._store.get(batch_id, caller.key_id)) if BATCH_ID.fullmatch(batch_id) else None
        if batch is None:
            raise ApiError(404, f"no batch {batch_id[:64]!r}")
        return batch

    def view(self, batch: Batch) -> dict:
        return view(batch, self._store)

    def list(self, caller: Caller, limit: int, before_ms: int | None) -> list[dict]:
        batches = self._stored(lambda: self._store.list_for(caller.key_id, limit, before_ms))
        return [view(batch, self._store) for batch in batches]

    def cancel(self, batch: Batch) -> dict:
        """Stops feeding; lines in flight are answered cancelled; what finished stays. 409 once it has ended or a
        cancel was accepted already (the status says `cancelling` from then on, never going back)."""
        if batch.status in ENDED or batch.status == "cancelling":
            raise ApiError(409, f"batch {batch.batch_id} is {batch.status} already")
        if not self._stored(lambda: self._store.request_cancel(batch.batch_id)):
            raise ApiError(409, f"batch {batch.batch_id} has ended already")
        if self._runner is not None:
            self._runner.wake()
        return view(self._stored(lambda: self._store.get(batch.batch_id)), self._store)  # type: ignore[arg-type]

    def output(self, batch: Batch, kind: str) -> Iterator[bytes]:
        """The results or errors part files so far, in order, as one JSONL stream."""
        prefix = self._store.object_name(batch.batch_id, f"{kind}/")
        for blob in sorted(self._store.bucket.list_blobs(prefix=prefix), key=lambda blob: blob.name):
            yield blob.download_as_bytes()

    def _stored(self, action):
        try:
            return action()
        except redis.RedisError as exc:
            self._redis.failed(exc)
            raise ApiError(503, "batch store unavailable, retry later", headers={"Retry-After": "5"}) from exc
