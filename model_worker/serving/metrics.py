"""The worker's Prometheus metrics, served as /metrics on its probe port."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

# `_created` series double the output and no dashboard here reads them.
disable_created_metrics()

BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "maas_worker_requests", "Requests answered, by model and reply status", ["model", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.adapter_load_seconds = Histogram(
            "maas_worker_adapter_load_seconds", "Seconds to load one LoRA adapter from the bucket into host memory",
            ["model", "outcome"], buckets=SECONDS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_size = Histogram(
            "maas_worker_batch_images", "Images per pipeline call", ["model"], buckets=BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.inference_seconds = Histogram(
            "maas_worker_inference_seconds", "Seconds per pipeline call (step scheduling: per request, join to finish)", ["model"], buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.queue_wait_seconds = Histogram(
            "maas_worker_queue_wait_seconds", "Seconds from publish to the start of the request's pipeline call",
            ["model"], buckets=SECONDS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.device_idle_seconds = Counter(
            "maas_worker_device_idle_seconds",
            "Seconds the device waited between pipeline calls",
            registry=self.registry,
        )
        self.finisher_wait_seconds = Counter(
            "maas_worker_finisher_wait_seconds",
            "Seconds the device thread waited for the finisher's room (images it had not yet encoded and answered)",
            registry=self.registry,
        )
        self.finisher_images = Gauge(
            "maas_worker_finisher_images", "Images handed to the finisher and not yet answered", registry=self.registry
        )
        self.step_images = Histogram(
            "maas_worker_step_images", "Images per denoising call of a step-scheduled model's running set",
            ["model"], buckets=BATCH_SIZE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.running_images = Gauge(
            "maas_worker_running_images", "Images in the step scheduler's running set", registry=self.registry
        )
        self.errors = Counter("maas_worker_errors", "Errors by kind", ["kind"], registry=self.registry)
        self.watchdog = Counter(
            "maas_worker_watchdog_requests",
            "Requests the watchdog re-dispatched, copied, expired, failed or left queued, by action",
            ["action"], registry=self.registry,
        )  # fmt: skip
        self.held_requests = Gauge(
            "maas_worker_held_requests", "Requests pulled and not yet started", registry=self.registry
        )
        self.gpu_memory_bytes = Gauge(
            "maas_worker_gpu_memory_bytes", "GPU memory allocated by PyTorch", registry=self.registry
        )
        self._gpu_memory = None

    def watch_gpu_memory(self) -> None:
        """Reports PyTorch's allocated GPU memory on every scrape, when a GPU is present.

        Only where a pipeline already imported torch: a worker of synthetic models has no GPU to watch, and
        importing torch for nothing doubled its restart time (~20 s of a ~40 s restart on a loaded machine)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        if torch.cuda.is_available():
            self.gpu_memory_bytes.set_function(torch.cuda.memory_allocated)

    def count_flows_ahead(self, count: Callable[[], dict[tuple[str, str], int]]) -> None:
        """`maas_worker_flows_ahead{queue, priority}`, read on every scrape: the flows this worker holds whose later
        stage runs on another group's `queue` (`FlowStages.ahead`); that group's autoscaler adds it to its backlog."""
        self.registry.register(FlowsAhead(count))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FlowsAhead:
    """A collector: a gauge per (queue, priority) computed when scraped, so a flow that ends or moves on is never
    left counted."""

    def __init__(self, count: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._count = count

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "maas_worker_flows_ahead",
            "Flows held here whose later stage runs on another worker group's queue, by that queue and priority",
            labels=["queue", "priority"],
        )
        for (queue, priority), count in sorted(self._count().items()):
            family.add_metric([queue, priority], count)
        yield family
