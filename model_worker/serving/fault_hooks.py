"""Faults the local stack's tests inject into its workers on purpose; production refuses them (`contract.settings`).

`MAAS_ADAPTER_LOAD_DELAY="name=seconds,..."`: the worker reads the model bucket through `SlowAdapterReads`, which
delays the first read of each named adapter's file, so a test can watch the worker serve others while that adapter
loads. The hook wraps the bucket, so the loader (`adapters.py`) has none of its own.

`MAAS_HOLD_DIR=<dir>`: a synthetic model's request-level call of a prompt `!hold <name>` stops after its first step
(progress reported, the request running) until the file `<dir>/<name>` exists, so a test sees a running request by
order, not by outpacing a timer. `HeldCalls` wraps the runner, which has none of it.

Both live in the worker because the stack runs the worker as it ships (`python -m model_worker`) and no service
imports `emulators`.
"""

from __future__ import annotations

import os
import re
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


HOLD_PROMPT = re.compile(r"!hold ([A-Za-z0-9_-]{1,64})(?:\s|$)")
# A gate nobody opens lets the call go on after this long, so a failed test cannot wedge the stack's worker.
HOLD_LIMIT_SECONDS = 120.0


class HeldCalls:
    """A synthetic runner whose calls of `!hold <name>` prompts wait after their first step for `<dir>/<name>`."""

    def __init__(self, runner, directory: str) -> None:
        self._runner = runner
        self._directory = directory

    def generate(self, items, params, on_step):
        waiting = [os.path.join(self._directory, m.group(1)) for item in items if (m := HOLD_PROMPT.match(item.prompt))]
        if not waiting:
            return self._runner.generate(items, params, on_step)

        def held_step(done: int, total: int) -> None:
            on_step(done, total)  # the progress (and a cancel's exception) first: the request shows as running
            limit = time.monotonic() + HOLD_LIMIT_SECONDS
            while waiting and time.monotonic() < limit:
                if os.path.exists(waiting[0]):
                    waiting.pop(0)
                else:
                    time.sleep(0.01)
            waiting.clear()

        return self._runner.generate(items, params, held_step)

    def __getattr__(self, attribute: str):
        return getattr(self._runner, attribute)
