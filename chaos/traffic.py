"""Closed-loop client traffic that records, for every request, whether and how it was answered in time."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from maas_client import Client as MaasClient
from maas_client import MaasError

# Statuses the docs document (docs/guides/requests.md); anything else (or no answer) is a failure.
DOCUMENTED = {200, 202, 400, 401, 403, 404, 409, 413, 422, 429, 500, 503, 504}
# How long past a request's deadline an answer still counts (the suite's promise: deadline + 10 s).
GRACE_SECONDS = 10.0
JOB_TERMINAL = {"succeeded", "failed", "cancelled", "expired"}


@dataclass
class Outcome:
    """One client request: when it was sent, its deadline, and the answer if one came."""

    model: str
    sent_at: float
    deadline_seconds: float
    status: int | None = None
    request_id: str | None = None
    answered_at: float | None = None
    error: str | None = None
    job_status: str | None = None
    tags: set[str] = field(default_factory=set)
    # The client's own name for the request (its prompt): the only handle on one that got no request id.
    reference: str = ""
    job_id: str | None = None

    @property
    def kind(self) -> str:
        """How the request was served: `event stream`, `job` (a 202, followed to its end) or `sync`."""
        if "stream" in self.tags:
            return "event stream"
        return "job" if self.status == 202 else "sync"

    @property
    def answered(self) -> bool:
        return self.status is not None and self.answered_at is not None

    @property
    def on_time(self) -> bool:
        return self.answered and self.answered_at - self.sent_at <= self.deadline_seconds + GRACE_SECONDS

    @property
    def documented(self) -> bool:
        return self.status in DOCUMENTED


def predict_body(prompt: str, seed: int | None = None, **parameters) -> dict:
    params = dict(parameters)
    if seed is not None:
        params["seed"] = seed
    return {"instances": [{"prompt": prompt}], "parameters": params}


class Client:
    """Sends one predict and follows a 202 to its job's end; retries refused connections until the deadline,
    as a load balancer would while an instance restarts. The SDK underneath (`Client.raw`: every status as it
    came, no retry of its own: the deadline is this client's)."""

    def __init__(self, api_url: str, headers: dict[str, str]) -> None:
        self.api_url = api_url
        self.headers = {**headers, "Cache-Control": "no-cache"}
        self._key = headers.get("Authorization", "").removeprefix("Bearer ").strip() or "none"
        self._sdk = self._new_sdk_client()

    def _new_sdk_client(self) -> MaasClient:
        return MaasClient(self.api_url, self._key, timeout=httpx.Timeout(60.0, connect=5.0), max_retries=0)

    def predict(
        self, model: str, body: dict, deadline_seconds: float, tags: set[str] | None = None, cancel_job: bool = False
    ) -> Outcome:
        """`cancel_job`: a client that gives up: when its request becomes a job (202), it cancels the job."""
        outcome = Outcome(model=model, sent_at=time.time(), deadline_seconds=deadline_seconds, tags=tags or set())
        outcome.reference = str((body.get("instances") or [{}])[0].get("prompt", ""))
        limit = outcome.sent_at + deadline_seconds + GRACE_SECONDS
        while time.time() < limit:
            try:
                response = self._sdk.raw(
                    "POST", f"/v1/models/{model}:predict", json=body, headers=self.headers,
                    timeout=max(1.0, limit - time.time()),
                )  # fmt: skip
            except httpx.TimeoutException as exc:
                outcome.error = "read timed out" if isinstance(exc, httpx.ReadTimeout) else "timed out"
                return outcome
            except httpx.TransportError as exc:
                outcome.error = f"connection: {type(exc).__name__}"
                self._sdk.close()
                self._sdk = self._new_sdk_client()
                time.sleep(0.2)
                continue
            outcome.status, outcome.answered_at = response.status_code, time.time()
            outcome.request_id = response.headers.get("X-Request-Id")
            outcome.error = None if response.is_success else response.text[:200]
            if response.status_code == 202:
                outcome.job_id = response.json().get("id") or response.headers.get("Location", "").rsplit("/", 1)[-1]
                job = self._sdk.job(outcome.job_id)
                if cancel_job:
                    with contextlib.suppress(MaasError):
                        job.cancel()
                self._follow_job(outcome, job, time.time() + deadline_seconds + GRACE_SECONDS)
            return outcome
        return outcome

    def _follow_job(self, outcome: Outcome, job, limit: float) -> None:
        """A sync request that outlived its wait became a job: its answer is the job's end."""
        while time.time() < limit:
            try:
                view = job.status()
            except MaasError:
                time.sleep(0.5)
                continue
            if view.status in JOB_TERMINAL:
                outcome.job_status, outcome.answered_at, outcome.error = view.status, time.time(), None
                return
            outcome.error = f"job still {view.status}"  # what a failed run's evidence reports if it never ends
            time.sleep(0.5)
        outcome.answered_at = None  # the job did not end in time: unanswered


class Traffic:
    """`concurrency` threads, each sending one request after another until `stop()` or `seconds` elapse."""

    def __init__(
        self,
        api_url: str,
        headers: dict[str, str],
        model: str,
        concurrency: int,
        deadline_seconds: float,
        body: Callable[[int], dict] | None = None,
        tags: Callable[[int], set[str]] | None = None,
    ) -> None:
        self.api_url, self.headers, self.model = api_url, headers, model
        self.concurrency, self.deadline_seconds = concurrency, deadline_seconds
        self._body = body or (lambda index: predict_body(f"chaos {uuid.uuid4().hex[:8]}", seed=index))
        self._tags = tags or (lambda index: set())
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._counter = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _next(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter

    def _loop(self) -> None:
        client = Client(self.api_url, self.headers)
        while not self._stop.is_set():
            index = self._next()
            outcome = client.predict(self.model, self._body(index), self.deadline_seconds, self._tags(index))
            with self._lock:
                self.outcomes.append(outcome)

    def start(self) -> Traffic:
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.concurrency)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        """Stops sending; waits for the requests in flight (each bounded by its deadline and the grace)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.deadline_seconds + GRACE_SECONDS * 2)
        with self._lock:
            return list(self.outcomes)
