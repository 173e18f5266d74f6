"""Wires one worker process: its models' runners, pullers, pool, device loop, finisher and probes.

One process serves every model of its deployment (catalog `worker_group`): each pipeline is loaded once,
each model's high and normal subscriptions are pulled into one pool, and the device takes the oldest
request first whichever model it is for, so no model starves another.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from pathlib import Path

import redis

from contract import google_clients, naming
from contract.model_spec import ModelSpec
from contract.payloads import PayloadCodec
from contract.settings import Settings
from contract.stores.inflight import InflightStore
from contract.stores.pullers import PullerStore
from contract.stores.ready_workers import ReadinessBeacon, ReadyWorkers
from contract.stores.results import ResultStore
from model_worker.adapters.loader import AdapterLoader
from model_worker.controls.loader import ControlLoader
from model_worker.flows.stages import FlowStages
from model_worker.flows.state import FlowCheckpoints
from model_worker.held.leases import LeaseKeeper
from model_worker.held.pool import RequestPool
from model_worker.model.runners import Runner, build_runner
from model_worker.serving.device import DeviceLoop, ProgressReporter
from model_worker.serving.finisher import ReplyFinisher
from model_worker.serving.health import WorkerHealth, serve_health
from model_worker.serving.intake import DeadLetterResponder, ReplyFactory, SubscriptionPuller, Triage
from model_worker.serving.metrics import WorkerMetrics
from model_worker.serving.presence import PullerPresence
from model_worker.serving.watchdog import Watchdog

log = logging.getLogger("model_worker")
# How long past its slowest request's timeout the device loop may go without a beat before /livez says stalled.
STALL_MARGIN_SECONDS = 8.0
# Redis calls from the worker fail fast: a reply is never held up by the result store.
REDIS_TIMEOUT_SECONDS = 2.0


class WeightsLoadError(Exception):
    """Weights that match their manifest but do not load; `upload` (its manifest's digest) says which upload, so
    that the same files are not loaded again (None: a prefix without a manifest, only re-read on a restart)."""

    def __init__(self, message: str, upload: str | None) -> None:
        super().__init__(message)
        self.upload = upload


class UnchangedWeightsError(Exception):
    """The weights are still the upload that did not load: nothing to try until another is uploaded."""


def unloadable_file(weights_dir: Path) -> tuple[str, str] | None:
    """The first safetensors file under `weights_dir` that safetensors refuses to open, and its reason."""
    from safetensors import safe_open

    for path in sorted(weights_dir.rglob("*.safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors' own error (SafetensorError), or an OSError
            return path.relative_to(weights_dir).as_posix(), _first_line(exc)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:500] if text else type(exc).__name__


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether memory ran out anywhere in the chain (diffusers wraps a load's failure in an OSError)."""
    while exc is not None:
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def served_specs(settings: Settings) -> list[ModelSpec]:
    catalog = settings.catalog()
    if not settings.models:
        raise ValueError("MAAS_MODELS is empty: name the catalog models this worker serves")
    unknown = [name for name in settings.models if catalog.unit(name) is None]
    if unknown:
        raise ValueError(f"MAAS_MODELS names models not in the catalog: {unknown} (a version: model--version)")
    specs = [catalog.unit(name) for name in settings.models]
    if settings.scheduling:
        # Validated again, so an override gets the catalog's checks (a scheduler that cannot step per item).
        specs = [type(spec).model_validate({**spec.model_dump(), "scheduling": settings.scheduling}) for spec in specs]
    return specs


class WorkerService:
    def __init__(self, settings: Settings, specs: list[ModelSpec]) -> None:
        self.settings = settings
        self.specs = specs
        self.metrics = WorkerMetrics()
        slowest = max(spec.request_timeout_seconds for spec in specs)
        # The device loop beats at least once a second when idle, and once per call or step when busy.
        self.health = WorkerHealth(stall_seconds=STALL_MARGIN_SECONDS + slowest)
        self._health_server = serve_health(
            self.health, settings.worker_health_port, settings.worker_health_host, self.metrics.render
        )
        self._storage = google_clients.storage_client(settings)
        self._unloadable: dict[str, str | None] = {}  # weights path -> the upload that did not load
        # Diffusers runners by their loaded components (`ModelSpec.loaded_components`): a unit with the same ones as a
        # unit loaded already shares them.
        self._loaded: dict[tuple, Runner] = {}
        self.runners: dict[str, Runner] = {spec.queue: self._load_verified(spec) for spec in specs}
        for runner in self.runners.values():
            runner.warm_up()
        self.metrics.watch_gpu_memory()
        self.subscriber = google_clients.subscriber_client()
        self.publisher = google_clients.publisher_client()
        project = settings.project_id
        redis_client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS
        )
        self.results = ResultStore(redis_client, settings.result_ttl_seconds)
        payloads = PayloadCodec(self._storage, settings.payload_bucket, settings.inline_payload_limit)
        subscriptions = {
            (spec.queue, priority): self.subscriber.subscription_path(
                project, naming.worker_subscription(spec.queue, priority)
            )
            for spec in specs
            for priority in settings.worker_priorities
        }
        dead_letters = {
            spec.queue: self.subscriber.subscription_path(project, naming.dead_letter_subscription(spec.queue))
            for spec in specs
        }
        by_name = {spec.queue: spec for spec in specs}
        deadlines = {path: by_name[name].ack_deadline_seconds for (name, _), path in subscriptions.items()}
        deadlines.update({path: 60 for path in dead_letters.values()})
        worker_id = f"{socket.gethostname()}-{os.getpid()}"
        inflight = InflightStore(redis_client)
        self.leases = LeaseKeeper(self.subscriber, deadlines, inflight, worker_id, settings.holder_lease_seconds)
        # Admission's capacity: this worker says it is ready for each of its models while /readyz says so.
        ready_workers = ReadyWorkers(redis_client, worker_id, {spec.queue: spec.max_batch_size for spec in specs})
        self.readiness = ReadinessBeacon(ready_workers, lambda: self.health.status("/readyz")[0] == 200)
        self.pool = RequestPool(capacity=max(spec.max_batch_size for spec in specs), batch_images=settings.batch_images)
        self.finisher = ReplyFinisher(
            self.publisher,
            self.publisher.topic_path(project, naming.REPLIES_TOPIC),
            self.results,
            payloads,
            self.leases,
            self.metrics,
            settings.finisher_threads,
            settings.finisher_nice,
            max_images=2 * self.pool.capacity,  # one batch being encoded, the next one waiting
        )
        self.replies = ReplyFactory(worker_id, {name: runner.accelerator for name, runner in self.runners.items()})
        checkpoints = FlowCheckpoints(redis_client, self._storage.bucket(settings.payload_bucket))
        pullers = PullerStore(redis_client)
        # Which topics this worker pulls, and when a pull found one empty: how the watchdog tells a request queued
        # behind busy workers (no copy) from one lost with a dead worker's pull.
        self.presence = PullerPresence(
            pullers,
            worker_id,
            [naming.request_topic(name, priority) for name, priority in subscriptions],
            settings.holder_lease_seconds,
        )
        self.watchdog = Watchdog(
            inflight, self.results, self.publisher, self.finisher, settings.catalog(), worker_id,
            settings.holder_lease_seconds, self.metrics, checkpoints.reports, pullers,
        )  # fmt: skip
        # Adapters load from the model bucket off the device thread; a request joins once its set is ready.
        adapter_bucket = self._storage.bucket(settings.model_bucket)
        if settings.adapter_load_delay:  # the local stack's fault hook (refused in production)
            from model_worker.serving.fault_hooks import SlowAdapterReads

            adapter_bucket = SlowAdapterReads(adapter_bucket, settings.adapter_load_delay)
        self.adapters = AdapterLoader(
            adapter_bucket,
            {name: runner.weights_dir for name, runner in self.runners.items() if hasattr(runner, "weights_dir")},
            self.pool.wake,
            lambda model, outcome, seconds: self.metrics.adapter_load_seconds.labels(model, outcome).observe(seconds),
            settings.adapter_host_cache_bytes,
        )
        # Control models (ControlNets, IP-Adapters) beside them, in a cache of their own sized in bytes.
        self.controls = ControlLoader(
            self._storage.bucket(settings.model_bucket),
            {name: runner.weights_dir for name, runner in self.runners.items() if hasattr(runner, "weights_dir")},
            self.pool.wake,
            settings.control_host_cache_bytes,
        )
        # Flows' stages (model_worker/flows/stages.py): between the device and the finisher, on to the next stage.
        self.flows = FlowStages(
            self.finisher, self.pool, self.leases, by_name,
            checkpoints,
            self.publisher, project, settings.inline_payload_limit, self.results,
        )  # fmt: skip
        self.metrics.count_flows_ahead(self.flows.ahead)
        triage = Triage(self.results, payloads, self.flows, self.replies, self.adapters, self.flows, self.controls)
        self.pullers = [
            SubscriptionPuller(
                self.subscriber,
                path,
                by_name[name],
                priority,
                self.pool,
                self.leases,
                triage,
                self.health,
                self.presence,
            )
            for (name, priority), path in subscriptions.items()
        ]
        self.dead_letter_responders = [
            DeadLetterResponder(
                self.subscriber,
                path,
                by_name[name],
                self.leases,
                self.results,
                self.flows,  # a flow's answer names the flow and the stage it died in
                self.replies,
                self.health,
            )
            for name, path in dead_letters.items()
        ]
        self.progress = ProgressReporter(self.results, self.finisher)
        self.device = DeviceLoop(
            self.runners, self.pool, self.flows, self.leases, self.replies, self.progress, self.metrics, self.health
        )
        self._stopped = threading.Event()

    def _load_verified(self, spec: ModelSpec) -> Runner:
        """The spec's runner, once its weights match their manifest and load. Until then nothing is pulled for
        this worker (its requests stay queued for a healthy one, or expire) and the process stays up, not ready:
        `/readyz` names the file and why, the log says it once (then every minute while the download is retried).
        Weights that fail their manifest are downloaded and checked again every `MAAS_WEIGHTS_RETRY_SECONDS`;
        weights that match it but do not load (a damaged safetensors file, a config that does not fit them) are
        loaded again only once the bucket holds another upload (a new manifest), so fixing the files recovers
        the worker without a restart, and unchanged files are not reloaded in a loop."""
        from model_worker.weights.store import WeightsIntegrityError

        source = f"weights of {spec.name} v{spec.version}"
        while True:
            try:
                runner = build_runner(spec, self._load_diffusers)
            except WeightsIntegrityError as exc:
                self.health.report_problem(source, f"{exc} — not served")
            except UnchangedWeightsError:
                pass  # the upload that did not load: reported when it failed
            except WeightsLoadError as exc:
                self._unloadable[spec.weights_path] = exc.upload
                self.health.report_problem(source, f"{exc} — not served until new weights are uploaded")
            else:
                self.health.clear_problem(source)
                if self.settings.hold_dir and runner.accelerator == "synthetic":  # the local stack's fault hook
                    from model_worker.serving.fault_hooks import HeldCalls

                    runner = HeldCalls(runner, self.settings.hold_dir)
                return runner
            time.sleep(self.settings.weights_retry_seconds)

    def _load_diffusers(self, spec: ModelSpec) -> Runner:
        from model_worker.model.compiled import compile_mode
        from model_worker.model.pipeline import DiffusionRunner

        shared = self._loaded.get(spec.loaded_components)
        # Only identical loaded components are shared (`ModelSpec.loaded_components`: weights, family, quantization,
        # `without:`, adapter layers), so a unit without adapters never runs on a denoiser that holds another's LoRA
        # layers, and none gets another's components less one it needs. Not when compiled: the compiled model's
        # static shapes are its own runner's.
        if (
            isinstance(shared, DiffusionRunner)
            and compile_mode(spec, self.settings.torch_compile) is None
            and compile_mode(shared.spec, self.settings.torch_compile) is None
        ):
            # SD 1.5's image-to-image beside its text-to-image: one copy of the components, as diffusers'
            # `Pipeline(**other.components)`.
            return DiffusionRunner(spec, shared.weights_dir, self.settings.torch_threads, share=shared)
        runner = self._download_and_load(spec)
        self._loaded[spec.loaded_components] = runner
        return runner

    def _download_and_load(self, spec: ModelSpec) -> Runner:
        from model_worker.model.compiled import CompileCache, compile_cache_key, compile_mode
        from model_worker.model.pipeline import DiffusionRunner
        from model_worker.model.quantization import QuantizationUnsupportedError, check_device, worker_device
        from model_worker.weights.store import MANIFEST, WeightsFormatError, download_weights

        check_device(spec.name, spec.quantization, worker_device())  # before minutes of download
        settings = self.settings
        # Which upload this is, read before its files: a manifest replaced meanwhile is tried again next time.
        manifest = self._storage.bucket(settings.model_bucket).get_blob(f"{spec.weights_path.rstrip('/')}/{MANIFEST}")
        upload = hashlib.sha256(manifest.download_as_bytes()).hexdigest() if manifest is not None else None
        if self._unloadable.get(spec.weights_path, "") == upload:
            raise UnchangedWeightsError(spec.weights_path)
        location = f"gs://{settings.model_bucket}/{spec.weights_path}"
        try:
            weights_dir = download_weights(
                self._storage, settings.model_bucket, spec.weights_path, Path(settings.weights_cache_dir)
            )
        except WeightsFormatError as exc:  # as its manifest says, but not a file safetensors loads: as a failed load
            raise WeightsLoadError(f"{location}: {exc.file}: does not load ({exc.reason})", upload) from exc
        cache = None
        mode = compile_mode(spec, settings.torch_compile)
        if mode is not None:
            bucket = self._storage.bucket(settings.model_bucket)
            cache = CompileCache(bucket, naming.compile_cache_object(spec.weights_path, compile_cache_key(spec, mode)))
        try:
            return DiffusionRunner(
                spec, weights_dir, settings.torch_threads, mode is not None, cache, compile_mode=mode
            )
        except QuantizationUnsupportedError:
            raise  # the catalog's quantization on this device: a configuration error, not the weights'; the pod exits
        except Exception as exc:
            if _out_of_memory(exc):
                raise  # the device's, not the weights': a restart (or another node) may fit it
            file, reason = unloadable_file(weights_dir) or ("", f"{type(exc).__name__}: {_first_line(exc)}")
            if not file:
                log.warning("%s does not load", location, exc_info=True)  # no file explains it: the traceback
            raise WeightsLoadError(
                f"{location}: {file + ': ' if file else ''}does not load ({reason})", upload
            ) from exc

    def serve(self) -> None:
        """Runs the device loop on the calling thread until `stop()`; then drains and returns."""
        self.leases.start()
        self.adapters.start()
        self.controls.start()
        self.progress.start()
        self.watchdog.start()
        self.presence.start()
        for worker in [*self.pullers, *self.dead_letter_responders]:
            worker.start()
        self.health.started = True
        self.readiness.start()
        log.info("worker for %s ready", ", ".join(f"{s.name} v{s.version}" for s in self.specs))
        self.device.run()
        self._drain()

    def stop(self) -> None:
        """Stop pulling now; `serve` finishes the running batch, answers it and hands back what was held."""
        self.health.draining = True
        self.readiness.stop()
        for worker in [*self.pullers, *self.dead_letter_responders]:
            worker.stop()
        self.device.stopping.set()

    def _drain(self) -> None:
        started = time.monotonic()
        self.watchdog.stop()
        held = self.pool.close()
        for pending in held:
            self.leases.release(pending.message)
        for worker in [*self.pullers, *self.dead_letter_responders]:
            worker.join(worker.wait_seconds + 1)  # a request pull's wait, a dead-letter pull's cancel
        self.presence.stop()
        self.flows.close()
        self.finisher.close()
        self.adapters.stop()
        self.controls.stop()
        self.progress.stop()
        self.leases.stop()
        self.publisher.stop()
        self.subscriber.close()
        self._health_server.shutdown()
        log.info("drained in %.1fs: %d waiting requests handed back", time.monotonic() - started, len(held))
