"""Every `make bench` scenario of the worker's code alone runs: `bench.suite --smoke --part in-process` (each
scenario's own code at its smallest size, in processes of their own, no stack: the tiny models built where missing),
so a scenario that crashes fails the tests. It needs no stack, so it runs beside the stack tests, not after them.
The scenarios through the stack: tests/integration/test_bench_scenarios.py."""

from __future__ import annotations

from tests.bench_smoke import run_smoke


def test_every_in_process_bench_scenario_runs_at_its_smallest_size(tmp_path):
    result, printed = run_smoke("in-process", tmp_path)
    assert "No stack" in printed, printed[-8000:]
    assert result["rows"] == []  # no scenario through an API
    for section in ("direct", "step_caches", "edit_scheduling"):
        assert result[section], section
    assert set(result["step_caches"]) == {"flux.first_block", "flux.taylorseer", "sd35.first_block", "sd15.deepcache"}
    assert set(result["edit_scheduling"]["mixes"]) == {"inpaint", "edit"}  # both schedulings of each ran
    assert list(result["open_loop"]) == ["in process (worker stages, tiny pipeline)"], result["open_loop"].keys()
