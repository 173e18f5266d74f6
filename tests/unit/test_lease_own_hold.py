"""A worker never runs a request twice because Redis forgot who holds it: after a Redis loss (no persistence) the
holder records are gone, a batch restored from GCS publishes its unanswered lines again, and a copy of a line this
worker is already running must be dropped by the worker's own hold, not run a second time unbilled."""

from __future__ import annotations

from model_worker.held.leases import LeaseKeeper
from model_worker.held.pool import HeldMessage


class ForgetfulInflight:
    """Redis after a restart: no holder record for anything, so every take succeeds, unless `others` hold it."""

    def __init__(self, others: set[str] = frozenset()) -> None:
        self.others, self.taken = others, []

    def take(self, request_id: str, holder: str, lease: float) -> str | None:
        self.taken.append(request_id)
        return "worker-b" if request_id in self.others else None

    def let_go(self, request_ids: list[str], holder: str, answered: bool) -> None:
        pass


def message(ack_id: str) -> HeldMessage:
    return HeldMessage("sub", ack_id, {}, b"", 5, 0.0)


def test_a_copy_of_a_request_this_worker_runs_is_refused_though_redis_lost_its_holder():
    leases = LeaseKeeper(None, {"sub": 10}, ForgetfulInflight(), holder="worker-a")  # type: ignore[arg-type]
    assert leases.take(message("first"), "batch-1-line-7")
    assert not leases.take(message("republished"), "batch-1-line-7")  # its run is under way here
    assert leases.take(message("other"), "batch-1-line-8")
    leases.hand_over(message("first"))  # the first run let go (a flow's stage handed on): a later copy runs
    assert leases.take(message("again"), "batch-1-line-7")


def test_a_request_another_worker_holds_is_refused_and_leaves_no_hold_here():
    inflight = ForgetfulInflight(others={"r"})
    leases = LeaseKeeper(None, {"sub": 10}, inflight, holder="worker-a")  # type: ignore[arg-type]
    assert not leases.take(message("m1"), "r")
    inflight.others = set()  # that worker let go: this one may take it now
    assert leases.take(message("m2"), "r")
