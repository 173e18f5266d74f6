"""What the sync and asyncio clients share, free of I/O: request bodies, answers to errors, the retry
policy, the Server-Sent Events parser and what a finished job turns into."""

from __future__ import annotations

import base64
import inspect
import json
import math
import os
import random
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx

from maas_client.errors import (
    ConnectionFailed,
    InputError,
    JobCancelled,
    JobFailed,
    MaasError,
    Timeout,
    error_for,
)
from maas_client.types import Control, ImagePrompt, JobView, PredictResponse, Result

DEFAULT_URL = "http://127.0.0.1:8080"
# Longer than the longest model request timeout (the server answers 202 with a job by then).
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=150.0, write=60.0, pool=10.0)
RETRY_STATUSES = (429, 503)
# Transport failures after which the request may not have reached the server, or its answer was lost.
RETRYABLE_ERRORS = (httpx.TransportError,)
PNG, JPEG, WEBP = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF"


def retry_deadline_from_env(given: float | None) -> float:
    """The retry deadline: the one given, else `MAAS_RETRY_DEADLINE` (seconds), else the default (60 s)."""
    if given is not None:
        return given
    raw = os.environ.get("MAAS_RETRY_DEADLINE")
    if not raw:
        return DEFAULT_RETRY_DEADLINE
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"MAAS_RETRY_DEADLINE {raw!r}: expected seconds, e.g. 60") from None
    if value < 0:
        raise InputError(f"MAAS_RETRY_DEADLINE {raw!r}: expected seconds, e.g. 60")
    return value


def settings_from_env(url: str | None, api_key: str | None) -> tuple[str, str]:
    url = (url or os.environ.get("MAAS_URL") or DEFAULT_URL).rstrip("/")
    api_key = api_key or os.environ.get("MAAS_API_KEY")
    if not api_key:
        raise InputError("no API key: pass api_key= or set MAAS_API_KEY")
    if not re.match(r"^https?://[^/\s]+", url):
        raise InputError(f"MAAS_URL {url!r}: expected http(s)://host[:port]")
    return url, api_key


def http_options(url: str | None, api_key: str | None, timeout: httpx.Timeout | float) -> tuple[str, dict]:
    """The base URL and what both clients give their httpx client: the key, the User-Agent, timeouts, TLS."""
    url, key = settings_from_env(url, api_key)
    headers = {"Authorization": f"Bearer {key}", "User-Agent": "maas-client/0.1"}
    return url, {"base_url": url, "headers": headers, "timeout": timeout, "verify": verify_tls(url)}


def verify_tls(url: str) -> bool:
    """httpx loads the CA bundle for every client (~50 ms of CPU, holding the GIL), TLS or not; a plain-http
    base URL never does TLS (the SDK follows no redirects), so it skips that: 32 load threads, each with its
    own client, otherwise spend their first seconds loading certificates instead of sending requests."""
    return url.startswith("https://")


def parse_size(size: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """`512x512` or (512, 512) -> (width, height)."""
    if size is None:
        return None
    if isinstance(size, tuple):
        width, height = size
    else:
        match = re.fullmatch(r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*", size)
        if not match:
            raise InputError(f"size {size!r}: expected WIDTHxHEIGHT, e.g. 512x512")
        width, height = int(match[1]), int(match[2])
    if width <= 0 or height <= 0:
        raise InputError(f"size {width}x{height}: both sides must be positive")
    return width, height


def image_bytes(image: Any) -> bytes:
    """A PIL image, a path or bytes -> PNG/JPEG/WebP bytes; anything else is an InputError naming why."""
    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    elif isinstance(image, (str, Path)):
        path = Path(image)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InputError(f"image file not found: {path}") from None
        except OSError as exc:
            raise InputError(f"image file {path} cannot be read: {exc.strerror or exc}") from None
    elif hasattr(image, "save"):  # a PIL image
        import io

        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    else:
        raise InputError(f"image: expected a path, bytes or a PIL image, not {type(image).__name__}")
    if not (data.startswith(PNG) or data.startswith(JPEG) or (data.startswith(WEBP) and data[8:12] == b"WEBP")):
        raise InputError("image is not a PNG, JPEG or WebP file")
    return data


def predict_body(
    prompt: str,
    *,
    n: int = 1,
    seed: int | None = None,
    steps: int | None = None,
    size: str | tuple[int, int] | None = None,
    image: Any = None,
    mask: Any = None,
    outpaint: dict[str, int] | None = None,
    negative_prompt: str | None = None,
    guidance_scale: float | None = None,
    strength: float | None = None,
    priority: str | None = None,
    webhook_url: str | None = None,
    adapters: dict[str, float] | list[dict] | None = None,
    controls: list[Control] | None = None,
    image_prompts: list[ImagePrompt] | None = None,
) -> dict:
    """The API's request body (`instances`, `parameters`): only what the caller set, the catalog fills the rest.
    An inpaint model takes `image` and `mask` (white repaints, black keeps), or `image` and `outpaint`
    ({"left": px, "right": px, "top": px, "bottom": px}: the API pads the image and paints the border)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("prompt: must not be empty")
    if n < 1:
        raise InputError(f"n {n}: at least 1 image")
    instance: dict[str, Any] = {"prompt": prompt}
    if image is not None:
        instance["image"] = base64.b64encode(image_bytes(image)).decode()
    if mask is not None:
        try:
            instance["mask"] = base64.b64encode(image_bytes(mask)).decode()
        except InputError as exc:
            raise InputError(f"mask: {exc}") from None
    parameters: dict[str, Any] = {}
    if outpaint:
        parameters["outpaint"] = dict(outpaint)
    if (dimensions := parse_size(size)) is not None:
        parameters["width"], parameters["height"] = dimensions
    for name, value in (
        ("seed", seed),
        ("num_inference_steps", steps),
        ("negative_prompt", negative_prompt),
        ("guidance_scale", guidance_scale),
        ("strength", strength),
        ("priority", priority),
    ):
        if value is not None:
            parameters[name] = value
    if adapters:  # {"name": scale, ...} or the API's own [{"name", "scale"}] list
        parameters["adapters"] = (
            [{"name": name, "scale": scale} for name, scale in adapters.items()]
            if isinstance(adapters, dict)
            else adapters
        )
    if controls:  # [{"name", "image" (a path, bytes or PIL image), "scale", "start", "end", "mode", "preprocess"}]
        parameters["controls"] = [control_body(index, control) for index, control in enumerate(controls)]
    if image_prompts:  # [{"name", "image" (a path, bytes or PIL image), "scale"}, ...]: IP-Adapters
        parameters["image_prompts"] = [control_body(index, prompt, "image_prompts")
                                       for index, prompt in enumerate(image_prompts)]  # fmt: skip
    body: dict[str, Any] = {"instances": [instance] * n, "parameters": parameters}
    if webhook_url:
        body["webhook_url"] = webhook_url
    return body


def control_body(index: int, control: Mapping, field: str = "controls") -> dict:
    """One ControlNet of `parameters.controls` (or image prompt of `parameters.image_prompts`), its image read and
    sent as base64; a ControlNet Union's `mode` an integer from 0 (the API checks it against the Union's modes)."""
    if not isinstance(control, Mapping) or "name" not in control or "image" not in control:
        also = "scale" if field == "image_prompts" else "scale, start, end, mode, preprocess"
        raise InputError(f"{field}[{index}]: a dict with name and image (and {also})")
    mode = control.get("mode")
    if mode is not None and (field != "controls" or isinstance(mode, bool) or not isinstance(mode, int) or mode < 0):
        which = "an image prompt has none" if field != "controls" else "a ControlNet Union's mode, an integer from 0"
        raise InputError(f"{field}[{index}].mode {mode!r}: {which}")
    try:
        image = base64.b64encode(image_bytes(control["image"])).decode()
    except InputError as exc:
        raise InputError(f"{field}[{index}].image: {exc}") from None
    return {**control, "image": image}


def parse_control(text: str, flag: str = "--control") -> dict:
    """The CLI's `--control NAME=IMAGE[:SCALE[:MODE]]` (and `--image-prompt NAME=IMAGE[:SCALE]`): a control model, its
    image's path, its scale and, for a ControlNet Union, its mode (`IMAGE:SCALE:MODE`; `IMAGE::MODE` keeps the
    default scale). One number after the image is the scale; a path may hold colons."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        spelling, example = (
            ("NAME=IMAGE[:SCALE]", "tiny-style=reference.png:0.6") if flag == "--image-prompt"
            else ("NAME=IMAGE[:SCALE[:MODE]]", "tiny-edges=edges.png:0.8, or union=edges.png:0.8:3 for a Union's mode")
        )  # fmt: skip
        raise InputError(f"{flag} {text!r}: {spelling}, e.g. {example}")
    head, colon, last = rest.rpartition(":")
    if flag == "--control" and colon and last.isdigit():
        path, colon, scale = head.rpartition(":")
        if colon and path and (not scale or _is_number(scale)):
            return {"name": name, "image": path, **({"scale": float(scale)} if scale else {}), "mode": int(last)}
    path, colon, scale = rest.rpartition(":")
    if not colon:
        return {"name": name, "image": rest}
    try:
        return {"name": name, "image": path, "scale": float(scale)}
    except ValueError:
        return {"name": name, "image": rest}  # a path with a colon and no scale


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


MAX_PAGE = 100


def job_list_params(limit: int, state: str | None, cursor: str | None) -> dict:
    if not 1 <= limit <= MAX_PAGE:
        raise InputError(f"limit {limit}: from 1 to {MAX_PAGE}")
    params: dict[str, Any] = {"limit": limit}
    if state:
        params["state"] = state
    if cursor:
        params["cursor"] = cursor
    return params


def page_size(limit: int | None, seen: int) -> int:
    return MAX_PAGE if limit is None else max(1, min(MAX_PAGE, limit - seen))


def new_idempotency_key() -> str:
    return f"maas-sdk-{uuid.uuid4().hex}"


def inference_headers(idempotency_key: str | None, *, as_job: bool = False) -> dict[str, str]:
    """A predict's or submit's headers: its Idempotency-Key (one per call, so a retry never runs it twice) and,
    for a predict followed as a job from the start, `Prefer: respond-async`."""
    headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
    if as_job:
        headers["Prefer"] = "respond-async"
    return headers


def retry_after_seconds(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


# How long a safe call keeps retrying (connection failures, 429, 503, a 409 still running) before it raises the
# last error: long enough to ride out one API instance restarting (the local stack's takes ~5-15 s).
DEFAULT_RETRY_DEADLINE = 60.0


@dataclass
class RetryPolicy:
    """Exponential backoff with full jitter, until a deadline; the server's Retry-After wins when it says more.

    Retried: connection failures, 429 and 503, and a 409 while a request with the same Idempotency-Key is
    still running. A POST is retried only with an Idempotency-Key, so a retry never runs the model twice.
    A call retries until `deadline_seconds` after it began (no attempt starts later), or `max_retries` times
    when that is set (0: never); a wait the server asks for that would end past the deadline is not waited.
    """

    deadline_seconds: float = DEFAULT_RETRY_DEADLINE
    max_retries: int | None = None
    base_seconds: float = 0.5
    max_seconds: float = 5.0
    random: random.Random = field(default_factory=random.Random)

    def backoff(self, attempt: int) -> float:
        return self.random.uniform(0, min(self.max_seconds, self.base_seconds * 2**attempt))

    def delay(
        self,
        attempt: int,
        *,
        safe: bool,
        response: httpx.Response | None = None,
        error: Exception | None = None,
        remaining: float = math.inf,
    ) -> float | None:
        """Seconds to wait before retry number `attempt + 1`, or None: do not retry. `remaining`: seconds left
        before the call's deadline."""
        if not safe or remaining <= 0 or (self.max_retries is not None and attempt >= self.max_retries):
            return None
        if error is not None:
            return min(self.backoff(attempt), remaining) if isinstance(error, RETRYABLE_ERRORS) else None
        assert response is not None
        advised = retry_after_seconds(response)
        if response.status_code in RETRY_STATUSES or (response.status_code == 409 and advised is not None):
            if advised is not None and advised > remaining:
                return None  # the server says no sooner than after the deadline: its answer is final
            return min(max(advised or 0.0, self.backoff(attempt)), remaining)
        return None

    def start(self, deadline_seconds: float | None = None) -> Retries:
        """The retries of one call, which began now (`deadline_seconds`: this call's own, else the policy's)."""
        seconds = self.deadline_seconds if deadline_seconds is None else deadline_seconds
        return Retries(self, time.monotonic() + seconds)


class Retries:
    """One call's retries: how many so far, and the moment after which none starts."""

    def __init__(self, policy: RetryPolicy, deadline: float) -> None:
        self.policy = policy
        self.deadline = deadline
        self.attempt = 0

    def next_delay(
        self, *, safe: bool, response: httpx.Response | None = None, error: Exception | None = None
    ) -> float | None:
        """Seconds to wait before trying again, or None: the answer (or error) is final."""
        delay = self.policy.delay(
            self.attempt, safe=safe, response=response, error=error, remaining=self.deadline - time.monotonic()
        )
        if delay is not None:
            self.attempt += 1
        return delay


def seconds_left(deadline: float | None) -> float:
    """Seconds until a `time.monotonic()` deadline (infinite for None, never negative)."""
    return math.inf if deadline is None else max(0.0, deadline - time.monotonic())


def within(deadline: float | None, timeout: httpx.Timeout) -> dict[str, Any]:
    """A request's options that keep it (retries and reads) inside `deadline`; none for no deadline."""
    if deadline is None:
        return {}
    return {"retry_deadline": seconds_left(deadline), "timeout": timeout_within(timeout, deadline)}


def timeout_within(timeout: httpx.Timeout, deadline: float | None) -> httpx.Timeout:
    """The client's timeouts, none longer than the time left before `deadline`: a read on a silent connection
    ends at the deadline, not at the client's read timeout."""
    left = seconds_left(deadline)
    if left == math.inf:
        return timeout
    left = max(left, 0.001)  # 0 would mean "no timeout" to some transports

    def bounded(value: float | None) -> float:
        return left if value is None else min(value, left)

    return httpx.Timeout(
        connect=bounded(timeout.connect), read=bounded(timeout.read), write=bounded(timeout.write),
        pool=bounded(timeout.pool),
    )  # fmt: skip


def raise_for_answer(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise error_for(response.status_code, body, retry_after_seconds(response))


def transport_error(exc: Exception, url: str) -> MaasError:
    """A transport failure as one line naming the problem."""
    if isinstance(exc, httpx.TimeoutException):
        return Timeout(f"no answer from {url} in time ({type(exc).__name__})")
    return ConnectionFailed(f"cannot reach {url}: {exc or type(exc).__name__}")


def result_from_predict(response: httpx.Response) -> Result:
    body = PredictResponse.model_validate(response.json())
    return Result(
        model=body.model,
        model_version=body.model_version,
        request_id=body.request_id,
        predictions=body.predictions,
        timings_ms=body.timings_ms,
        cache=response.headers.get("X-Cache"),
    )


def result_from_job(view: JobView) -> Result:
    """A finished job's result, or the typed error its end maps to."""
    if view.status == "succeeded" and view.result is not None:
        return Result(
            model=view.model,
            model_version=view.model_version,
            request_id=view.id,
            job_id=view.id,
            predictions=view.result.predictions,
            timings_ms=view.result.timings_ms,
        )
    if view.status == "cancelled":
        raise JobCancelled(f"job {view.id} was cancelled", request_id=view.id)
    error = view.error
    message = error.message if error else f"job {view.id} ended {view.status}"
    if view.status == "expired":
        raise Timeout(message, status=error.code if error else 504, request_id=view.id)
    raise JobFailed(message, status=error.code if error else 500, request_id=view.id)


@dataclass
class ServerEvent:
    event: str
    id: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


class EventParser:
    """Server-Sent Events, line by line (the WHATWG rules this API uses: event, id, data, comments)."""

    def __init__(self) -> None:
        self._event, self._id, self._data = "message", None, []
        self.last_id: str | None = None

    def feed(self, line: str) -> ServerEvent | None:
        if line == "":
            if not self._data:
                self._event = "message"
                return None
            event = ServerEvent(self._event, self._id, "\n".join(self._data))
            self._event, self._data = "message", []
            if self._id is not None:
                self.last_id = self._id
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


class ProgressGate:
    """Calls `on_progress(step, total)` only for a step beyond the last one: strictly increasing; a job that
    succeeds ends at `(total, total)` (the stream sends at most ~4 steps a second, maybe not the last). A flow's
    step counts all its stages' steps; a callback that takes a third argument also gets the running stage's
    name (`on_progress(step, total, stage)`; None for a model's job)."""

    def __init__(self, on_progress) -> None:
        self._on_progress = on_progress
        self._with_stage = on_progress is not None and _takes_three(on_progress)
        self._step = self._total = 0
        self._stage: str | None = None

    def update(self, view: JobView) -> None:
        if self._on_progress is None:
            return
        if view.progress is not None and view.progress.step > self._step:
            self._step, self._total = view.progress.step, view.progress.total
            self._stage = view.progress.stage
            self._call(view.progress.step, view.progress.total)
        elif view.status == "succeeded" and self._step < self._total:
            self._step = self._total
            self._call(self._total, self._total)

    def _call(self, step: int, total: int) -> None:
        if self._with_stage:
            self._on_progress(step, total, self._stage)
        else:
            self._on_progress(step, total)


def _takes_three(callback) -> bool:
    """Whether `callback` takes (step, total, stage), not only (step, total)."""
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(0, 0, None)
    except TypeError:
        return False
    return True
