"""`client.batches`: batch jobs (a JSONL file of requests run at batch priority; results and errors files)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import httpx

from maas_client import _core
from maas_client.errors import Timeout
from maas_client.types import BatchList, BatchView

BatchProgress = Callable[[BatchView], None]
POLL_SECONDS = 1.0


class _Requester(Protocol):
    """What batches need of the client: one authenticated, retried request (`Client.request`)."""

    def request(self, method: str, path: str, *, safe: bool, **kwargs: Any) -> httpx.Response: ...


class Batches:
    """create, get, list, cancel, wait; results and errors read the output files back line by line."""

    def __init__(self, client: _Requester) -> None:
        self._client = client

    def create(
        self,
        *,
        input_file: str | None = None,
        requests: Iterable[dict] | None = None,
        input_table: str | None = None,
        completion_window: str = "24h",
        webhook_url: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> BatchView:
        """A batch from a `gs://` JSONL file, from `requests` inline (each `{"custom_id", "model", "instances",
        "parameters"}`; the server caps how many: larger batches go through a file), or from a BigQuery table
        (`input_table`, `bq://project.dataset.table`: each row a line, its columns those fields)."""
        body: dict[str, Any] = {"completion_window": completion_window, "metadata": metadata or {}}
        if input_file is not None:
            body["input_file"] = input_file
        if requests is not None:
            body["requests"] = list(requests)
        if input_table is not None:
            body["input_table"] = input_table
        if webhook_url is not None:
            body["webhook_url"] = webhook_url
        # Not retried on its own: a retried POST could submit the batch twice.
        response = self._client.request("POST", "/v1/batches", safe=False, json=body)
        return BatchView.model_validate(response.json())

    def get(self, batch_id: str) -> BatchView:
        return BatchView.model_validate(self._client.request("GET", f"/v1/batches/{batch_id}", safe=True).json())

    def list(self, *, limit: int | None = None) -> Iterator[BatchView]:
        """Your batches (or the newest `limit`), newest first, page after page."""
        before, seen = None, 0
        while True:
            params: dict[str, Any] = {"limit": _core.page_size(limit, seen)}
            if before is not None:
                params["before"] = before
            page = BatchList.model_validate(self._client.request("GET", "/v1/batches", safe=True, params=params).json())
            for view in page.batches:
                yield view
                seen += 1
                if limit is not None and seen >= limit:
                    return
            if page.next_before is None:
                return
            before = page.next_before

    def cancel(self, batch_id: str) -> BatchView:
        """Stops the batch: lines in flight are answered cancelled, what finished stays."""
        return BatchView.model_validate(self._client.request("DELETE", f"/v1/batches/{batch_id}", safe=True).json())

    def wait(self, batch_id: str, on_progress: BatchProgress | None = None, timeout: float | None = None) -> BatchView:
        """Polls until the batch ends (completed, failed, cancelled or expired) and returns it; `on_progress(view)`
        after each poll. With `timeout` (seconds), raises `Timeout` once it has passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = self.get(batch_id)
            if on_progress is not None:
                on_progress(view)
            if view.ended:
                return view
            if _core.seconds_left(deadline) == 0:
                raise Timeout(f"batch {batch_id} still {view.status} after {timeout}s")
            time.sleep(min(POLL_SECONDS, _core.seconds_left(deadline)))

    def results(self, batch_id: str) -> list[dict]:
        """The results file so far: one line per succeeded custom_id (status, image URIs, seed, timings)."""
        return self._lines(batch_id, "results")

    def errors(self, batch_id: str) -> list[dict]:
        """The errors file so far: one line per failed, cancelled or expired custom_id (code, message)."""
        return self._lines(batch_id, "errors")

    def _lines(self, batch_id: str, kind: str) -> list[dict]:
        response = self._client.request("GET", f"/v1/batches/{batch_id}/{kind}", safe=True)
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]
