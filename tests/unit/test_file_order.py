"""The suite's files go to the parallel workers longest first (tests/file_order.py), each file's tests kept in
their own order, and a run can write the figures anew."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.file_order import UNMEASURED_SECONDS, FileSeconds, load_seconds, longest_first


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

