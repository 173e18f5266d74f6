"""Faults the local stack's tests inject into its workers on purpose; production refuses them (`contract.settings`).

`MAAS_ADAPTER_LOAD_DELAY="name=seconds,..."`: the worker reads the model bucket through `SlowAdapterReads`, which
delays the first read of each named adapter's file, so a test can watch the worker serve others while that adapter
loads. The hook wraps the bucket, so the loader (`adapters.py`) has none of its own. It lives in the worker because
the stack runs the worker as it ships (`python -m model_worker`) and no service imports `emulators`.
"""

from __future__ import annotations

import threading
import time

from contract import naming


class SlowAdapterReads:
    """A model bucket whose first `get_blob` of a named adapter's file (any model, any version) waits first."""

    def __init__(self, bucket, delays: dict[str, float]) -> None:
        self._bucket = bucket
        self._delays = dict(delays)
        self._lock = threading.Lock()

    def get_blob(self, name: str, *args, **kwargs):
        parts = name.split("/")  # adapters/{model}/{name}/{version}/{file}
        if len(parts) == 5 and name == naming.adapter_prefix(*parts[1:4]) + naming.ADAPTER_FILE:
            with self._lock:
                delay = self._delays.pop(parts[2], 0.0)
            if delay:
                time.sleep(delay)
        return self._bucket.get_blob(name, *args, **kwargs)

    def __getattr__(self, attribute: str):
        return getattr(self._bucket, attribute)
