"""The batch input reader: a stream read in chunks, memory flat whatever the file's size, resumable by offset."""

from __future__ import annotations

import io
import json
import tracemalloc

from api_server.batches.lines import read_lines

LINES = 60_000  # about 6 MB of JSONL, never held


class GeneratedFile(io.RawIOBase):
    """A JSONL file produced as it is read (so the test itself holds none of it)."""

    def __init__(self, lines: int) -> None:
        self._next, self._lines, self._pending = 0, lines, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self._pending and self._next < self._lines:
            stop = min(self._lines, self._next + 500)
            self._pending = b"".join(line(index) for index in range(self._next, stop))
            self._next = stop
        size = min(len(buffer), len(self._pending))
        buffer[:size], self._pending = self._pending[:size], self._pending[size:]
        return size


def line(index: int) -> bytes:
    body = {"custom_id": f"c{index}", "model": "noop", "instances": [{"prompt": f"a prompt number {index:08d}"}]}
    return json.dumps(body).encode() + b"\n"


def test_a_large_file_is_read_line_by_line_with_flat_memory():
    stream = io.BufferedReader(GeneratedFile(LINES), buffer_size=64 * 1024)
    tracemalloc.start()
    count, last = 0, None
    for item in read_lines(stream, 0, 0, 8 * 1024 * 1024):
        count, last = count + 1, item
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == LINES and last is not None and last.number == LINES
    assert last.end_offset == sum(len(line(index)) for index in range(LINES))
    assert peak < 1536 * 1024, f"peak {peak / 1e6:.1f} MB while reading {last.end_offset / 1e6:.0f} MB"


def test_reading_resumes_at_a_lines_end_offset_and_skips_blank_lines():
    data = line(0) + b"\n  \n" + line(1) + line(2) + line(3).rstrip(b"\n")
    lines = list(read_lines(io.BytesIO(data), 0, 0, 1024))
    assert [item.number for item in lines] == [1, 2, 3, 4]
    assert [json.loads(item.data)["custom_id"] for item in lines] == ["c0", "c1", "c2", "c3"]
    assert [data[item.start_offset : item.end_offset].strip() for item in lines] == [item.data for item in lines]
    resumed = io.BytesIO(data)
    resumed.seek(lines[1].end_offset)
    rest = list(read_lines(resumed, lines[1].end_offset, 2, 1024))
    assert [(item.number, item.end_offset, item.data) for item in rest] == [
        (item.number, item.end_offset, item.data) for item in lines[2:]
    ]


def test_a_line_over_the_limit_is_reported_without_being_held():
    long = b'{"custom_id": "big", "x": "' + b"y" * 5000 + b'"}\n'
    data = line(0) + long + line(1)
    lines = list(read_lines(io.BufferedReader(io.BytesIO(data), 100), 0, 0, 1000))
    assert [item.number for item in lines] == [1, 2, 3]
    assert lines[1].data is None and lines[1].end_offset == len(line(0)) + len(long)
    assert lines[1].start_offset == len(line(0)) and lines[2].start_offset == lines[1].end_offset
    assert json.loads(lines[2].data)["custom_id"] == "c1"
