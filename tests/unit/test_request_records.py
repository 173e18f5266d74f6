"""A request's log row starts when the request arrived, as its job's `created_at` and its deadline do."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from api_server.inference_log.records import RequestRecords
from api_server.predict.serving import Mode


def test_a_row_opened_after_a_wait_for_a_thread_is_created_at_the_arrival():
    records = RequestRecords(None, None, None, "api-1", "per-request")  # open() touches none of them
    arrived = time.perf_counter() - 5.0  # waited 5 s for an API thread
    call = records.open("r1", "sleep", Mode.JOB, started=arrived)
    waited = (datetime.now(UTC) - call.row.created_at).total_seconds()
    assert 5.0 <= waited < 60.0  # 60: only a hang bound
    assert call.row.created_at.microsecond % 1000 == 0  # to the millisecond, as the job's and the worker's times


def test_a_jobs_created_at_is_its_rows_even_when_the_wall_clock_moves_meanwhile(monkeypatch):
    """The job's `created_at` is read off the row, not derived again from the arrival's perf_counter(): a wall clock
    adjusted in between (5 ms on a VM, a fresh-clone run) gave the job and its log row two times."""
    from api_server.predict import serving
    from api_server.predict.inference import PreparedRequest

    records = RequestRecords(None, None, None, "api-1", "per-request")
    call = records.open("r1", "sleep", Mode.SYNC, started=time.perf_counter() - 2.0)
    prepared = PreparedRequest("r1", None, None, None, [], "normal", None, received=call.started,
                               arrived_ms=call.arrived_ms)  # fmt: skip
    row_ms = call.row.created_at.timestamp() * 1000
    assert call.arrived_ms == row_ms
    real_time = time.time
    monkeypatch.setattr(serving.time, "time", lambda: real_time() + 0.005)  # the clock stepped 5 ms
    assert serving._arrival_ms(prepared) == row_ms
    assert serving._arrival_ms(PreparedRequest("r2", None, None, None, [], "normal", None,
                                               received=call.started)) != row_ms  # fmt: skip  # derived again: moved
