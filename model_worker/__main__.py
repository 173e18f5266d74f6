"""Entry point: `python -m model_worker` serves the catalog model named by MAAS_MODEL."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import redis

from contract import clients
from contract.catalog import load_catalog
from contract.jsonlog import configure_logging
from contract.payloads import PayloadCodec
from contract.results import ResultStore
from contract.settings import Settings
from model_worker.consumer import PULL_WAIT_SECONDS, RequestConsumer
from model_worker.health import WorkerHealth, serve_health
from model_worker.pipeline import DiffusionRunner
from model_worker.weights import download_weights

log = logging.getLogger("model_worker")


def main() -> int:
    configure_logging()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = Settings.from_env()
    spec = load_catalog(settings.catalog_path).get(settings.model)
    if spec is None:
        log.error("MAAS_MODEL=%r is not in the catalog", settings.model)
        return 2
    health = WorkerHealth(stall_seconds=PULL_WAIT_SECONDS * 4 + spec.request_timeout_seconds)
    health_server = serve_health(health, settings.worker_health_port)
    storage = clients.storage_client(settings)
    weights_dir = download_weights(storage, settings.model_bucket, spec.weights_path, Path(settings.weights_cache_dir))
    runner = DiffusionRunner(spec, weights_dir, settings.torch_threads)
    runner.warm_up()
    subscriber = clients.subscriber_client()
    publisher = clients.publisher_client()
    consumer = RequestConsumer(
        spec=spec,
        project_id=settings.project_id,
        runner=runner,
        subscriber=subscriber,
        publisher=publisher,
        results=ResultStore(redis.Redis.from_url(settings.redis_url), settings.result_ttl_seconds),
        payloads=PayloadCodec(storage, settings.payload_bucket, settings.inline_payload_limit),
        health=health,
    )

    def drain(signum: int, _frame) -> None:
        # Stop pulling; the message in hand finishes and is answered before the process exits.
        log.info("signal %d: draining (at most %ds)", signum, spec.drain_seconds)
        health.draining = True
        consumer.stopping = True
        deadline = threading.Timer(spec.drain_seconds, lambda: os._exit(1))
        deadline.daemon = True
        deadline.start()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    health.started = True
    log.info("worker for %s v%s ready", spec.name, spec.version)
    consumer.run()
    publisher.stop()
    subscriber.close()
    health_server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
