"""Starts bqemulator offline, with one DuckDB connection per thread; runs under the emulator's own virtualenv.

Two changes to how bqemulator 1.4 uses DuckDB, made here rather than in every client:

- It loads DuckDB's `spatial` extension at start-up, which it downloads; these machines have no route to the
  extension repository and the log table has no GEOGRAPHY column, so the load is skipped.
- It shares one DuckDB connection between its REST handlers (the event loop's thread) and its gRPC handlers
  (the Storage Write and Read APIs, run on a thread pool). DuckDB refuses a call on a connection that is busy
  in another thread ("connection is busy with another call") instead of waiting, so a query that overlapped an
  append failed, and so could the append. Every thread but the one that opened the engine now gets a cursor of
  its own: DuckDB's way to use one database from several threads (a cursor is a separate connection to the
  same database; registered functions are shared, transactions and registered Arrow tables are not).
"""

from __future__ import annotations

import os
import sys
import threading

from bqemulator.cli import main
from bqemulator.storage.engine import DuckDBEngine

_shared_connection = DuckDBEngine.connection.fget
_opened = DuckDBEngine.start
_threads = threading.local()


async def _start(self: DuckDBEngine) -> None:
    await _opened(self)
    self._owner_thread = threading.get_ident()  # noqa: SLF001 - see module docstring


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
os.environ.setdefault("BQEMU_ENABLE_FORMAT_EXTENSIONS", "false")

if __name__ == "__main__":
    sys.argv = ["bqemulator", "start", *sys.argv[1:]]
    main()
