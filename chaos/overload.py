"""The overload scenario: a model with admission on, flooded well past its capacity.

Every request must be answered within its deadline plus the grace (10 s) as a success, a fallback's success
(half the clients allow one), or a 503 from admission (an `overloaded` row: refused before anything was
published), and have exactly one log row: none lost, none billed twice. Clients honour `Retry-After` up to a
second, as a polite client would; the refusal latencies are printed, not judged (the verdict is by outcome).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

from chaos.evidence import keep_evidence
from chaos.traffic import GRACE_SECONDS, Client, Outcome, predict_body
from chaos.verdict import ScenarioResult, leaked_reply_subscriptions, row_copies

# `sleep-admitted` (tests/models.fixtures.yaml): one request at a time, 2 s each, `noop` its fallback.
OVERLOAD_MODEL = "sleep-admitted"
# The longest a refused client waits before its next request, whatever `Retry-After` says.
MAX_BACKOFF_SECONDS = 1.0


def _client_loop(ctx, model: str, allow_fallback: bool, until: float, into: list[Outcome], lock) -> None:
    client = Client(ctx.config.api_url, ctx.headers)
    deadline = ctx.timeouts[model]
    while time.monotonic() < until:
        body = {**predict_body(f"overload {uuid.uuid4().hex[:8]}"), "allow_fallback": allow_fallback}
        outcome = client.predict(model, body, deadline, {"fallback-allowed" if allow_fallback else "strict"})
        with lock:
            into.append(outcome)
        if outcome.status == 503:
            time.sleep(MAX_BACKOFF_SECONDS)


def _rows(ctx, request_ids: list[str]) -> dict[str, dict]:
    table = f"`{ctx.settings.project_id}.{ctx.settings.dataset}.{ctx.settings.log_table}`"
    rows: dict[str, dict] = {}
    for start in range(0, len(request_ids), 500):
        ids = ", ".join(f"'{request_id}'" for request_id in request_ids[start : start + 500])
        sql = (
            f"SELECT request_id, model, status, http_status, overload_fallback_from FROM {table} "
            f"WHERE request_id IN ({ids})"
        )
        rows.update({row["request_id"]: dict(row) for row in ctx.bigquery.query(sql).result()})
    return rows


def overload(ctx, seconds: float = 60, concurrency: int = 64, model: str = OVERLOAD_MODEL) -> ScenarioResult:
    """`concurrency` closed-loop clients (half allowing a fallback) on a model whose workers each answer one
    request in 2 s: 64 clients are more than twice what two workers can answer within the 30 s wait."""
    result = ScenarioResult(f"overload: {concurrency} clients on {model}")
    if model not in ctx.timeouts:
        result.notes.append(f"{model} is not served by this stack (tests/models.fixtures.yaml)")
        result.unanswered += 1  # a scenario that could not run is not a pass
        return result
    began = time.monotonic()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    until = began + seconds
    threads = [
        threading.Thread(target=_client_loop, args=(ctx, model, index % 2 == 0, until, outcomes, lock), daemon=True)
        for index in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + ctx.timeouts[model] + GRACE_SECONDS * 2)
    result.record(outcomes)
    expected = [outcome.request_id for outcome in outcomes if outcome.request_id]
    copies = row_copies(ctx.bigquery, ctx.settings, expected, ctx.row_wait_seconds)
    result.record_rows(expected, copies)
    rows = _rows(ctx, expected)
    kinds = Counter()
    refusal_seconds = []
    for outcome in outcomes:
        row = rows.get(outcome.request_id or "")
        if outcome.status == 503:
            refusal_seconds.append(outcome.answered_at - outcome.sent_at)
            if row is None or row["status"] != "overloaded":
                result.notes.append(f"{outcome.request_id}: a 503 that admission did not give ({row})")
                result.undocumented += 1
            kinds["refused at once"] += 1
        elif row is not None and row["overload_fallback_from"]:
            kinds["fallback"] += 1
            if "fallback-allowed" not in outcome.tags:
                result.notes.append(f"{outcome.request_id}: fell back without the opt-in")
                result.undocumented += 1
        elif outcome.status == 200 or outcome.job_status == "succeeded":
            kinds["answered by the model"] += 1
        else:
            kinds[f"other: {outcome.status}/{outcome.job_status}"] += 1
            result.undocumented += 1  # the promise: success, fallback or an immediate 503, nothing else
    result.leaked_subscriptions = len(leaked_reply_subscriptions(ctx.subscriber, ctx.settings.project_id))
    result.notes.insert(0, ", ".join(f"{kind}: {count}" for kind, count in sorted(kinds.items())))
    if refusal_seconds:
        ordered = sorted(refusal_seconds)
        result.notes.append(
            f"503 answered in p50 {ordered[len(ordered) // 2] * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms"
        )
    result.seconds = round(time.monotonic() - began, 1)
    keep_evidence(ctx, result, outcomes)
    return result
