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
