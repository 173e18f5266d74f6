"""Bad input against the live API: each case must get its documented status and the JSON error shape, never a 500."""

from __future__ import annotations

import base64
import io
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from chaos.malformed_images import MALFORMED_IMAGES, MAY_BE_ACCEPTED
from maas_client import Client


@dataclass
class BadInputResult:
    name: str
    expected: set[int]
    status: int | None
    problem: str | None

    @property
    def passed(self) -> bool:
        return self.problem is None


def _png(width: int = 64, height: int = 64) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _img2img(image: str) -> dict:
    return {"instances": [{"prompt": "x", "image": image}], "parameters": {"num_inference_steps": 2}}


def _chunks(total: int, size: int = 1 << 20):
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


Case = tuple[str, set[int], Callable[[str, dict], httpx.Response]]


def _send(url: str, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    """One call through the SDK's escape hatch (`Client.raw`): the body as built here, the answer as it came."""
    with Client(url, key, timeout=60.0, max_retries=0) as client:
        return client.raw(method, path, **kwargs)


def _key(auth: dict) -> str:
    return auth["Authorization"].removeprefix("Bearer ").strip()


FORTY_MB = 40 * 1024 * 1024


def cases() -> list[Case]:
    png = _png()
    b64 = base64.b64encode
    img2img = "/v1/models/sd15-img2img:predict"
    noop = "/v1/models/noop:predict"

    def post(path: str, headers: dict | None = None, **kwargs) -> Callable[[str, dict], httpx.Response]:
        return lambda url, auth: _send(url, _key(auth), "POST", path, headers=headers, **kwargs)

    nested = "[" * 10_000 + "]" * 10_000
    return [
        ("image: random bytes", {422}, post(img2img, json=_img2img(b64(b"\x00garbage" * 100).decode()))),
        ("image: truncated PNG", {422}, post(img2img, json=_img2img(b64(png[: len(png) // 2]).decode()))),
        ("image: not base64", {422}, post(img2img, json=_img2img("%%% not base64 %%%"))),
        ("image: another bucket", {422}, post(img2img, json=_img2img("gs://someone-elses-bucket/cat.png"))),
        ("image: a URL", {422}, post(img2img, json=_img2img("https://example.com/cat.png"))),
        ("body: 40 MB with Content-Length", {413}, post(noop, content=b"x" * FORTY_MB,
                                                         headers={"Content-Type": "application/json"})),
        ("body: 40 MB chunked", {413}, post(noop, content=_chunks(FORTY_MB), headers={"Content-Type": "application/json"})),
        ("body: JSON nested 10,000 deep", {400, 422}, post(noop, content=nested,
                                                           headers={"Content-Type": "application/json"})),
        ("body: not JSON", {400}, post(noop, content="{{{", headers={"Content-Type": "application/json"})),
        ("body: empty", {400}, post(noop, content="", headers={"Content-Type": "application/json"})),
        ("body: wrong types", {422}, post(noop, json={"instances": "many", "parameters": {"seed": "seven"}})),
        ("body: unknown field", {422}, post(noop, json={"instances": [{"prompt": "x"}], "extra": 1})),
        ("prompt: unicode and control characters", {200}, post(noop, json={"instances": [
            {"prompt": "ünïcødé 🚀 \u0000\u0007\u202e\ufeff tab\tnew\nline"}], "parameters": {"seed": 3}})),
        ("prompt: 100 kB", {422}, post(noop, json={"instances": [{"prompt": "x" * 100_000}]})),
        ("seed: beyond 2^31", {422}, post(noop, json={"instances": [{"prompt": "x"}], "parameters": {"seed": 2**40}})),
        ("size: not a multiple of 8", {422}, post(noop, json={"instances": [{"prompt": "x"}],
                                                             "parameters": {"width": 65}})),
        *[
            (f"image: {name}", {200, 422} if name in MAY_BE_ACCEPTED else {422},
             post(img2img, json=_img2img(b64(build()).decode())))
            for name, build in MALFORMED_IMAGES.items()
        ],
        ("webhook: private address", {422}, post("/v1/models/noop/jobs", json={
            "instances": [{"prompt": "x"}], "webhook_url": "https://169.254.169.254/latest/meta-data"})),
        ("webhook: plain http", {422}, post("/v1/models/noop/jobs", json={
            "instances": [{"prompt": "x"}], "webhook_url": "http://example.com/hook"})),
        ("auth: wrong key", {401}, lambda url, headers: _send(url, "nope", "POST", noop,
                                                              json={"instances": [{"prompt": "x"}]})),
        ("method: GET on predict", {404, 405}, lambda url, headers: _send(url, _key(headers), "GET", noop)),
    ]  # fmt: skip


def _header_injection(url: str, headers: dict) -> BadInputResult:
    """Raw bytes on the socket: CR/LF inside trace and request-id headers (clients refuse to send them)."""
    parsed = urlparse(url)
    body = json.dumps({"instances": [{"prompt": "x"}], "parameters": {"seed": 1}}).encode()
    request = (
        f"POST /v1/models/noop:predict HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
        f"Authorization: {headers['Authorization']}\r\nContent-Type: application/json\r\n"
        f"X-Cloud-Trace-Context: abc/1;o=1\rX-Injected: yes\r\n"
        f"traceparent: 00-{'z' * 32}-{'0' * 16}-01%0d%0aX-Injected: yes\r\n"
        f"X-Request-Id: evil\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head = reply.split(b"\r\n\r\n", 1)[0].decode(errors="replace")
    status = int(head.split(" ", 2)[1]) if head.startswith("HTTP/") else None
    problem = None
    if status is None or status >= 500:
        problem = f"status {status}"
    elif "x-injected" in head.lower():
        problem = "an injected header came back"
    elif "x-request-id: evil" in head.lower():
        problem = "the client's request id was echoed"
    return BadInputResult("headers: CR/LF in trace and request id", {200, 400}, status, problem)


def run_bad_inputs(url: str, headers: dict) -> list[BadInputResult]:
    results = []
    for name, expected, send in cases():
        try:
            response = send(url, headers)
        except httpx.HTTPError as exc:
            results.append(BadInputResult(name, expected, None, f"no answer: {type(exc).__name__}"))
            continue
        problem = None
        if response.status_code not in expected:
            problem = f"got {response.status_code}: {response.text[:160]}"
        elif response.status_code >= 400:
            try:
                error = response.json()["error"]
                assert isinstance(error["code"], int) and isinstance(error["message"], str)
            except (ValueError, KeyError, TypeError, AssertionError):
                problem = f"not the JSON error shape: {response.text[:160]}"
        results.append(BadInputResult(name, expected, response.status_code, problem))
    results.append(_header_injection(url, headers))
    return results


def bad_input_table(results: list[BadInputResult]) -> str:
    lines = ["| bad input | expected | got | result |", "|---|---|---|---|"]
    for result in results:
        verdict = "PASS" if result.passed else f"FAIL: {result.problem}"
        expected = "/".join(str(status) for status in sorted(result.expected))
        lines.append(f"| {result.name} | {expected} | {result.status} | {verdict} |")
    return "\n".join(lines)
