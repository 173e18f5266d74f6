"""One request's trace crosses Pub/Sub: its API lines and its worker's lines carry the same trace id."""

from __future__ import annotations

import json
import secrets
import time

import pytest
import requests

pytestmark = pytest.mark.stack


def lines_with(log_files, trace_field: str) -> list[dict]:
    found = []
    for path in log_files:
        for raw in path.read_text(errors="replace").splitlines():
            if trace_field in raw:
                try:
                    found.append(json.loads(raw))
                except json.JSONDecodeError:
                    continue
    return found


@pytest.mark.parametrize("path", [":predict", "/jobs"])
def test_a_requests_api_and_worker_lines_share_its_trace(stack, auth_headers, settings, path):
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {**auth_headers, "traceparent": f"00-{trace_id}-{span_id}-01"}
    response = requests.post(
        f"{stack.api_url}/v1/models/noop{path}", json={"instances": [{"prompt": "traced"}]}, headers=headers, timeout=30
    )
    assert response.status_code in (200, 202), response.text
    request_id = response.headers["X-Request-Id"]
    trace = f"projects/{settings.project_id}/traces/{trace_id}"
    logs = stack.stack_dir / "logs"
    deadline = time.monotonic() + 20
    while True:  # the worker logs its answer when the reply's publish completes: poll until it is written
        api_lines = lines_with([logs / "api.log"], trace_id)
        worker_lines = lines_with(sorted(logs.glob("worker-*.log")), trace_id)
        if (api_lines and worker_lines) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert api_lines and all(line["logging.googleapis.com/trace"] == trace for line in api_lines), api_lines
    assert {line["request_id"] for line in api_lines} == {request_id}
    assert worker_lines, "no worker line carries the request's trace"
    assert all(line["logging.googleapis.com/trace"] == trace for line in worker_lines), worker_lines
    assert all(line["request_id"] == request_id for line in worker_lines)
    assert any(line["message"] == f"request {request_id} ok" for line in worker_lines), worker_lines
