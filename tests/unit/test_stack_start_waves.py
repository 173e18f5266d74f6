"""The stack starts its workers a few at a time (`emulators.stack.WORKERS_STARTING_AT_ONCE`): a worker takes a start
slot from its launch until it says it has started, exits, or runs past its start timeout."""

from __future__ import annotations

import threading

import pytest

from emulators import stack
from emulators.stack import Component


class FakeRegistry:
    def __init__(self) -> None:
        self.exited: set[str] = set()

    def is_running(self, name: str) -> bool:
        return name not in self.exited


def parts_of(names: list[str], started: set[str], start_timeout: float = 60.0) -> dict[str, Component]:
    return {
        name: Component(
            name,
            ("true",),
            {},
            None,
            None,
            lambda name=name: name in started,
            lambda: (True, "ok"),
            start_timeout=start_timeout,
        )  # fmt: skip
        for name in names
    }


@pytest.fixture(autouse=True)
def two_at_once(monkeypatch):
    monkeypatch.setattr(stack, "WORKERS_STARTING_AT_ONCE", 2)


def test_a_slot_is_free_at_once_while_fewer_than_the_limit_are_starting():
    parts = parts_of(["worker-a", "worker-b"], started=set())
    now = stack.time.monotonic()
    assert stack._wait_for_a_start_slot(FakeRegistry(), parts, {"worker-a": now}) == {"worker-a": now}


def test_a_started_or_exited_worker_frees_its_slot():
    now = stack.time.monotonic()
    started: set[str] = {"worker-a"}
    registry = FakeRegistry()
    registry.exited.add("worker-b")
    parts = parts_of(["worker-a", "worker-b", "worker-c"], started)
    left = stack._wait_for_a_start_slot(registry, parts, {"worker-a": now, "worker-b": now, "worker-c": now})
    assert left == {"worker-c": now}


def test_a_worker_past_its_start_timeout_frees_its_slot():
    now = stack.time.monotonic()
    parts = parts_of(["worker-a", "worker-b"], started=set(), start_timeout=5.0)
    left = stack._wait_for_a_start_slot(FakeRegistry(), parts, {"worker-a": now - 10, "worker-b": now})
    assert left == {"worker-b": now}


def test_the_next_worker_waits_until_one_of_the_starting_ones_has_started():
    now = stack.time.monotonic()
    started: set[str] = set()
    parts = parts_of(["worker-a", "worker-b"], started)
    result: dict[str, dict[str, float]] = {}
    waiting = threading.Thread(
        target=lambda: result.update(left=stack._wait_for_a_start_slot(FakeRegistry(), parts, {"worker-a": now,
                                                                                                  "worker-b": now})),
    )  # fmt: skip
    waiting.start()
    waiting.join(timeout=0.6)  # it cannot return before a worker has started: no race
    assert waiting.is_alive(), "a third worker was let start while two were starting"
    started.add("worker-b")
    waiting.join(timeout=60)
    assert result["left"] == {"worker-a": now}
