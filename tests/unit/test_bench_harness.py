"""The benchmark harness's own arithmetic: percentiles, the closed loop's concurrency, the time breakdown."""

from __future__ import annotations

import threading
import time

import pytest

from bench.admin_ops import difference, sustainable_rps
from bench.breakdown import STAGES, stages
from bench.loadgen import Sample, mean_in_flight, percentile, run_closed_loop, summarize


def test_percentiles_interpolate_between_closest_ranks():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile([7.0], 0.95) == 7.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


def test_the_closed_loop_holds_exactly_its_concurrency():
    """Every slot busy at once and never more than the concurrency in flight: checked by counting, not by a rate."""
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    # Each thread's first call waits here until all four are in flight together: every slot is busy.
    all_in_flight = threading.Barrier(4, timeout=60)
    callers: set[str] = set()

    def make_caller():
        first = [True]

        def call(_number: int) -> Sample:
            started = time.perf_counter()
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                callers.add(threading.current_thread().name)
            if first[0]:
                first[0] = False
                all_in_flight.wait()
            with lock:
                state["now"] -= 1
            return Sample(started, time.perf_counter(), True)

        return call

    # A long window ended by the request count: the result does not depend on how fast the machine is.
    samples, _ = run_closed_loop(make_caller, concurrency=4, seconds=600, warmup_seconds=0, max_requests=40)
    assert state["most"] == 4 and not all_in_flight.broken
    assert callers == {f"load-{i}" for i in range(4)}
    assert len(samples) >= 40 and all(sample.ok for sample in samples)


def test_mean_in_flight_sums_each_requests_overlap_with_the_window():
    samples = [Sample(0.0, 2.0, True), Sample(1.0, 3.0, True), Sample(2.5, 10.0, True)]
    # Over (1, 3): 1 s + 2 s + 0.5 s of requests in flight in a 2 s window.
    assert mean_in_flight(samples, (1.0, 3.0)) == pytest.approx(1.75)
    assert mean_in_flight(samples, (3.0, 3.0)) == 0.0


def test_only_requests_completed_inside_the_window_count():
    samples = [
        Sample(0.0, 0.5, True),  # warm-up
        Sample(0.5, 1.5, True),
        Sample(1.5, 2.0, False, error="HTTP 500"),
        Sample(1.9, 3.5, True),  # after the window
    ]
    summary = summarize(samples, (1.0, 3.0), concurrency=1)
    assert summary["requests"] == 2 and summary["errors"] == 1
    assert summary["rps"] == pytest.approx(0.5)
    assert summary["p50_ms"] == pytest.approx(1000)


def test_a_max_request_count_stops_the_loop_early():
    def make_caller():
        return lambda _n: Sample(time.perf_counter(), time.perf_counter() + 0.001, True)

    # Ended by the count, not by its window: 50 instant calls end far inside 60 s, however busy the machine is.
    samples, window = run_closed_loop(make_caller, 2, seconds=120, warmup_seconds=0, max_requests=50)
    assert window[1] - window[0] < 60
    assert 50 <= len(samples) <= 52


def test_stages_add_up_to_the_client_latency():
    timings = {"total": 90, "subscribe": 5, "publish": 4, "wait": 78, "cleanup": 2, "queue": 30, "inference": 20}
    split = stages(100.0, timings)
    assert list(split) == list(STAGES)
    assert sum(split.values()) == pytest.approx(100.0)
    assert split["to worker"] == 21 and split["reply"] == 37 and split["http"] == 10


def test_admin_operations_turn_into_a_sustainable_rate():
    assert difference({"create_subscription": 3}, {"create_subscription": 5, "delete_subscription": 2}) == {
        "create_subscription": 2,
        "delete_subscription": 2,
    }
    assert sustainable_rps(2.0) == pytest.approx(50)
    assert sustainable_rps(0.001) is None


def test_the_gpu_benchs_quantization_comparison_runs_on_the_tiny_flux_pipeline_on_a_cpu(tmp_path, monkeypatch):
    """`bench/gpu_pipeline.py --quantization` (its smoke test: the real-size run needs a GPU): the tiny FLUX.1
    pipeline in the serving dtype and int8 weight-only, compiled (torch.compile's eager backend on a CPU; the eager
    runner's quantization is tests/unit/test_quantization.py's), timed and written to its JSON; float8_dynamic is
    reported refused there, not failed."""
    import json
    import sys

    from bench import gpu_pipeline

    out = tmp_path / "gpu.json"
    argv = ["gpu_pipeline", "--family", "flux", "--tiny", "--size", "64", "--steps", "2", "--calls", "1",
            "--stages", "compiled", "--quantization", "int8_weight_only", "float8_dynamic",
            "--workdir", str(tmp_path), "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert gpu_pipeline.main() == 0
    rows = json.loads(out.read_text())["quantization"]["flux-tiny"]["rows"]
    assert [(row["quantization"], row["compiled"]) for row in rows] == [
        ("none", True),
        ("int8_weight_only", True),
        ("float8_dynamic", True),
    ]
    assert all(row["s_per_image"] > 0 and row["steps"] == 2 for row in rows[:2])
    assert "compute capability 8.9" in rows[2]["refused"]


def test_the_event_stream_bench_names_its_paused_worker_through_the_stacks_lookup(tmp_path):
    from bench.api_event_streams import PAUSED_MODEL
    from emulators.stack import StackConfig, worker_components, worker_name

    config = StackConfig(stack_dir=tmp_path, worker_replicas=2)
    names = {component.name for component in worker_components(config)}
    assert worker_name(config, PAUSED_MODEL) in names
    assert worker_name(config, "sleep", replica=2) in names and worker_name(config, "sleep").startswith("worker-")
    with pytest.raises(KeyError):
        worker_name(config, "no-such-model")


def test_a_scenario_that_could_not_run_fails_the_bench(capsys):
    from bench.suite import exit_status

    assert exit_status([]) == 0
    assert exit_status(["event streams"]) == 1
    assert "event streams" in capsys.readouterr().err


@pytest.mark.parametrize("outcome", ["exit 1", "timeout"])
def test_interactive_beside_a_batch_is_in_the_suite_and_its_failure_fails_the_bench(tmp_path, monkeypatch, outcome):
    import subprocess
    from types import SimpleNamespace

    from bench import suite as bench_suite
    from emulators.stack import StackConfig

    ran = []

    def run(argv, **kwargs):
        ran.append(argv)
        if outcome == "timeout":
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        return SimpleNamespace(returncode=1, stdout="", stderr="no stack")

    monkeypatch.setattr(bench_suite.subprocess, "run", run)
    suite = bench_suite.Suite(StackConfig(stack_dir=tmp_path), quick=True, out_dir=tmp_path)
    assert suite.batch_beside() is None
    assert ran[0][2] == "bench.batch_beside" and ran[0][-2:] == ["--rounds", "1"]
    assert suite.failed == ["interactive beside a batch"] and bench_suite.exit_status(suite.failed) == 1


class BesideStandIns:
    """The SDK's clients as bench/batch_beside.py calls them: every predict a 200; the batch ends after `lasts` GETs
    or once `total` predicts were sent."""

    def __init__(self, lasts: int, total: int) -> None:
        from types import SimpleNamespace

        self.gets, self.lasts, self.total, self.predicts, self.cancelled = 0, lasts, total, 0, []
        self.batches = SimpleNamespace(create=self.create, get=self.get, cancel=self.cancelled.append)

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def raw(self, method: str, path: str, json: dict):
        from types import SimpleNamespace

        self.predicts += 1
        return SimpleNamespace(status_code=200, text="")

    def create(self, requests: list[dict]):
        from types import SimpleNamespace

        assert len(requests) == 10
        return SimpleNamespace(id="batch-1")

    def get(self, batch_id: str):
        from types import SimpleNamespace

        self.gets += 1
        counts = SimpleNamespace(succeeded=self.gets)
        ended = self.gets > self.lasts or self.predicts >= self.total
        return SimpleNamespace(request_counts=counts, ended=ended, status="completed" if ended else "in_progress")


def test_the_beside_scenario_reports_both_runs_and_fails_when_the_batch_ends_too_soon(monkeypatch):
    from bench import batch_beside

    stand_ins = BesideStandIns(lasts=100, total=12)
    monkeypatch.setattr(batch_beside, "bench_client", stand_ins)
    monkeypatch.setattr(batch_beside, "Client", stand_ins)
    row = batch_beside.one_round("http://api", "sd15-txt2img", predicts=6, lines=10)
    assert stand_ins.predicts == 12 and stand_ins.cancelled == [] and row["batch_status"] == "completed"
    assert row["alone"]["count"] == row["beside"]["count"] == 6 and row["predicts_after_batch_ended"] == 0
    assert {"p50_ms", "p95_ms"} <= row["beside"].keys() and {"p50_ratio", "p95_ratio"} <= row.keys()

    short = BesideStandIns(lasts=3, total=12)  # ended after two predicts beside it
    monkeypatch.setattr(batch_beside, "bench_client", short)
    monkeypatch.setattr(batch_beside, "Client", short)
    with pytest.raises(batch_beside.ScenarioError, match="raise --lines"):
        batch_beside.one_round("http://api", "sd15-txt2img", predicts=6, lines=10)


class RestartingBackend:
    """A stand-in for the whole-system backend: one worker at a time, restarted for each change of scheduling."""

    mix = (4, 12)

    def __init__(self, restarts: bool) -> None:
        self.calls: list[tuple[str, str]] = []
        if restarts:
            self.active = None

    def lone(self, repeats, schedulings=("request", "step")):
        self.calls += [("lone", s) for s in schedulings]
        return {s: {"4": 100.0, "12": 300.0} for s in schedulings}

    def run(self, scheduling, arrivals, grace):
        self.calls.append(("run", scheduling))
        return {i: 0.1 for i in range(len(arrivals))}, 1.0

    def close(self):
        self.calls.append(("close", ""))


def test_the_system_sweep_starts_each_schedulings_worker_once():
    """Each scheduling's lone latency is measured right before its first run, so a backend that restarts its
    worker per scheduling restarts it once per scheduling, not three times (the bench smoke's longest scenario)."""
    from bench.open_loop import sweep

    backend = RestartingBackend(restarts=True)
    result = sweep(backend, (0.5, 1.0), requests=2, repeats=1, progress=lambda line: None)
    assert backend.calls == [("lone", "request"), ("run", "request"), ("lone", "step"), ("run", "step"),
                             ("run", "step"), ("run", "request"), ("close", "")]  # fmt: skip
    assert set(result["lone_ms"]) == {"request", "step"} and len(result["points"]["step"]) == 2
    in_process = RestartingBackend(restarts=False)  # both workers alive: lone latencies interleaved, first
    sweep(in_process, (1.0,), requests=2, repeats=1, progress=lambda line: None)
    assert in_process.calls[:2] == [("lone", "request"), ("lone", "step")]
