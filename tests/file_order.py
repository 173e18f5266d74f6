"""Which parallel worker runs which test file, and in what order: the longest first, stack files on stack workers.

pytest-xdist's `--dist loadfile` hands each worker a whole file at a time, by default the files with the most tests
first. That put the suite's longest files (one or two slow tests each: the bench smoke, the chaos burst) last, so
one worker ran them alone for minutes while the other had finished. Run with `--no-loadscope-reorder`, the workers
take the files in the order this plugin sorts them: by their seconds in `tests/file_seconds.json`, longest first.
The figures only order the work; stale ones cost minutes, never a result. `make test-durations` writes them anew.

Each worker that runs a stack test starts a whole stack of its own (about 5 GiB, a minute of CPU), and a stack test
mostly waits: for a worker killed, a deadline, a lease to lapse. So the first `STACK_WORKERS` workers take the stack
files (tests/integration, e2e, browser) first and the others' leftovers after; any further worker takes only the
files that need no stack, on the CPU the stack tests leave idle, and never starts a third stack.
"""

from __future__ import annotations

import json
import os
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


def needs_stack(nodeid: str) -> bool:
    return nodeid.startswith(STACK_FILES)


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """The stack files before the others (a process that has run its last stack test stops its stack: tests/conftest.py
    `pytest_runtest_teardown`), each kind by its files' seconds, longest first; within a file, the tests in their own
    order (a stable sort)."""
    return sorted(items, key=lambda item: (not needs_stack(item.nodeid),
                                           -seconds.get(file_of(item.nodeid), UNMEASURED_SECONDS)))  # fmt: skip


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-file-seconds", metavar="PATH", help="write each test file's seconds (setup, call and "
                     "teardown of its tests) to PATH as JSON, the figures tests/file_order.py sorts by")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    items[:] = longest_first(items, load_seconds())


# Files under these start the session's stack (or may: the browser tests): they run on stack workers only.
STACK_FILES = ("tests/integration/", "tests/e2e/", "tests/browser/")
STACK_WORKERS = 2
# How much a worker that starts no stack yields the CPU (os.nice): its files are CPU work with no deadline, while a
# stack test waits on deadlines that its stack must meet. On a machine slower than usual (a busy host), at equal
# priority the unit files took the CPU that the stacks' emulators needed to answer their pulls in time.
NON_STACK_NICENESS = 10


def yield_the_cpu_without_a_stack() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and int(worker.removeprefix("gw")) >= STACK_WORKERS:
        os.nice(NON_STACK_NICENESS)


def may_take(worker_index: int, scopes: list[str]) -> list[str]:
    """The files a worker may take, in the order it takes them: a stack worker the stack files first (no other
    worker may run them), then the rest; any other worker only the files that need no stack."""
    stack_files = [scope for scope in scopes if needs_stack(scope)]
    rest = [scope for scope in scopes if not needs_stack(scope)]
    return stack_files + rest if worker_index < STACK_WORKERS else rest


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class StackWorkersScheduling(LoadFileScheduling):
        """`--dist loadfile`, each worker taking the next file it may run (`may_take`)."""

        def _may_take(self, node) -> list[str]:
            return may_take(int(node.gateway.id.removeprefix("gw")), list(self.workqueue))

        def _assign_work_unit(self, node) -> None:
            if not (scopes := self._may_take(node)):
                return
            work_unit = self.workqueue.pop(scopes[0])
            self.assigned_work.setdefault(node, {})[scopes[0]] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self._may_take(node):
                node.shutdown()  # after what it holds
                return
            if self._pending_of(self.assigned_work[node]) > 2:
                return
            self._assign_work_unit(node)

    return StackWorkersScheduling(config, log)


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
    yield_the_cpu_without_a_stack()
    path = config.getoption("--write-file-seconds")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(FileSeconds(Path(path)), "file-seconds")
