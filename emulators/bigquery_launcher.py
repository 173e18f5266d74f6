"""Starts bqemulator offline; runs under the emulator's own virtualenv (`.venv-bq`).

bqemulator loads DuckDB's `spatial` extension at start-up, which it downloads; these machines have no
route to the extension repository and the log table has no GEOGRAPHY column, so the load is skipped.
"""

from __future__ import annotations

import os
import sys

from bqemulator.cli import main
from bqemulator.storage.engine import DuckDBEngine

DuckDBEngine._load_spatial = lambda self: None  # noqa: SLF001 - see module docstring
os.environ.setdefault("BQEMU_ENABLE_FORMAT_EXTENSIONS", "false")

if __name__ == "__main__":
    sys.argv = ["bqemulator", "start", *sys.argv[1:]]
    main()
