"""A body sent chunked (no Content-Length) is read like any other: parsed when small, refused with 413 when large."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.stack


def chunks(total: int, size: int = 1 << 20):
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


def test_a_40_mb_chunked_body_is_413_and_the_client_reads_it(stack, auth_headers):
    response = requests.post(
        f"{stack.api_url}/v1/models/noop:predict",
        data=chunks(40 * 1024 * 1024),
        headers={**auth_headers, "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert "exceeds" in response.json()["error"]["message"]


def test_a_small_chunked_body_is_served(stack, auth_headers):
    def body():
        yield b'{"instances": [{"prompt": "sent in chunks"}],'
        yield b' "parameters": {"seed": 5}}'

    response = requests.post(
        f"{stack.api_url}/v1/models/noop:predict",
        data=body(),
        headers={**auth_headers, "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["seed"] == 5
