"""The synchronous client: `Client(url, api_key)`, or MAAS_URL / MAAS_API_KEY."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from maas_client import _core
from maas_client.batches import Batches
from maas_client.errors import NotFound, ServerError, Timeout
from maas_client.types import JobAccepted, JobList, JobStatus, JobView, ModelDetail, ModelInfo, ModelList, Result, Usage

# `on_progress(step, total)`, or `on_progress(step, total, stage)` to also get a flow's running stage by name.
ProgressCallback = Callable[[int, int], None] | Callable[[int, int, str | None], None]
POLL_SECONDS = 0.5


class Client:
    """The API over HTTP; `predict`, `submit`, `models`, `usage`. Use as a context manager, or `close()`."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = _core.DEFAULT_TIMEOUT,
        retry_deadline: float | None = None,
        max_retries: int | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`retry_deadline`: seconds a safe call keeps retrying (connection failures, 429, 503) before it raises
        (default: `MAAS_RETRY_DEADLINE`, else 60);
        `max_retries`: also stop after that many retries (0: never retry)."""
        self.url, options = _core.http_options(url, api_key, timeout)
        self.retry = _core.RetryPolicy(
            deadline_seconds=_core.retry_deadline_from_env(retry_deadline), max_retries=max_retries
        )
        self._http = httpx.Client(transport=transport, **options)
        self.batches = Batches(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        safe: bool,
        headers: dict | None = None,
        retry_deadline: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One call with the retry policy, retried for up to `retry_deadline` seconds (default: the client's);
        a non-2xx answer raises its typed error."""
        retries = self.retry.start(retry_deadline)
        while True:
            try:
                response = self._http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if (delay := retries.next_delay(safe=safe, error=exc)) is None:
                    raise _core.transport_error(exc, self.url) from None
            else:
                if (delay := retries.next_delay(safe=safe, response=response)) is None:
                    _core.raise_for_answer(response)
                    return response
            time.sleep(delay)

    def models(self) -> list[ModelInfo]:
        return ModelList.model_validate(self.request("GET", "/v1/models", safe=True).json()).models

    def model(self, name: str) -> ModelDetail:
        return ModelDetail.model_validate(self.request("GET", f"/v1/models/{name}", safe=True).json())

    def predict(
        self,
        model: str,
        prompt: str,
        *,
        idempotency_key: str | None = None,
        on_progress: ProgressCallback | None = None,
        retry_deadline: float | None = None,
        **options: Any,
    ) -> Result:
        """Generates images and waits for them; a request that turns into a job (202) is followed to its end.
        With `on_progress(step, total)` the request is a job from the start (`Prefer: respond-async`),
        followed over its event stream, so progress is reported from the first step.

        Options: n, seed, steps, size ("512x512"), image (PIL image, path or bytes; an edit model edits it as the
        prompt says), mask (the same; an inpaint model's: white repaints), outpaint ({"left": 64, ...}: an inpaint
        model extends the image), negative_prompt, guidance_scale, strength, priority, adapters ({"tiny-ink": 0.8}:
        LoRA adapters and their scales)."""
        body = _core.predict_body(prompt, **options)
        headers = _core.inference_headers(idempotency_key, as_job=on_progress is not None)
        response = self.request(
            "POST", f"/v1/models/{model}:predict", safe=True, json=body, headers=headers, retry_deadline=retry_deadline
        )
        if response.status_code == 202:
            return self.job(JobAccepted.model_validate(response.json()).id).wait(on_progress=on_progress)
        return _core.result_from_predict(response)

    def submit(
        self,
        model: str,
        prompt: str,
        *,
        idempotency_key: str | None = None,
        retry_deadline: float | None = None,
        **options: Any,
    ) -> Job:
        """Queues a job and returns at once."""
        body = _core.predict_body(prompt, **options)
        headers = _core.inference_headers(idempotency_key)
        response = self.request(
            "POST", f"/v1/models/{model}/jobs", safe=True, json=body, headers=headers, retry_deadline=retry_deadline
        )
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

    def status(self, *, deadline: float | None = None) -> JobView:
        """The job now; `deadline` (a `time.monotonic()` moment) bounds retries and the read, for `wait`."""
        options = _core.within(deadline, self.client._http.timeout)
        return JobView.model_validate(self.client.request("GET", f"/v1/jobs/{self.id}", safe=True, **options).json())

    def cancel(self) -> JobView:
        return JobView.model_validate(self.client.request("DELETE", f"/v1/jobs/{self.id}", safe=True).json())

    def events(self, last_event_id: str | None = None) -> Iterator[JobView]:
        """The job's views from its event stream, reconnecting after a dropped connection, until it ends."""
        return self._follow(last_event_id, None)

    def _follow(self, last_event_id: str | None, deadline: float | None) -> Iterator[JobView]:
        """The event stream's views; a silent stream or a lost connection stops them at `deadline` (a
        `time.monotonic()` moment; None: never), a lost one is reconnected within the client's retry deadline."""
        parser = _core.EventParser()
        parser.last_id = last_event_id
        retries: _core.Retries | None = None  # this outage's, from its first failure
        while _core.seconds_left(deadline) > 0:
            headers = {"Last-Event-ID": parser.last_id} if parser.last_id else {}
            timeout = _core.timeout_within(self.client._http.timeout, deadline)
            try:
                with self.client._http.stream(
                    "GET", f"/v1/jobs/{self.id}/events", headers=headers, timeout=timeout
                ) as response:
                    if response.status_code == 204:
                        return
                    if response.status_code >= 400:
                        response.read()
                        _core.raise_for_answer(response)
                    for line in response.iter_lines():
                        if (event := parser.feed(line)) is not None:
                            retries = None
                            yield JobView.model_validate(event.json())
                            if event.id == "end":
                                return
                        if _core.seconds_left(deadline) == 0:
                            return
            except httpx.TransportError as exc:
                if _core.seconds_left(deadline) == 0:
                    return  # the read ran out at the caller's deadline
                retries = retries or self.client.retry.start()
                if (delay := retries.next_delay(safe=True, error=exc)) is None:
                    raise _core.transport_error(exc, self.client.url) from None
                time.sleep(min(delay, _core.seconds_left(deadline)))

    def wait(self, on_progress: ProgressCallback | None = None, timeout: float | None = None) -> Result:
        """Follows the job to its end over the event stream (polling if the stream is unavailable) and
        returns its result; a failed, expired or cancelled job raises its typed error. With `timeout`
        (seconds), raises `Timeout` once it has passed, whether or not the stream says anything."""
        if self._done is not None:
            return self._done
        gate = _core.ProgressGate(on_progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobView | None = None
        try:
            for view in self._follow(None, deadline):
                gate.update(view)
                last = view
                if view.finished:
                    break
        except (NotFound, ServerError) as exc:  # no stream here (an older server) or it failed: poll
            if isinstance(exc, NotFound) and not self._exists():
                raise
        while last is None or not last.finished:
            if last is not None:
                time.sleep(min(POLL_SECONDS, _core.seconds_left(deadline)))
            if _core.seconds_left(deadline) == 0:
                raise Timeout(f"job {self.id} still {last.status if last else 'unknown'} after {timeout}s")
            last = self.status(deadline=deadline)
            gate.update(last)
        return _core.result_from_job(last)

    def _exists(self) -> bool:
        try:
            self.status()
        except NotFound:
            return False
        return True
