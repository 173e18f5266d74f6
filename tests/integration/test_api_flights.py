"""Shared flights (coalescing, idempotency) against the stack's real Redis: two instances stand for two API processes."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from api_server.core import metrics
from api_server.core.redis_state import RedisState, api_redis_client
from api_server.predict.flights import (
    CoordinationUnavailableError,
    FingerprintMismatchError,
    FlightPolicy,
    ResponseRecord,
    Role,
    SharedFlights,
    StillRunningError,
)

pytestmark = pytest.mark.stack


def keep_ok(record: ResponseRecord) -> int | None:
    return 60 if record.status == 200 else None


POLICY = FlightPolicy(keep_for=keep_ok, lease_seconds=5, wait_seconds=5)


@pytest.fixture
def client(stack):
    return redis.Redis.from_url(stack.client_env()["MAAS_REDIS_URL"])


@pytest.fixture
def two_processes(client):
    return SharedFlights(RedisState(client)), SharedFlights(RedisState(client))


class SlowModel:
    def __init__(self, status: int = 200, seconds: float = 0.3) -> None:
        self.calls = 0
        self.status, self.seconds = status, seconds
        self._lock = threading.Lock()

    def __call__(self) -> ResponseRecord:
        with self._lock:
            self.calls += 1
            call = self.calls
        time.sleep(self.seconds)
        return ResponseRecord(self.status, f"answer {call}".encode(), {"Content-Type": "text/plain"})


def run_together(flights_list, key, compute, policy=POLICY, fingerprint=""):
    barrier = threading.Barrier(len(flights_list))

    def call(flights):
        barrier.wait()
        return flights.run(key, fingerprint, compute, policy)

    with ThreadPoolExecutor(len(flights_list)) as pool:
        return list(pool.map(call, flights_list))


def test_identical_calls_across_processes_compute_once(two_processes):
    model, key = SlowModel(), f"maas:test:{uuid.uuid4().hex}"
    first, second = two_processes
    results = run_together([first, second] * 4, key, model)
    assert model.calls == 1
    assert {record.body for record, _ in results} == {b"answer 1"}
    assert sorted(role for _, role in results).count(Role.LEADER) == 1
    record, role = first.run(key, "", model, POLICY)
    assert role is Role.STORED and record.body == b"answer 1" and model.calls == 1


class ModelAnsweringOnceAllWait(SlowModel):
    """Its first call answers once `waiters` callers wait for its flight: a failure (which is not kept) then reaches
    each of them by order; a caller arriving after it would run the model again, and one descheduled past a timer
    could. Later calls answer at once."""

    def __init__(self, waiters: int, status: int) -> None:
        super().__init__(status=status, seconds=0)
        self._waiters = metrics.INFLIGHT_WAITS._value.get() + waiters

    def __call__(self) -> ResponseRecord:
        give_up = time.monotonic() + 30
        while not self.calls and metrics.INFLIGHT_WAITS._value.get() < self._waiters and time.monotonic() < give_up:
            time.sleep(0.01)
        return super().__call__()


def test_a_failure_reaches_the_waiting_callers_but_the_next_caller_runs_again(two_processes):
    model, key = ModelAnsweringOnceAllWait(waiters=3, status=500), f"maas:test:{uuid.uuid4().hex}"
    results = run_together(list(two_processes) * 2, key, model)
    assert model.calls == 1 and {record.status for record, _ in results} == {500}
    _, role = two_processes[0].run(key, "", model, POLICY)
    assert role is Role.LEADER and model.calls == 2


def test_a_dead_lease_holder_is_replaced_once_its_lease_lapses(client, two_processes):
    key = f"maas:test:{uuid.uuid4().hex}"
    client.set(f"{key}:lease", "|dead-process", px=300)  # a holder that died without an outcome
    model = SlowModel(seconds=0)
    record, role = two_processes[0].run(key, "", model, POLICY)
    assert role is Role.LEADER and model.calls == 1 and record.body == b"answer 1"


def test_a_caller_whose_wait_runs_out_computes_alone_unless_strict(client, two_processes):
    key = f"maas:test:{uuid.uuid4().hex}"
    client.set(f"{key}:lease", "|stuck", px=10_000)
    short = FlightPolicy(keep_for=keep_ok, lease_seconds=5, wait_seconds=0.3)
    _, role = two_processes[0].run(key, "", SlowModel(seconds=0), short)
    assert role is Role.ALONE
    with pytest.raises(StillRunningError):
        two_processes[0].run(key, "", SlowModel(seconds=0), FlightPolicy(keep_ok, 5, 0.3, strict=True))


def test_the_same_key_with_another_fingerprint_is_refused(two_processes):
    key = f"maas:test:{uuid.uuid4().hex}"
    two_processes[0].run(key, "body-a", SlowModel(seconds=0), POLICY)
    with pytest.raises(FingerprintMismatchError):
        two_processes[1].run(key, "body-b", SlowModel(seconds=0), POLICY)
    assert two_processes[1].run(key, "body-a", SlowModel(seconds=0), POLICY)[1] is Role.STORED


def test_without_redis_calls_compute_alone_and_strict_ones_are_refused():
    unreachable = api_redis_client("redis://127.0.0.1:1/0")
    flights = SharedFlights(RedisState(unreachable, retry_seconds=5))
    model = SlowModel(seconds=0)
    assert flights.run("k", "", model, POLICY)[1] is Role.ALONE
    assert flights.lookup("k") is None
    with pytest.raises(CoordinationUnavailableError):
        flights.run("k", "", model, FlightPolicy(keep_ok, 5, 5, strict=True))
    assert model.calls == 1
