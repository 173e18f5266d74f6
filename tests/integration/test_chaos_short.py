"""One short chaos scenario of each kind that fits in seconds, against the session stack: a regression in the
fault paths is caught at every commit (`make chaos` runs the long ones)."""

from __future__ import annotations

import signal

import pytest

from chaos.scenarios import ChaosContext, _long_requests, run_scenario

pytestmark = pytest.mark.stack


@pytest.fixture
def ctx(stack, settings, auth_headers) -> ChaosContext:
    return ChaosContext.for_stack(stack, settings, auth_headers, row_wait_seconds=60)


def assert_passed(result) -> None:
    assert result.passed, result
    assert result.sent > 10 and result.ok == result.sent, result


def test_a_worker_killed_while_a_second_serves(ctx, extra_worker):
    victim = extra_worker("synthetic")
    result = run_scenario(ctx, "worker SIGKILL", "sleep", 16, 10, [(3, lambda c: c.signal(victim, signal.SIGKILL))])
    assert_passed(result)


def test_redis_stopped_and_started_again(ctx):
    faults = [(2, lambda c: c.signal("redis", signal.SIGKILL)), (8, lambda c: c.restart("redis"))]
    assert_passed(run_scenario(ctx, "Redis outage", "sleep", 8, 12, faults))


def test_api_sigterm_with_a_long_request_in_flight(ctx):
    result = run_scenario(
        ctx, "API SIGTERM", "sleep", 8, 10, [(3, lambda c: c.signal("api", signal.SIGTERM))],
        extra=_long_requests(1, width=256, steps=20),
    )  # fmt: skip
    assert_passed(result)
