"""The inference log writer: rows go to disk first, are sent in order at fixed offsets, and are never doubled."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from api_server.inference_log.bigquery_write import RowsRejectedError, StreamLostError, row_descriptor
from api_server.inference_log.spool import LogSpool, SpoolFullError
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter
from contract.log_schema import log_schema_fields


class FakeStream:
    """Behaves like a COMMITTED write stream: an append at an already committed offset is a no-op."""

    def __init__(self, fail: int = 0, commit_then_fail: int = 0) -> None:
        self.stream: str | None = None
        self.next_offset = 0
        self.rows: list[dict] = []
        self.committed: dict[tuple[str, int], int] = {}
        self.fail, self.commit_then_fail = fail, commit_then_fail
        self.streams = 0

    def open_stream(self) -> str:
        if self.stream is None:
            self.streams += 1
            self.stream, self.next_offset = f"stream-{self.streams}", 0
        return self.stream

    def forget_stream(self) -> None:
        self.stream = None

    def written_request_ids(self, rows: list[dict]) -> set[str]:
        return {row["request_id"] for row in rows} & {row["request_id"] for row in self.rows}

    def append(self, rows: list[dict], stream: str, offset: int) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("bigquery unreachable")
        if (stream, offset) not in self.committed:
            self.committed[(stream, offset)] = len(rows)
            self.rows.extend(rows)
        if self.commit_then_fail:
            self.commit_then_fail -= 1
            raise TimeoutError("the answer was lost")
        if stream == self.stream:
            self.next_offset = max(self.next_offset, offset + len(rows))


def row(request_id: str, **extra) -> InferenceLogRow:
    return InferenceLogRow(
        request_id=request_id, created_at=datetime.now(UTC), model="m", status="ok", http_status=200, **extra
    )


def writer(tmp_path, sink, **kwargs) -> InferenceLogWriter:
    return InferenceLogWriter(sink, LogSpool(tmp_path, kwargs.pop("max_bytes", 1 << 20)), spool_interval=60, **kwargs)


def test_rows_are_written_once_even_when_a_committed_append_times_out(tmp_path):
    sink = FakeStream(commit_then_fail=1)
    log_writer = writer(tmp_path, sink)
    log_writer.write(row("a"))
    log_writer.write(row("b"))
    log_writer.spool_queued()
    assert not log_writer.send_spooled()  # the answer was lost; the rows stay on disk
    assert log_writer.send_spooled()  # the retry at the same offset is recognised as the same batch
    assert [r["request_id"] for r in sink.rows] == ["a", "b"]
    assert list(tmp_path.glob("*.jsonl")) == []
    log_writer.close()


def test_rows_wait_on_disk_while_bigquery_is_down_and_go_in_order(tmp_path):
    sink = FakeStream(fail=3)
    log_writer = writer(tmp_path, sink)
    for batch in (["a", "b"], ["c"], ["d"]):
        for request_id in batch:
            log_writer.write(row(request_id))
        log_writer.spool_queued()
        log_writer.send_spooled()
    assert sink.rows == [] and len(list(tmp_path.glob("*.jsonl"))) == 3
    assert log_writer.send_spooled()
    assert [r["request_id"] for r in sink.rows] == ["a", "b", "c", "d"]
    assert sink.committed == {("stream-1", 0): 2, ("stream-1", 2): 1, ("stream-1", 3): 1}
    log_writer.close()


def test_a_lost_stream_is_replaced_and_the_rows_resent(tmp_path):
    class LosingStream(FakeStream):
        lost = True

        def append(self, rows, stream, offset):
            if self.lost:
                self.lost = False
                raise StreamLostError("stream forgotten by a restart")
            super().append(rows, stream, offset)

    sink = LosingStream()
    log_writer = writer(tmp_path, sink)
    log_writer.write(row("a"))
    log_writer.spool_queued()
    assert not log_writer.send_spooled() and log_writer.send_spooled()
    assert sink.committed == {("stream-2", 0): 1}
    log_writer.close()


def test_rows_committed_just_before_their_stream_was_lost_are_not_written_again(tmp_path):
    class CommitThenLose(FakeStream):
        """The first append is committed, then the server restarts: its answer and its stream are gone."""

        def append(self, rows, stream, offset):
            if self.streams == 1 and (stream, offset) in self.committed:
                raise StreamLostError("Stream not found")
            super().append(rows, stream, offset)
            if len(self.committed) == 1 and self.streams == 1:
                raise ConnectionError("the server went away before answering")

    sink = CommitThenLose()
    log_writer = writer(tmp_path, sink)
    log_writer.write(row("a"))
    log_writer.write(row("b"))
    log_writer.spool_queued()
    assert not log_writer.send_spooled()  # committed, answer lost
    assert not log_writer.send_spooled()  # the retry at the same offset: the stream is gone
    log_writer.write(row("c"))
    log_writer.spool_queued()
    assert log_writer.send_spooled()
    assert sorted(r["request_id"] for r in sink.rows) == ["a", "b", "c"]
    assert list(tmp_path.glob("*.jsonl")) == []
    log_writer.close()


def test_a_lost_streams_segment_sends_only_the_rows_the_table_lacks(tmp_path):
    sink = FakeStream()
    log_writer = writer(tmp_path, sink)
    for request_id in ("a", "b", "c"):
        log_writer.write(row(request_id))
    log_writer.spool_queued()
    [segment] = log_writer._spool.pending()
    sink.rows.append({"request_id": "b"})  # b reached the table before the stream was lost
    segment.mark_stream_lost()
    assert log_writer.send_spooled()
    assert [r["request_id"] for r in sink.rows] == ["b", "a", "c"]
    assert sink.committed == {("stream-1", 0): 2}
    log_writer.close()


def test_rows_spooled_by_a_process_that_died_are_sent_by_the_next_one(tmp_path):
    # A child process spools a row and is killed before sending it: its lock is released with it.
    code = (
        "import os, sys; from pathlib import Path; from api_server.inference_log.spool import LogSpool;"
        "LogSpool(Path(sys.argv[1]), 1 << 20).append([{'request_id': 'orphan'}]); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=os.getcwd())
    sink = FakeStream()
    log_writer = writer(tmp_path, sink)
    assert log_writer.send_spooled()
    assert [r["request_id"] for r in sink.rows] == ["orphan"]
    log_writer.close()


def test_a_live_writers_segments_are_not_taken_by_another(tmp_path):
    first, second = LogSpool(tmp_path, 1 << 20), LogSpool(tmp_path, 1 << 20)
    first.append([{"request_id": "mine"}])
    assert second.pending() == [] and len(first.pending()) == 1


def test_close_spools_what_is_queued_when_bigquery_is_down(tmp_path):
    sink = FakeStream(fail=100)
    log_writer = writer(tmp_path, sink)
    log_writer.write(row("kept"))
    log_writer.close(send_seconds=0.1)
    assert sink.rows == []
    [segment] = tmp_path.glob("*.jsonl")
    assert '"kept"' in segment.read_text()


def test_a_full_spool_refuses_rows_loudly(tmp_path, caplog):
    spool = LogSpool(tmp_path, max_bytes=10)
    with pytest.raises(SpoolFullError):
        spool.append([{"request_id": "too big for ten bytes"}])
    log_writer = writer(tmp_path, FakeStream(), max_bytes=10)
    log_writer.write(row("dropped"))
    with caplog.at_level(logging.ERROR):
        log_writer.spool_queued()
    assert log_writer.stats["dropped_spool_full"] == 1
    assert any("dropped" in r.fields["inference_log_row"] for r in caplog.records if hasattr(r, "fields"))
    log_writer.close(send_seconds=0.1)


def test_an_invalid_row_is_logged_in_full_and_does_not_block_the_others(tmp_path, caplog):
    sink = FakeStream()
    log_writer = writer(tmp_path, sink)
    with caplog.at_level(logging.ERROR):
        log_writer.write(row("bad", width="wide"))
    log_writer.write(row("good"))
    log_writer.spool_queued()
    assert log_writer.send_spooled()
    assert [r["request_id"] for r in sink.rows] == ["good"] and log_writer.stats["invalid"] == 1
    [record] = [r for r in caplog.records if r.getMessage().startswith("invalid inference log row bad")]
    assert "wide" in record.fields["inference_log_row"]
    log_writer.close()


def test_rows_bigquery_rejects_are_logged_in_full_and_the_rest_go_on(tmp_path, caplog):
    class RejectingStream(FakeStream):
        def append(self, rows, stream, offset):
            if any(r["request_id"] == "rejected" for r in rows):
                raise RowsRejectedError("row 0: bad value")
            super().append(rows, stream, offset)

    sink = RejectingStream()
    log_writer = writer(tmp_path, sink)
    log_writer.write(row("rejected"))
    log_writer.spool_queued()
    log_writer.write(row("fine"))
    log_writer.spool_queued()
    with caplog.at_level(logging.ERROR):
        assert log_writer.send_spooled()
    assert [r["request_id"] for r in sink.rows] == ["fine"]
    assert any("rejected" in getattr(r, "fields", {}).get("inference_log_row", "") for r in caplog.records)
    log_writer.close()


def test_the_write_api_row_message_has_every_schema_column():
    assert [field.name for field in row_descriptor().field] == [field["name"] for field in log_schema_fields()]


def test_a_row_written_after_close_goes_straight_to_the_spool(tmp_path):
    log_writer = writer(tmp_path, FakeStream(fail=100))
    log_writer.close(send_seconds=0.1)
    assert log_writer.closed
    log_writer.write(row("late"))
    [segment] = tmp_path.glob("*.jsonl")
    assert '"late"' in segment.read_text()
