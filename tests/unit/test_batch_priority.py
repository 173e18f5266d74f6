"""Batch lines (issue 35) on one worker: an interactive request never waits behind them, in the pool, in a step
running set, or behind a request-level call; a batch line that gives way is resumed or re-run, answered once."""

from __future__ import annotations

import threading

import pytest

from contract import naming
from contract.settings import Settings
from model_worker.held.pool import RequestPool
from model_worker.model.runners import SyntheticRunner
from tests.unit.test_step_scheduler import CATALOG, SLEEP_STEP, Worker, request

SLEEP = CATALOG.get("sleep")  # request-scheduled, max_batch_size 8
WIDE_STEP = SLEEP_STEP.model_copy(update={"name": "wide"})  # another batch key: another model in one worker


class Recording:
    """A synthetic runner recording which requests shared each denoising call; `after[n]` runs once call n is done."""

    def __init__(self, spec, call_seconds: float = 0.0) -> None:
        self.runner = SyntheticRunner(spec, call_seconds=call_seconds)
        self.calls: list[set[str]] = []
        self.after: dict[int, callable] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def denoise_step(self, running) -> None:
        self.runner.denoise_step(running)
        with self._lock:
            self.calls.append({r.item.prompt.split()[0] for r in running})
        if hook := self.after.pop(len(self.calls), None):
            hook()

    def first_call_with(self, request_id: str) -> int:
        return next(index for index, ids in enumerate(self.calls, 1) if request_id in ids)

    def last_call_with(self, request_id: str) -> int:
        return max(index for index, ids in enumerate(self.calls, 1) if request_id in ids)


# The pool.


def test_batch_lines_are_pulled_only_into_an_empty_pool_and_never_shrink_an_interactive_pulls_room():
    pool = RequestPool(capacity=8)
    assert pool.room("batch") == 8
    for index in range(8):
        pool.add(request(f"b{index}", SLEEP, priority="batch"))
    assert pool.room("batch") == 0
    assert pool.room("normal") == 8 and pool.room("high") == 8  # held batch lines take no interactive room
    pool.take_batch(timeout=0)
    pool.add(request("n", SLEEP))
    assert pool.room("batch") == 0, "a waiting interactive request: no batch line is leased meanwhile"
    pool.take_batch(timeout=0)
    assert pool.room("batch") == 8
    pool.interactive_running(True)
    assert pool.room("batch") == 0, "an interactive request running: batch lines are left to idle workers"
    pool.interactive_running(False)
    assert pool.room("batch") == 8


def test_the_oldest_batch_line_is_chosen_after_the_newest_interactive_request():
    pool = RequestPool(capacity=2)
    pool.add(request("batch-old", SLEEP, priority="batch"))
    pool.add(request("batch-older-wide", WIDE_STEP, priority="batch"))
    pool.add(request("normal-new", SLEEP))
    pool.add(request("high-new", SLEEP, priority="high"))
    assert pool.first_interactive().request_id == "high-new"
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["high-new", "normal-new"]  # two images: the batch line is left out
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["batch-old"] and pool.first_interactive() is None


def test_batch_images_bound_what_an_interactive_worker_holds_and_runs_of_batch_lines():
    pool = RequestPool(capacity=8, batch_images=1)
    assert pool.room("batch") == 1 and pool.room("normal") == 8
    for index in range(3):
        pool.add(request(f"b{index}", SLEEP, priority="batch"))
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["b0"]  # one at a time
    pool.add(request("n0", SLEEP))
    pool.add(request("n1", SLEEP))
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["n0", "n1"]  # interactive requests still batch together


def test_a_running_set_takes_batch_lines_up_to_its_batch_images():
    runner = Recording(SLEEP_STEP)
    lines = [request(f"line-{i}", SLEEP_STEP, steps=2, priority="batch") for i in range(3)]
    worker = Worker({SLEEP_STEP.name: runner})
    worker.loop._pool = worker.pool = RequestPool(8, batch_images=2)  # before its device thread starts
    with worker:
        for line in lines:
            worker.pool.add(line)
        worker.outcomes.wait(3)
    assert max(len(ids) for ids in runner.calls) == 2
    answered_once(worker, [line.request_id for line in lines])


def test_joiners_are_taken_interactive_first_and_batch_lines_only_when_asked():
    pool = RequestPool(capacity=8)
    key = request("x", SLEEP_STEP).batch_key
    pool.add(request("batch", SLEEP_STEP, priority="batch"))
    pool.add(request("normal", SLEEP_STEP))
    joiners, _ = pool.take_joiners(key, room=8, interactive=True)
    assert [p.request_id for p in joiners] == ["normal"]
    joiners, _ = pool.take_joiners(key, room=8, interactive=False)
    assert [p.request_id for p in joiners] == ["batch"]


# The step running set.


def answered_once(worker: Worker, ids: list[str]) -> None:
    outcomes = worker.outcomes
    assert sorted(outcomes.images) == sorted(ids), "every request answered with its images"
    assert outcomes.answered == {} and outcomes.released == [], "none answered twice, failed or handed back"


def test_batch_lines_step_aside_for_an_interactive_request_and_resume_where_they_paused():
    runner = Recording(SLEEP_STEP)
    lines = [request(f"line-{i}", SLEEP_STEP, steps=6, priority="batch") for i in range(4)]
    interactive = request("interactive", SLEEP_STEP, steps=3)
    later = request("later", SLEEP_STEP, steps=2)
    with Worker({SLEEP_STEP.name: runner}) as worker:
        runner.after[2] = lambda: worker.pool.add(interactive)
        runner.after[3] = lambda: worker.pool.add(later)  # an interactive request joining the interactive one
        for line in lines:
            worker.pool.add(line)
        worker.outcomes.wait(6)
    everything = {f"line-{i}" for i in range(4)}
    # It runs from the very next step, never sharing a step with a batch line; the lines go on where they were.
    assert runner.calls == [everything] * 2 + [{"interactive"}] + [{"interactive", "later"}] * 2 + [everything] * 4
    answered_once(worker, [*(line.request_id for line in lines), "interactive", "later"])


class DecodeRecording(Recording):
    """Also records each decode call's requests, in one list with the steps; `after_decode[n]` runs after decode n."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.events: list[tuple[str, list[str]]] = []
        self.after_decode: dict[int, callable] = {}
        self.after_start: dict[int, callable] = {}

    def denoise_step(self, running) -> None:
        super().denoise_step(running)
        self.events.append(("step", sorted(self.calls[-1])))

    def start_items(self, items, params) -> list:
        self.events.append(("start", [item.prompt.split()[0] for item in items]))
        starts = sum(kind == "start" for kind, _ in self.events)
        if hook := self.after_start.pop(starts, None):
            hook()
        return self.runner.start_items(items, params)

    def decode(self, running) -> list:
        self.events.append(("decode", [r.item.prompt.split()[0] for r in running]))
        decodes = sum(kind == "decode" for kind, _ in self.events)
        if hook := self.after_decode.pop(decodes, None):
            hook()
        return self.runner.decode(running)


def test_finished_batch_lines_decode_one_at_a_time_and_give_way_to_an_interactive_request_between_them():
    """A full batch of lines finishing together would hold the device for its whole decode (8 images: about 4.6 s
    on an L4 at 512x512); an interactive request arriving meanwhile waits for one line's decode at most."""
    runner = DecodeRecording(SLEEP_STEP)
    lines = [request(f"line-{i}", SLEEP_STEP, steps=2, priority="batch") for i in range(4)]
    interactive = request("interactive", SLEEP_STEP, steps=2)
    worker = Worker({SLEEP_STEP.name: runner})
    runner.after_decode[1] = lambda: worker.pool.add(interactive)
    for line in lines:  # held before the device thread starts: one running set of the four
        worker.pool.add(line)
    with worker:
        worker.outcomes.wait(5)
    everything = sorted(f"line-{i}" for i in range(4))
    assert [event for event in runner.events if event[0] != "start"] == [
        ("step", everything), ("step", everything), ("decode", ["line-0"]),
        ("step", ["interactive"]), ("step", ["interactive"]), ("decode", ["interactive"]),
        ("decode", ["line-1"]), ("decode", ["line-2"]), ("decode", ["line-3"]),
    ]  # fmt: skip
    answered_once(worker, [*(line.request_id for line in lines), "interactive"])


def test_batch_lines_not_started_yet_go_back_to_the_pool_when_an_interactive_request_waits():
    """A set of batch lines starts one line at a time (prompt and input-image encoding); an interactive request
    arriving meanwhile waits for one line's encode, not the set's: the lines not started are held again (leased)."""
    runner = DecodeRecording(SLEEP_STEP)
    lines = [request(f"line-{i}", SLEEP_STEP, steps=2, priority="batch") for i in range(4)]
    interactive = request("interactive", SLEEP_STEP, steps=2)
    worker = Worker({SLEEP_STEP.name: runner})
    runner.after_start[1] = lambda: worker.pool.add(interactive)
    for line in lines:
        worker.pool.add(line)
    with worker:
        worker.outcomes.wait(5)
    everything = sorted(f"line-{i}" for i in range(4))
    assert runner.events == [
        ("start", ["line-0"]), ("start", ["interactive"]), ("step", ["interactive"]), ("step", ["interactive"]),
        ("decode", ["interactive"]), ("start", ["line-1"]), ("start", ["line-2"]), ("start", ["line-3"]),
        ("step", everything), ("step", everything),
        ("decode", ["line-0"]), ("decode", ["line-1"]), ("decode", ["line-2"]), ("decode", ["line-3"]),
    ]  # fmt: skip
    answered_once(worker, [*(line.request_id for line in lines), "interactive"])


def test_an_interactive_request_of_another_size_pauses_every_batch_line_and_runs_next():
    runner = Recording(SLEEP_STEP)
    wide = Recording(WIDE_STEP)
    lines = [request(f"line-{i}", SLEEP_STEP, steps=5, priority="batch") for i in range(2)]
    interactive = request("interactive", WIDE_STEP, steps=3)
    with Worker({SLEEP_STEP.name: runner, WIDE_STEP.name: wide}) as worker:
        runner.after[1] = lambda: worker.pool.add(interactive)
        for line in lines:
            worker.pool.add(line)
        worker.outcomes.wait(3)
        finished = dict(worker.outcomes.fields)
    # The batch lines stopped after one step, the interactive request ran its 3 alone, then the lines went on.
    assert runner.calls == [{"line-0", "line-1"}] * 5 and wide.calls == [{"interactive"}] * 3
    assert finished["interactive"]["worker_finished_ms"] <= finished["line-0"]["worker_finished_ms"]
    answered_once(worker, ["line-0", "line-1", "interactive"])


def test_a_draining_worker_hands_its_running_batch_lines_back_at_once():
    runner = Recording(SLEEP_STEP)
    line = request("line", SLEEP_STEP, steps=6, priority="batch")
    worker = Worker({SLEEP_STEP.name: runner})
    runner.after[1] = worker.loop.stopping.set  # SIGTERM (a scale-down, a Spot preemption: 15 s)
    worker.pool.add(line)
    thread = threading.Thread(target=worker.loop.run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    # Not run on for 5 more steps: back to Pub/Sub unanswered, for another worker (the results store answers once).
    assert runner.calls == [{"line"}] and worker.outcomes.released == ["ack-line"] and worker.outcomes.images == {}


# Request scheduling.


def test_a_call_of_batch_lines_stops_for_an_interactive_request_and_its_lines_run_again_after_it():
    runner = SyntheticRunner(SLEEP, call_seconds=1.0)  # 10 steps of 0.1 s
    lines = [request(f"line-{i}", SLEEP, priority="batch") for i in range(3)]
    interactive = request("interactive", SLEEP)
    with Worker({SLEEP.name: runner}) as worker:
        for line in lines:
            worker.pool.add(line)
        threading.Timer(0.15, worker.pool.add, [interactive]).start()
        worker.outcomes.wait(4)
    fields = worker.outcomes.fields
    # Started at a step boundary of the batch lines' call, not after it: before any line finished (events of one
    # process, a step or more apart, so their order is not a question of the machine's speed).
    assert fields["interactive"]["worker_started_ms"] < min(
        fields[line.request_id]["worker_finished_ms"] for line in lines
    )
    assert all(fields[line.request_id]["worker_started_ms"] >= fields["interactive"]["worker_finished_ms"]
               for line in lines)  # fmt: skip
    answered_once(worker, [*(line.request_id for line in lines), "interactive"])


# Which subscriptions a worker pulls.


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, ("high", "normal", "batch")), ("batch", ("batch",)), ("batch, high", ("high", "batch"))],
)
def test_a_worker_pulls_the_priorities_it_is_told(value, expected):
    env = {} if value is None else {"MAAS_WORKER_PRIORITIES": value}
    assert Settings.from_env(env).worker_priorities == expected
    assert Settings.from_env(env).batch_images == 0  # full batches (each model's max_batch_size) by default
    assert Settings.from_env({"MAAS_BATCH_IMAGES": "1"}).batch_images == 1
    assert naming.worker_subscription("m", "batch") == "maas-requests-m-batch-workers"


def test_an_unknown_priority_is_refused():
    with pytest.raises(ValueError, match="MAAS_WORKER_PRIORITIES"):
        Settings.from_env({"MAAS_WORKER_PRIORITIES": "low"})
