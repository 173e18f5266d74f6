"""Entry point: `python -m model_worker` serves the catalog models named by MAAS_MODELS."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from contract.jsonlog import configure_logging
from contract.settings import Settings
from model_worker.serving.service import WorkerService, served_specs

log = logging.getLogger("model_worker")


def main() -> int:
    configure_logging()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = Settings.from_env()
    try:
        specs = served_specs(settings)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    service = WorkerService(settings, specs)
    drain_seconds = max(spec.drain_seconds for spec in specs)

    def drain(signum: int, _frame) -> None:
        # Stop pulling; the running batch finishes and is answered, held requests go back to the queue.
        log.info("signal %d: draining (at most %ds)", signum, drain_seconds)
        service.stop()
        deadline = threading.Timer(drain_seconds, lambda: os._exit(1))
        deadline.daemon = True
        deadline.start()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    service.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
