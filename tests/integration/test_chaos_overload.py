"""The overload chaos scenario, short, against the session stack (`make chaos` runs the long one): a model that
answers one request in 2 s, flooded by 24 clients, answers every request in time as a success, a fallback's
success or an immediate 503 from admission, with one log row each; and the watchdog copies none of the requests
that waited in the queue behind its busy worker (issue 55)."""

from __future__ import annotations

import re

import pytest
import requests

from chaos.overload import OVERLOAD_MODEL, overload
from chaos.scenarios import ChaosContext

pytestmark = pytest.mark.stack
# The watchdog's line for a request it published again because nobody took it (model_worker/serving/watchdog.py).
COPIED = re.compile(rf"request (\S+) of {OVERLOAD_MODEL} published again: no worker took it")


def watchdog_copies(stack) -> set[str]:
    """The overload model's requests any of the stack's watchdogs published again for want of a taker."""
    copied = set()
    for log in (stack.stack_dir / "logs").glob("worker-*.log"):
        copied.update(COPIED.findall(log.read_text(errors="replace")))
    return copied


def test_a_model_flooded_past_its_capacity_answers_every_request_in_time_one_way_or_another(
    stack, settings, auth_headers
):
    ctx = ChaosContext.for_stack(stack, settings, auth_headers, row_wait_seconds=60)
    # The model has served before (its run time and worker are known), as a model in production has.
    warm = requests.post(f"{stack.api_url}/v1/models/{OVERLOAD_MODEL}:predict", headers=auth_headers, timeout=60,
                         json={"instances": [{"prompt": "warm"}]})  # fmt: skip
    assert warm.status_code == 200, warm.text
    copied_before = watchdog_copies(stack)
    result = overload(ctx, seconds=20, concurrency=24)
    assert result.passed and result.sent > 24, vars(result)
    # Far past its capacity: some were refused at once and some answered by the fallback, none otherwise.
    kinds = result.notes[0]
    assert "refused at once" in kinds and "fallback" in kinds and "other" not in kinds, result
    # Admitted requests waited up to their 30 s deadline in the queue, past the watchdog's 20 s (twice the model's
    # ack deadline) for an untaken request, while the model's worker was alive and busy: not lost, so not copied.
    copied = watchdog_copies(stack) - copied_before
    assert not copied, f"{len(copied)} copies of queued requests: {sorted(copied)}"
