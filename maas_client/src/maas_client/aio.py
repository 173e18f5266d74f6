"""The asyncio client: the same surface as `Client`, every call awaited."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from maas_client import _core
from maas_client.client import POLL_SECONDS, ProgressCallback
from maas_client.errors import NotFound, ServerError, Timeout
from maas_client.types import JobAccepted, JobList, JobStatus, JobView, ModelDetail, ModelInfo, ModelList, Result, Usage


class AsyncClient:
    """`async with AsyncClient() as maas: await maas.predict(...)`."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = _core.DEFAULT_TIMEOUT,
        retry_deadline: float | None = None,
        max_retries: int | None = None,
        max_connections: int = 100,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url, options = _core.http_options(url, api_key, timeout)
        self.retry = _core.RetryPolicy(
            deadline_seconds=_core.retry_deadline_from_env(retry_deadline), max_retries=max_retries
        )
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max_connections), transport=transport, **options
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        safe: bool,
        headers: dict | None = None,
        retry_deadline: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        retries = self.retry.start(retry_deadline)
        while True:
            try:
                response = await self._http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if (delay := retries.next_delay(safe=safe, error=exc)) is None:
                    raise _core.transport_error(exc, self.url) from None
            else:
                if (delay := retries.next_delay(safe=safe, response=response)) is None:
                    _core.raise_for_answer(response)
                    return response
            await asyncio.sleep(delay)

    async def models(self) -> list[ModelInfo]:
        return ModelList.model_validate((await self.request("GET", "/v1/models", safe=True)).json()).models

    async def model(self, name: str) -> ModelDetail:
        return ModelDetail.model_validate((await self.request("GET", f"/v1/models/{name}", safe=True)).json())

    async def predict(
        self,
        model: str,
        prompt: str,
        *,
        idempotency_key: str | None = None,
        on_progress: ProgressCallback | None = None,
        retry_deadline: float | None = None,
        **options: Any,
    ) -> Result:
        body = _core.predict_body(prompt, **options)
        headers = _core.inference_headers(idempotency_key, as_job=on_progress is not None)
        response = await self.request(
            "POST", f"/v1/models/{model}:predict", safe=True, json=body, headers=headers, retry_deadline=retry_deadline
        )
        if response.status_code == 202:
            job = self.job(JobAccepted.model_validate(response.json()).id)
            return await job.wait(on_progress=on_progress)
        return _core.result_from_predict(response)

    async def submit(
        self,
        model: str,
        prompt: str,
        *,
        idempotency_key: str | None = None,
        retry_deadline: float | None = None,
        **options: Any,
    ) -> AsyncJob:
        body = _core.predict_body(prompt, **options)
        headers = _core.inference_headers(idempotency_key)
        response = await self.request(
            "POST", f"/v1/models/{model}/jobs", safe=True, json=body, headers=headers, retry_deadline=retry_deadline
        )
        data = response.json()
        if response.status_code == 200:
            return AsyncJob(self, data["request_id"], done=_core.result_from_predict(response))
        return AsyncJob(self, JobAccepted.model_validate(data).id)

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def jobs(self, *, limit: int = 20, state: JobStatus | None = None, cursor: str | None = None) -> JobList:
        params = _core.job_list_params(limit, state, cursor)
        return JobList.model_validate((await self.request("GET", "/v1/jobs", safe=True, params=params)).json())

    async def list_jobs(self, *, state: JobStatus | None = None, limit: int | None = None) -> AsyncIterator[JobView]:
        cursor, seen = None, 0
        while True:
            page = await self.jobs(limit=_core.page_size(limit, seen), state=state, cursor=cursor)
            for view in page.jobs:
                yield view
                seen += 1
                if limit is not None and seen >= limit:
                    return
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def raw(self, method: str, path: str, *, headers: dict | None = None, **kwargs: Any) -> httpx.Response:
        """One HTTP call as it is: no retry, no error raised (see `Client.raw`)."""
        return await self._http.request(method, path, headers=headers, **kwargs)

    async def usage(self, since: str = "7d") -> Usage:
        response = await self.request("GET", "/v1/usage", safe=True, params={"since": since})
        return Usage.model_validate(response.json())


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str, done: Result | None = None) -> None:
        self.client = client
        self.id = job_id
        self._done = done

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def status(self, *, deadline: float | None = None) -> JobView:
        options = _core.within(deadline, self.client._http.timeout)
        response = await self.client.request("GET", f"/v1/jobs/{self.id}", safe=True, **options)
        return JobView.model_validate(response.json())

    async def cancel(self) -> JobView:
        response = await self.client.request("DELETE", f"/v1/jobs/{self.id}", safe=True)
        return JobView.model_validate(response.json())

    def events(self, last_event_id: str | None = None) -> AsyncIterator[JobView]:
        return self._follow(last_event_id, None)

    async def _follow(self, last_event_id: str | None, deadline: float | None) -> AsyncGenerator[JobView]:
        """As `Job._follow`: views until the end, or until `deadline` however silent the stream is."""
        parser = _core.EventParser()
        parser.last_id = last_event_id
        retries: _core.Retries | None = None
        while _core.seconds_left(deadline) > 0:
            headers = {"Last-Event-ID": parser.last_id} if parser.last_id else {}
            timeout = _core.timeout_within(self.client._http.timeout, deadline)
            try:
                async with self.client._http.stream(
                    "GET", f"/v1/jobs/{self.id}/events", headers=headers, timeout=timeout
                ) as response:
                    if response.status_code == 204:
                        return
                    if response.status_code >= 400:
                        await response.aread()
                        _core.raise_for_answer(response)
                    async for line in response.aiter_lines():
                        if (event := parser.feed(line)) is not None:
                            retries = None
                            yield JobView.model_validate(event.json())
                            if event.id == "end":
                                return
                        if _core.seconds_left(deadline) == 0:
                            return
            except httpx.TransportError as exc:
                if _core.seconds_left(deadline) == 0:
                    return
                retries = retries or self.client.retry.start()
                if (delay := retries.next_delay(safe=True, error=exc)) is None:
                    raise _core.transport_error(exc, self.client.url) from None
                await asyncio.sleep(min(delay, _core.seconds_left(deadline)))

    async def wait(self, on_progress: ProgressCallback | None = None, timeout: float | None = None) -> Result:
        if self._done is not None:
            return self._done
        gate = _core.ProgressGate(on_progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobView | None = None
        try:
            async with contextlib.aclosing(self._follow(None, deadline)) as views:  # closes the stream on break
                async for view in views:
                    gate.update(view)
                    last = view
                    if view.finished:
                        break
        except (NotFound, ServerError) as exc:
            if isinstance(exc, NotFound) and not await self._exists():
                raise
        while last is None or not last.finished:
            if last is not None:
                await asyncio.sleep(min(POLL_SECONDS, _core.seconds_left(deadline)))
            if _core.seconds_left(deadline) == 0:
                raise Timeout(f"job {self.id} still {last.status if last else 'unknown'} after {timeout}s")
            last = await self.status(deadline=deadline)
            gate.update(last)
        return _core.result_from_job(last)

    async def _exists(self) -> bool:
        try:
            await self.status()
        except NotFound:
            return False
        return True
