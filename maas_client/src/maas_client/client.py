"""The synchronous client: `Client(url, api_key)`, or MAAS_URL / MAAS_API_KEY."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from maas_client import _core
from maas_client.errors import NotFound, ServerError, Timeout
from maas_client.types import JobAccepted, JobList, JobStatus, JobView, ModelInfo, ModelList, Result, Usage

ProgressCallback = Callable[[int, int], None]
POLL_SECONDS = 0.5


class Client:
    """The API over HTTP; `predict`, `submit`, `models`, `usage`. Use as a context manager, or `close()`."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = _core.DEFAULT_TIMEOUT,
        max_retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url, options = _core.http_options(url, api_key, timeout)
        self.retry = _core.RetryPolicy(max_retries=max_retries)
        self._http = httpx.Client(transport=transport, **options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(
        self, method: str, path: str, *, safe: bool, headers: dict | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One call with the retry policy; a non-2xx answer raises its typed error."""
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if (delay := self.retry.delay(attempt, safe=safe, error=exc)) is None:
                    raise _core.transport_error(exc, self.url) from None
            else:
                if (delay := self.retry.delay(attempt, safe=safe, response=response)) is None:
                    _core.raise_for_answer(response)
                    return response
            time.sleep(delay)
            attempt += 1

    def models(self) -> list[ModelInfo]:
        return ModelList.model_validate(self.request("GET", "/v1/models", safe=True).json()).models

    def model(self, name: str) -> ModelInfo:
        return ModelInfo.model_validate(self.request("GET", f"/v1/models/{name}", safe=True).json())

    def predict(
        self, model: str, prompt: str, *, idempotency_key: str | None = None, on_progress=None, **options: Any
    ) -> Result:
        """Generates images and waits for them; a request that turns into a job (202) is followed to its end.

        Options: n, seed, steps, size ("512x512"), image (PIL image, path or bytes), negative_prompt,
        guidance_scale, strength, priority, adapters ({"tiny-ink": 0.8}: LoRA adapters and their scales)."""
        body = _core.predict_body(prompt, **options)
        headers = {"Idempotency-Key": idempotency_key or _core.new_idempotency_key()}
        response = self.request("POST", f"/v1/models/{model}:predict", safe=True, json=body, headers=headers)
        if response.status_code == 202:
            return self.job(JobAccepted.model_validate(response.json()).id).wait(on_progress=on_progress)
        return _core.result_from_predict(response)

    def submit(self, model: str, prompt: str, *, idempotency_key: str | None = None, **options: Any) -> Job:
        """Queues a job and returns at once."""
        body = _core.predict_body(prompt, **options)
        headers = {"Idempotency-Key": idempotency_key or _core.new_idempotency_key()}
        response = self.request("POST", f"/v1/models/{model}/jobs", safe=True, json=body, headers=headers)
        data = response.json()
        if response.status_code == 200:  # answered from the cache: a finished result, no job to follow
            return Job(self, data["request_id"], done=_core.result_from_predict(response))
        return Job(self, JobAccepted.model_validate(data).id)

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def jobs(self, *, limit: int = 20, state: JobStatus | None = None, cursor: str | None = None) -> JobList:
        """One page of your jobs, newest first (`next_cursor` reads the next); `state` filters."""
        params = _core.job_list_params(limit, state, cursor)
        return JobList.model_validate(self.request("GET", "/v1/jobs", safe=True, params=params).json())

    def list_jobs(self, *, state: JobStatus | None = None, limit: int | None = None) -> Iterator[JobView]:
        """All your jobs (or the newest `limit`), newest first, page after page."""
        cursor, seen = None, 0
        while True:
            page = self.jobs(limit=_core.page_size(limit, seen), state=state, cursor=cursor)
            for view in page.jobs:
                yield view
                seen += 1
                if limit is not None and seen >= limit:
                    return
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def raw(self, method: str, path: str, *, headers: dict | None = None, **kwargs: Any) -> httpx.Response:
        """One HTTP call as it is: no retry, no error raised for a 4xx/5xx (status, headers, body and all).
        The escape hatch for benchmarks and fault tests that must see exactly what the API answered."""
        return self._http.request(method, path, headers=headers, **kwargs)

    def usage(self, since: str = "7d") -> Usage:
        return Usage.model_validate(self.request("GET", "/v1/usage", safe=True, params={"since": since}).json())


class Job:
    """A submitted job: `status()`, `wait(on_progress=...)`, `cancel()`, `events()`."""

    def __init__(self, client: Client, job_id: str, done: Result | None = None) -> None:
        self.client = client
        self.id = job_id
        self._done = done

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobView:
        return JobView.model_validate(self.client.request("GET", f"/v1/jobs/{self.id}", safe=True).json())

    def cancel(self) -> JobView:
        return JobView.model_validate(self.client.request("DELETE", f"/v1/jobs/{self.id}", safe=True).json())

    def events(self, last_event_id: str | None = None) -> Iterator[JobView]:
        """The job's views from its event stream, reconnecting after a dropped connection, until it ends."""
        parser = _core.EventParser()
        parser.last_id = last_event_id
        failures = 0
        while True:
            headers = {"Last-Event-ID": parser.last_id} if parser.last_id else {}
            try:
                with self.client._http.stream("GET", f"/v1/jobs/{self.id}/events", headers=headers) as response:
                    if response.status_code == 204:
                        return
                    if response.status_code >= 400:
                        response.read()
                        _core.raise_for_answer(response)
                    for line in response.iter_lines():
                        event = parser.feed(line)
                        if event is None:
                            continue
                        failures = 0
                        yield JobView.model_validate(event.json())
                        if event.id == "end":
                            return
            except httpx.TransportError as exc:
                if (delay := self.client.retry.delay(failures, safe=True, error=exc)) is None:
                    raise _core.transport_error(exc, self.client.url) from None
                failures += 1
                time.sleep(delay)

    def wait(self, on_progress: ProgressCallback | None = None, timeout: float | None = None) -> Result:
        """Follows the job to its end over the event stream (polling if the stream is unavailable) and
        returns its result; a failed, expired or cancelled job raises its typed error."""
        if self._done is not None:
            return self._done
        gate = _core.ProgressGate(on_progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobView | None = None
        try:
            for view in self.events():
                gate.update(view)
                last = view
                if view.finished or (deadline is not None and time.monotonic() > deadline):
                    break
        except (NotFound, ServerError) as exc:  # no stream here (an older server) or it failed: poll
            if isinstance(exc, NotFound) and not self._exists():
                raise
        while last is None or not last.finished:
            if deadline is not None and time.monotonic() > deadline:
                raise Timeout(f"job {self.id} still {last.status if last else 'unknown'} after {timeout}s")
            if last is not None:
                time.sleep(POLL_SECONDS)
            last = self.status()
            gate.update(last)
        return _core.result_from_job(last)

    def _exists(self) -> bool:
        try:
            self.status()
        except NotFound:
            return False
        return True
