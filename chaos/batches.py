"""The batch scenario: one batch of `sleep` lines through a worker SIGKILL (holding batch lines), a SIGKILL of the API
process feeding it, and a Redis restart (no persistence: every batch key lost); every custom_id must be answered
exactly once in the results and errors files, with one log row each."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections import Counter

import requests

from chaos.verdict import ScenarioResult, row_copies

LINES = 400


def batch_faults(ctx, lines: int = LINES, timeout: float = 300) -> ScenarioResult:
    result = ScenarioResult(f"batch of {lines}: worker kill, API kill, Redis restart")
    began = time.monotonic()
    url, headers = ctx.config.api_url, ctx.headers
    prefix = f"chaos-{uuid.uuid4().hex[:6]}"
    body = [{"custom_id": f"{prefix}-{index}", "model": "sleep", "instances": [{"prompt": f"chaos batch {index}"}],
             "parameters": {"seed": index}} for index in range(lines)]  # fmt: skip
    created = requests.post(f"{url}/v1/batches", json={"requests": body}, headers=headers, timeout=30)
    created.raise_for_status()
    batch_id = created.json()["id"]

    def view() -> dict | None:
        try:
            response = requests.get(f"{url}/v1/batches/{batch_id}", headers=headers, timeout=10)
        except requests.RequestException:
            return None
        return response.json() if response.status_code == 200 else None

    def until(succeeded: int) -> dict | None:
        while time.monotonic() - began < timeout:
            current = view()
            if current is not None and (current["request_counts"]["succeeded"] >= succeeded or current["status"] in
                                        ("completed", "failed", "cancelled", "expired")):  # fmt: skip
                return current
            time.sleep(0.2)
        return None

    faults = [
        (40, "worker SIGKILL holding lines", lambda: ctx.kill_worker("worker-synthetic", holding=True)),
        (120, "API SIGKILL while feeding", lambda: ctx.signal("api", signal.SIGKILL)),
        (200, "Redis restart", lambda: ctx.restart("redis")),
    ]
    for succeeded, name, fault in faults:
        at = until(succeeded)
        if at is None or at["status"] != "in_progress":
            result.notes.append(f"{name}: not injected, the batch was {at and at['status']}")
            continue
        try:
            fault()
            result.notes.append(f"{name} at {at['request_counts']['succeeded']} lines answered")
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not hidden
            result.notes.append(f"{name} failed: {exc}")
    final = until(lines + 1)
    ctx.wait_ready()
    answered: Counter = Counter()
    request_ids = []
    for kind in ("results", "errors"):
        response = requests.get(f"{url}/v1/batches/{batch_id}/{kind}", headers=headers, timeout=60)
        for text in response.text.splitlines():
            item = json.loads(text)
            answered[item["custom_id"]] += 1
            if item.get("request_id"):
                request_ids.append(item["request_id"])
            if kind == "results":
                result.ok += 1
            else:
                result.errors_by_status[item["status"]] += 1
    result.sent = lines
    result.unanswered = sum(1 for line in body if answered[line["custom_id"]] == 0)
    result.undocumented = sum(count - 1 for count in answered.values() if count > 1)  # answered twice
    if final is None or final["status"] != "completed":
        result.notes.append(f"the batch ended {final and final['status']}, not completed")
        result.unanswered += 1 if final is None else 0
    else:
        result.notes.append(f"completed: {final['request_counts']}")
    result.record_rows(request_ids, row_copies(ctx.bigquery, ctx.settings, request_ids, ctx.row_wait_seconds))
    result.seconds = round(time.monotonic() - began, 1)
    return result
