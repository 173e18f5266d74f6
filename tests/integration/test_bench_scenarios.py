"""Every `make bench` scenario through the stack runs: the suite itself (`bench.suite --smoke --part service`, each
scenario's own code at its smallest size) against this session's stack, so a scenario that crashes fails the tests,
not the next person's benchmark. The scenarios of the worker's code alone: tests/unit/test_bench_in_process.py."""

from __future__ import annotations

from tests.bench_smoke import run_smoke


def test_every_bench_scenario_through_the_stack_runs_at_its_smallest_size(stack, tmp_path):
    env = {"MAAS_STACK_DIR": str(stack.stack_dir), "MAAS_STACK_PORT_OFFSET": str(stack.port_offset)}
    result, printed = run_smoke("service", tmp_path, env)
    # This session's stack, not one of the bench's own: the suite's first line, past the tail a long log keeps.
    assert "Using the running stack" in printed, printed[-8000:]
    scenarios = {(row["scenario"], row["mode"]) for row in result["rows"]}
    assert {("pubsub floor", None), ("naive per-request", None), ("noop", "per-instance"), ("sleep", "per-instance"),
            ("sd15-txt2img", "per-instance"), ("noop", "per-request"), ("noop cache hits", "per-instance"),
            ("noop async job submit-to-result", "per-instance")} <= scenarios, scenarios  # fmt: skip
    for section in ("adapters", "event_streams", "batches", "batch_beside", "flows"):
        assert result[section], section
    for section in ("direct", "step_caches", "edit_scheduling"):  # the in-process part's
        assert result[section] is None, section
    assert {family["family"] for family in result["adapters"]["families"]} == {"sd15", "flux"}  # the smoke's two
    assert list(result["open_loop"]) == ["whole system (API, Pub/Sub, worker)"], result["open_loop"].keys()
