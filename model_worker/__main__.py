"""Entry point: `python -m model_worker` serves the catalog models named by MAAS_MODELS."""

from __future__ import annotations

import logging
import os
import signal
import sys

from contract.jsonlog import configure_logging
from contract.settings import Settings
from model_worker.serving.service import WorkerService, served_specs
from model_worker.serving.signals import DrainOnSignal

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

    drain = DrainOnSignal(service.stop, max(spec.drain_seconds for spec in specs))
    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    service.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
