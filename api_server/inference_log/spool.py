"""The inference log's write-ahead spool: every row is on local disk before it is sent to BigQuery.

Rows are appended in segments (one JSON-lines file per flush, fsynced, renamed into place), sent in
order, and deleted once BigQuery has them. A segment remembers the stream and offset it was first sent
at, so a retry is recognised by BigQuery as the same batch; when that stream is lost, the segment is
marked so, and before it goes to a new stream the rows the table already holds are dropped from it. Each process holds an flock on a lock file
of its own; segments whose owner's lock is free belong to a process that died, and are adopted and sent
by the next writer, so rows spooled before a crash are delivered after the restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
# The spool's size is re-read from the directory at most this often (a glob and a stat per segment: costly
# with a backlog); in between, this process adds what it appends. Other processes sharing the directory
# count from the next re-read, so the cap may be passed by what they append within this time.
SIZE_REFRESH_SECONDS = 1.0


@dataclass(frozen=True)
class Segment:
    path: Path

    @property
    def meta_path(self) -> Path:
        return self.path.with_suffix(".meta")

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def _meta(self) -> dict:
        try:
            return json.loads(self.meta_path.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def target(self) -> tuple[str, int] | None:
        """The (stream, offset) this segment was first sent at, if it was."""
        meta = self._meta()
        return (meta["stream"], meta["offset"]) if "stream" in meta else None

    def set_target(self, stream: str, offset: int) -> None:
        _write_durably(self.meta_path, json.dumps({"stream": stream, "offset": offset}).encode())

    def clear_target(self) -> None:
        self.meta_path.unlink(missing_ok=True)

    def mark_stream_lost(self) -> None:
        """Its stream is gone after an append whose outcome is unknown: some of its rows may be in the table."""
        _write_durably(self.meta_path, json.dumps({"stream_lost": True}).encode())

    def stream_lost(self) -> bool:
        return bool(self._meta().get("stream_lost"))

    def keep_only(self, rows: list[dict]) -> None:
        """Rewrites the segment with `rows` (those the table does not hold yet); it becomes a segment never sent."""
        data = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows).encode()
        _write_durably(self.path, data)
        self.clear_target()

    def remove(self) -> None:
        self.meta_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0


def _write_durably(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class SpoolFullError(Exception):
    """The spool reached its size cap: the rows were not kept."""


class LogSpool:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self.owner = uuid.uuid4().hex[:12]
        # Held for the life of the process: a free lock marks a dead owner's segments as adoptable.
        self._lock_file = open(directory / f"owner-{self.owner}.lock", "w")  # noqa: SIM115 - kept open on purpose
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._sequence = time.time_ns()
        self._guard = threading.Lock()
        self._known_size = 0
        self._size_read_at = -SIZE_REFRESH_SECONDS

    def append(self, rows: list[dict]) -> Segment:
        data = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows).encode()
        with self._guard:
            if time.monotonic() - self._size_read_at >= SIZE_REFRESH_SECONDS:
                self._known_size, self._size_read_at = self.size(), time.monotonic()
            if self._known_size + len(data) > self.max_bytes:
                self._size_read_at = -SIZE_REFRESH_SECONDS  # full: look again next time, rows may have been sent
                raise SpoolFullError(f"spool {self.directory} is full ({self.max_bytes} bytes)")
            self._sequence = max(self._sequence + 1, time.time_ns())
            segment = Segment(self.directory / f"{self._sequence:020d}-{self.owner}.jsonl")
            _write_durably(segment.path, data)
            self._known_size += len(data)
            return segment

    def size(self) -> int:
        return sum(segment.size() for segment in self._segments())

    def _segments(self) -> list[Segment]:
        return sorted((Segment(path) for path in self.directory.glob("*.jsonl")), key=lambda s: s.path.name)

    def pending(self) -> list[Segment]:
        """This process's segments and those of dead processes (adopted), oldest first."""
        pending = []
        for segment in self._segments():
            owner = segment.path.stem.split("-", 1)[1]
            if owner == self.owner:
                pending.append(segment)
            elif self._owner_dead(owner) and (adopted := self._claim(segment, owner)) is not None:
                pending.append(adopted)
        return pending

    def _claim(self, segment: Segment, owner: str) -> Segment | None:
        """Renames a dead owner's segment to ours: a rename succeeds for one process only."""
        claimed = Segment(segment.path.with_name(segment.path.name.replace(owner, self.owner)))
        try:
            os.rename(segment.path, claimed.path)
        except FileNotFoundError:
            return None  # another writer adopted it first
        with contextlib.suppress(FileNotFoundError):
            os.rename(segment.meta_path, claimed.meta_path)
        log.info("adopted spooled log rows %s from a process that exited", segment.path.name)
        if not any(owner in path.name for path in self.directory.glob("*.jsonl")):
            (self.directory / f"owner-{owner}.lock").unlink(missing_ok=True)
        return claimed

    def _owner_dead(self, owner: str) -> bool:
        lock_path = self.directory / f"owner-{owner}.lock"
        try:
            handle = open(lock_path, "a")  # noqa: SIM115 - closed below
        except OSError:
            return False
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its owner is alive and sends its own segments
            fcntl.flock(handle, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        """Releases this process's lock; its unsent segments stay for the next writer."""
        with contextlib.suppress(OSError):
            self._lock_file.close()
            if not any(s.path.stem.endswith(self.owner) for s in self._segments()):
                (self.directory / f"owner-{self.owner}.lock").unlink(missing_ok=True)
