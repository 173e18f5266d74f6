"""The worker's own pool, device loop and finisher around one runner, fed a stream of single-image requests.

Only the services around the worker are stand-ins (in memory: Pub/Sub publish and ack, Redis, the payload
bucket), so this runs with nothing but PyTorch and the worker's packages: what it measures is the worker's
path from a held request to an encoded, stored and published reply, against the bare pipeline call.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

from contract.messages import GenerationParameters, InferenceRequest, RequestInstance
from contract.model_spec import ModelSpec
from contract.payloads import PayloadCodec
from contract.settings import Settings
from contract.stores.results import ResultStore
from model_worker.held.pool import HeldMessage, PendingRequest, RequestPool
from model_worker.model.runners import GenerationItem, Runner
from model_worker.serving.device import DeviceLoop, ProgressReporter
from model_worker.serving.finisher import ReplyFinisher
from model_worker.serving.health import WorkerHealth
from model_worker.serving.intake import ReplyFactory
from model_worker.serving.metrics import WorkerMetrics


class MemoryRedis:
    """The few Redis calls the result store makes, in a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value, ex: int | None = None, nx: bool = False) -> bool | None:
        with self._lock:
            if nx and key in self.values:
                return None  # like Redis: SET NX on a present key sets nothing
            self.values[key] = value.encode() if isinstance(value, str) else value
            return True

    def get(self, key: str):
        with self._lock:
            return self.values.get(key)

    def mget(self, keys: list[str]) -> list:
        with self._lock:
            return [self.values.get(key) for key in keys]

    def pipeline(self, transaction: bool = False) -> MemoryRedis:
        return self

    def execute(self) -> list:
        return []


class MemoryBucket:
    """A payload bucket whose objects live in memory."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def blob(self, name: str) -> MemoryBlob:
        return MemoryBlob(self, name)


class MemoryBlob:
    def __init__(self, bucket: MemoryBucket, name: str) -> None:
        self._bucket, self.name = bucket, name

    def upload_from_string(self, data: bytes, content_type: str | None = None) -> None:
        self._bucket.objects[self.name] = data

    def download_as_bytes(self) -> bytes:
        return self._bucket.objects[self.name]


class MemoryStorage:
    def __init__(self) -> None:
        self._bucket = MemoryBucket()

    def bucket(self, name: str) -> MemoryBucket:
        return self._bucket


class RecordingPublisher:
    """Publishes nowhere; records when each reply went out."""

    def __init__(self) -> None:
        self.published: list[float] = []
        self._lock = threading.Lock()

    def publish(self, topic: str, data: bytes, **attributes) -> Future:
        with self._lock:
            self.published.append(time.perf_counter())
        future: Future = Future()
        future.set_result("id")
        return future


class NoLeases:
    """Acks and hand-backs go nowhere; hand-backs are counted (a benchmark with any is wrong)."""

    def __init__(self) -> None:
        self.released = 0

    def hold(self, message: HeldMessage) -> None:
        pass

    def ack(self, message: HeldMessage) -> None:
        pass

    def release(self, message: HeldMessage) -> None:
        self.released += 1


def single_image_request(
    spec: ModelSpec, params: GenerationParameters, seed: int, priority: str = "normal"
) -> PendingRequest:
    request_id = uuid.uuid4().hex
    request = InferenceRequest(
        request_id=request_id,
        model=spec.name,
        model_version=spec.version,
        instances=[RequestInstance(prompt=f"bench {seed}")],
        parameters=params.model_copy(update={"seed": seed}),
    )
    message = HeldMessage(f"bench/{spec.name}", f"ack-{request_id}", {}, b"", 1, time.time())
    items = [GenerationItem(prompt=f"bench {seed}", seed=seed)]
    return PendingRequest(message, spec, request, items, priority, None)


def worker_images_per_second(
    runner: Runner,
    spec: ModelSpec,
    params: GenerationParameters,
    batch: int,
    images: int,
    warmup_images: int,
    finisher_threads: int = 4,
    inline_limit: int = 256 * 1024,
    finisher_nice: int = Settings.finisher_nice,
    runners: dict[str, Runner] | None = None,
    request: Callable[[int], PendingRequest] | None = None,
) -> dict:
    """Images/s of the worker's path at `batch` images per pipeline call, fed single-image requests.

    The pool holds `batch` images, the device takes them as one call, a feeder thread refills the pool as
    soon as there is room: the steady state of a worker under a backlog. `runners` (by queue) and `request(seed)`:
    a worker serving several models, fed the requests `request` makes (default: `runner` alone, text-to-image).
    """
    runners = runners or {spec.queue: runner}
    request = request or (lambda seed: single_image_request(spec, params, seed))
    pool = RequestPool(capacity=batch)
    publisher = RecordingPublisher()
    leases = NoLeases()
    metrics = WorkerMetrics()
    results = ResultStore(MemoryRedis(), 3600)
    payloads = PayloadCodec(MemoryStorage(), "bench-payloads", inline_limit)
    # The worker's bound on images waiting for the finisher (model_worker/serving/service.py).
    finisher = ReplyFinisher(publisher, "bench/replies", results, payloads, leases, metrics, finisher_threads,
                             finisher_nice, max_images=2 * batch)  # fmt: skip
    progress = ProgressReporter(results, finisher)
    health = WorkerHealth(stall_seconds=3600)
    replies = ReplyFactory("bench", {name: each.accelerator for name, each in runners.items()})
    device = DeviceLoop(runners, pool, finisher, leases, replies, progress, metrics, health)
    total = warmup_images + images
    stop = threading.Event()

    def feed() -> None:
        seed = 0
        while not stop.is_set() and seed < total + batch:
            room = pool.wait_for_room("normal", timeout=0.5)
            for _ in range(room):
                pool.add(request(seed))
                seed += 1

    feeder = threading.Thread(target=feed, name="bench-feeder", daemon=True)
    loop = threading.Thread(target=device.run, name="bench-device", daemon=True)
    progress.start()
    feeder.start()
    loop.start()
    try:
        while len(publisher.published) < total and loop.is_alive():
            time.sleep(0.01)
    finally:
        stop.set()
        device.stopping.set()
        pool.close()
        loop.join(timeout=600)
        finisher.close()
        progress.stop()
    stamps = publisher.published
    if len(stamps) < total:
        raise RuntimeError(f"the worker answered {len(stamps)} of {total} requests")
    seconds = stamps[total - 1] - stamps[warmup_images - 1] if warmup_images else stamps[-1] - stamps[0]
    counted = total - max(warmup_images, 1)
    return {
        "batch": batch,
        "images": counted,
        "seconds": round(seconds, 3),
        "images_per_s": counted / seconds if seconds > 0 else float("nan"),
        "pipeline_calls": device.calls + device.running.calls,  # request-level calls or denoising steps
        "handed_back": leases.released,
        "window": (stamps[warmup_images - 1] if warmup_images else stamps[0], stamps[total - 1]),  # perf_counter
    }


class ReplyClock:
    """Publishes nowhere; records when each request's reply went out, by request id."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self._changed = threading.Condition()

    def publish(self, topic: str, data: bytes, **attributes) -> Future:
        request_id = json.loads(data)["request_id"]
        with self._changed:
            self.at[request_id] = time.perf_counter()
            self._changed.notify_all()
        future: Future = Future()
        future.set_result("id")
        return future

    def wait(self, request_id: str, timeout: float) -> float:
        with self._changed:
            if not self._changed.wait_for(lambda: request_id in self.at, timeout):
                raise RuntimeError(f"no reply to {request_id} within {timeout} s")
            return self.at[request_id]


def interactive_latencies(
    runner: Runner,
    spec: ModelSpec,
    params: GenerationParameters,
    requests: int,
    gap_seconds: float,
    batch_backlog: bool,
    batch_images: int | None = None,
    seed: int = 1,
) -> dict:
    """Latency (pool to reply published) of `requests` interactive single-image requests, one at a time at random
    gaps of about `gap_seconds`; with `batch_backlog`, a feeder keeps the worker's batch room full of batch lines,
    as the batch subscription's puller does (issue 35). Two warm-up requests are not counted."""
    pool = RequestPool(capacity=spec.max_batch_size, batch_images=batch_images)
    clock = ReplyClock()
    leases = NoLeases()
    metrics = WorkerMetrics()
    results = ResultStore(MemoryRedis(), 3600)
    payloads = PayloadCodec(MemoryStorage(), "bench-payloads", 256 * 1024)
    finisher = ReplyFinisher(clock, "bench/replies", results, payloads, leases, metrics, 4, Settings.finisher_nice)
    progress = ProgressReporter(results, finisher)
    replies = ReplyFactory("bench", {spec.name: runner.accelerator})
    device = DeviceLoop({spec.name: runner}, pool, finisher, leases, replies, progress, metrics,
                        WorkerHealth(stall_seconds=3600))  # fmt: skip
    stop = threading.Event()
    lines: list[str] = []

    def feed_batch() -> None:
        while not stop.is_set():
            for _ in range(pool.wait_for_room("batch", timeout=0.2)):
                line = single_image_request(spec, params, 100_000 + len(lines), priority="batch")
                lines.append(line.request_id)
                pool.add(line)

    threads = [threading.Thread(target=device.run, name="bench-device", daemon=True)]
    if batch_backlog:
        threads.append(threading.Thread(target=feed_batch, name="bench-batch-feeder", daemon=True))
    progress.start()
    for thread in threads:
        thread.start()
    draw = random.Random(seed)
    latencies = []
    try:
        for index in range(requests + 2):
            time.sleep(draw.uniform(0.5, 1.5) * gap_seconds)  # lands at a random point of the batch work
            pending = single_image_request(spec, params, index)
            sent = time.perf_counter()
            pool.add(pending)
            answered = clock.wait(pending.request_id, timeout=600)
            if index >= 2:
                latencies.append(answered - sent)
    finally:
        stop.set()
        device.stopping.set()
        pool.close()
        threads[0].join(timeout=600)
        finisher.close()
        progress.stop()
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "mean_s": statistics.fmean(latencies),
        "p50_s": ordered[len(ordered) // 2],
        "p95_s": ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)],
        "max_s": ordered[-1],
        "batch_lines_done": sum(1 for line in lines if line in clock.at),
        "handed_back": leases.released,
    }
