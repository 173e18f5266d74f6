"""Starts bqemulator offline, with one DuckDB connection per thread; runs under the emulator's own virtualenv.

Three changes to how bqemulator 1.4 uses DuckDB, made here rather than in every client:

- It loads DuckDB's `spatial` extension at start-up, which it downloads; these machines have no route to the
  extension repository and the log table has no GEOGRAPHY column, so the load is skipped.
- It shares one DuckDB connection between its REST handlers (the event loop's thread) and its gRPC handlers
  (the Storage Write and Read APIs, run on a thread pool). DuckDB refuses a call on a connection that is busy
  in another thread ("connection is busy with another call") instead of waiting, so a query that overlapped an
  append failed, and so could the append. An append's write (`_flush_to_target`: the insert, the catalog's row
  count, the table's snapshot) now runs on the event loop's thread, between REST handlers, so every use of the
  shared connection is serialised there. Any other DuckDB use on a gRPC thread gets a cursor of its own (a
  separate connection to the same database; registered functions are shared). Cursors for the appends too were
  tried: correct too.
- After every write it copies the whole table into a new snapshot table (time travel, `FOR SYSTEM_TIME AS OF`,
  which nothing here uses), so each append costs as much as the table is large and the database file grows with
  the square of the appends: after a pause, the log's backlog took minutes to drain. The automatic snapshots are
  skipped; the change event that invalidates the emulator's query cache is still published.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from bqemulator.cli import main
from bqemulator.grpc_api.write_servicer import BigQueryWriteHandler
from bqemulator.storage.engine import DuckDBEngine
from bqemulator.versioning.snapshots import SnapshotManager

_shared_connection = DuckDBEngine.connection.fget
_opened = DuckDBEngine.start
_threads = threading.local()


_flush = BigQueryWriteHandler._flush_to_target
_capture = SnapshotManager.capture


def _capture_on_request(self: SnapshotManager, project_id: str, dataset_id: str, table_id: str, *, kind: str = "AUTO"):
    """Snapshots asked for by name (kind USER) are taken; the automatic copy after every write is not."""
    if kind == "AUTO":
        return None
    return _capture(self, project_id, dataset_id, table_id, kind=kind)


async def _start(self: DuckDBEngine) -> None:
    await _opened(self)
    self._owner_thread = threading.get_ident()  # noqa: SLF001 - see module docstring
    self._owner_loop = asyncio.get_running_loop()  # noqa: SLF001


def _flush_on_the_loop(self: BigQueryWriteHandler, stream, rows) -> None:
    """An append's write, run on the event loop's thread (where REST handlers use the connection), awaited here."""
    loop = self._ctx.engine._owner_loop  # noqa: SLF001

    async def flush() -> None:
        _flush(self, stream, rows)

    asyncio.run_coroutine_threadsafe(flush(), loop).result()


def _connection(self: DuckDBEngine):
    """The engine's connection on the thread that opened it; on any other thread, that thread's own cursor."""
    shared = _shared_connection(self)
    if threading.get_ident() == getattr(self, "_owner_thread", None):
        return shared
    cursors = getattr(_threads, "cursors", None)
    if cursors is None:
        cursors = _threads.cursors = {}
    cursor = cursors.get(id(shared))
    if cursor is None:
        cursor = shared.cursor()
        cursor.execute("SET TimeZone = 'UTC'")  # the engine's session setting; a cursor starts with its own
        cursors.clear()  # a cursor of a closed connection is of no further use
        cursors[id(shared)] = cursor
    return cursor


DuckDBEngine._load_spatial = lambda self: None  # noqa: SLF001 - see module docstring
DuckDBEngine.start = _start
DuckDBEngine.connection = property(_connection)
BigQueryWriteHandler._flush_to_target = _flush_on_the_loop  # noqa: SLF001
SnapshotManager.capture = _capture_on_request
os.environ.setdefault("BQEMU_ENABLE_FORMAT_EXTENSIONS", "false")

if __name__ == "__main__":
    sys.argv = ["bqemulator", "start", *sys.argv[1:]]
    main()
