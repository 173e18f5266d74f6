"""The suite's files go to the parallel workers longest first (tests/file_order.py), each file's tests kept in
their own order, the stack files to the two workers with a stack; a run can write the figures anew."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import file_order
from tests.file_order import STACK_WORKERS, UNMEASURED_SECONDS, FileSeconds, load_seconds, longest_first, may_take


def items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_the_longest_files_come_first_and_each_files_tests_keep_their_order():
    seconds = {"tests/unit/test_a.py": 1.0, "tests/integration/test_b.py": 90.0}
    ordered = longest_first(
        items("tests/unit/test_a.py::one", "tests/unit/test_a.py::two", "tests/integration/test_b.py::one",
              "tests/e2e/test_new.py::one", "tests/integration/test_b.py::two"), seconds)  # fmt: skip
    assert [item.nodeid for item in ordered] == [
        "tests/integration/test_b.py::one", "tests/integration/test_b.py::two",  # 90 s
        "tests/e2e/test_new.py::one",  # not measured yet: UNMEASURED_SECONDS
        "tests/unit/test_a.py::one", "tests/unit/test_a.py::two",
    ]  # fmt: skip
    assert 1.0 < UNMEASURED_SECONDS < 90.0


def test_the_figures_are_written_per_file_longest_first_and_read_back(tmp_path):
    path = tmp_path / "seconds.json"
    recorder = FileSeconds(path)
    for nodeid, duration in [("tests/x.py::a", 1.0), ("tests/y.py::a", 2.5), ("tests/x.py::a", 0.25),
                             ("tests/x.py::b", 2.0)]:  # fmt: skip
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))
    recorder.pytest_sessionfinish()
    assert list(json.loads(path.read_text()).items()) == [("tests/x.py", 3.2), ("tests/y.py", 2.5)]
    assert load_seconds(path) == {"tests/x.py": 3.2, "tests/y.py": 2.5}


def test_stack_files_go_to_the_stack_workers_first_and_never_to_the_others():
    queue = ["tests/unit/test_long.py", "tests/integration/test_a.py", "tests/e2e/test_b.py", "tests/unit/test_short.py",
             "tests/browser/test_c.py", "tests/infra/test_d.py"]  # fmt: skip
    for stack_worker in range(STACK_WORKERS):
        assert may_take(stack_worker, queue) == ["tests/integration/test_a.py", "tests/e2e/test_b.py",
                                                 "tests/browser/test_c.py", "tests/unit/test_long.py",
                                                 "tests/unit/test_short.py", "tests/infra/test_d.py"]  # fmt: skip
    assert may_take(STACK_WORKERS, queue) == ["tests/unit/test_long.py", "tests/unit/test_short.py",
                                              "tests/infra/test_d.py"]  # fmt: skip
    assert may_take(STACK_WORKERS, ["tests/e2e/test_b.py"]) == []  # it stops rather than start a third stack


@pytest.mark.parametrize(
    ("worker", "niced"), [("gw0", False), ("gw1", False), ("gw2", True), ("gw5", True), ("", False)]
)
def test_only_a_worker_that_starts_no_stack_yields_the_cpu(monkeypatch, worker, niced):
    calls: list[int] = []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(file_order.os, "nice", calls.append)
    file_order.yield_the_cpu_without_a_stack()
    assert calls == ([file_order.NON_STACK_NICENESS] if niced else [])
