"""The order test files are handed to the parallel workers: the longest first, so the short unit files fill the end.

pytest-xdist's `--dist loadfile` hands each worker a whole file at a time, by default the files with the most tests
first. That put the suite's longest files (one or two slow tests each: the bench smoke, the chaos burst) last, so
one worker ran them alone for minutes while the other had finished. Run with `--no-loadscope-reorder`, the workers
take the files in the order this plugin sorts them: by their seconds in `tests/file_seconds.json`, longest first.
The figures only order the work; stale ones cost minutes, never a result. `make test-durations` writes them anew.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_PATH = Path(__file__).with_name("file_seconds.json")
# A file not measured yet: among the longer unit files (a new file is more often a stack test than not).
UNMEASURED_SECONDS = 10.0


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_seconds(path: Path = SECONDS_PATH) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """Files by their seconds, longest first; within a file, the tests in their own order (a stable sort)."""
    return sorted(items, key=lambda item: -seconds.get(file_of(item.nodeid), UNMEASURED_SECONDS))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-file-seconds", metavar="PATH", help="write each test file's seconds (setup, call and "
                     "teardown of its tests) to PATH as JSON, the figures tests/file_order.py sorts by")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    items[:] = longest_first(items, load_seconds())


class FileSeconds:
    """Sums the reports' durations by file; on the xdist controller it sees every worker's reports."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((f, round(s, 1)) for f, s in self.seconds.items()), key=lambda fs: -fs[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--write-file-seconds")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(FileSeconds(Path(path)), "file-seconds")
