"""A discrete-event simulation of arrivals through per-model queues, batching workers and the deployed autoscaler.

The rules are the worker's (model_worker/held/pool.py, device.py, stepping.py), applied to simulated time:

- each model has one queue (its Pub/Sub subscription), oldest first; a worker holds at most `max_batch_size`
  images it has not started (its pool) and pulls whenever it has room, an idle worker before a busy one;
- request-level: the device takes the oldest held request and every held one with the same batch key (steps,
  size, strength) up to `max_batch_size` images, runs one pipeline call, then the next;
- step-level: a running set of one latent size shares one denoising call per step; between steps held requests
  join in order (stopping at the first that does not fit), and one whose last call is done leaves, decoded
  with those finishing at the same step;
- a request past its deadline (`request_timeout_seconds`) is answered `expired` when a worker takes it, or
  leaves a running set at the next step; a request-level batch stops only when all of it is past;
- the autoscaler is KEDA's ScaledObject as rendered (infra/k8s/render.py): an HPA sync every `sync_seconds` on
  the backlog per replica (AverageValue) and the oldest request's age (Value), both as Cloud Monitoring shows
  them `metric_delay_seconds` late, within 10% tolerance, scale-up and scale-down policies, the scale-down
  stabilization window, min and max replicas; a new pod is ready `pod_start_seconds` after it lands on a node,
  and a node takes `node_provision_seconds` unless a warm buffer node (the capacity reservation) is free,
  which is then replaced; a removed pod hands its held requests back and finishes what it runs.

Batch lines (issue 35, `BatchBacklog`): one-image lines of the deployment's first request class, submitted
at once at an hour of the day. An on-demand worker takes them only when it is idle (nothing held, nothing
interactive running), a full batch at a time; an interactive request delivered to it starts at the batch
call's next step boundary: request-level, the call's lines go back to the backlog and start over; step-level,
they pause where they are and resume once the worker is idle again. The on-demand autoscaler does not see them
(it scales on the interactive subscriptions only), and a removed pod hands its lines back. Spot workers, if
any, run batch calls back to back, scaled from zero on the batch backlog Pub/Sub holds (the feeder keeps at
most `in_flight` lines there), `backlog_per_replica` lines each; Spot preemptions are not simulated. Batch work
stops at the day's end: what is done by then is what the day absorbed.

Admission by predicted wait (issue 43, `Admission`): when a request arrives, the API's own `judge`
(api_server/predict/admission.py) is asked with what the API would see: the model's requests not yet taken by a
worker (at most the API's scan limit), the answers of the last `window_seconds`, the most workers seen holding
its requests in that window (after an idle window: the count last seen), and the smoothed run time of the
replies (from a request's start on the device to its answer, as the worker reports `inference_ms`). A refused
request is answered at once (`REFUSED`); with a fallback named for its model, it is judged again on the
fallback's deployment (its own deadline from the arrival) and, when admitted there, queued there as the
fallback's request class (`fell_back`). The device time spent on each request is kept (`spent`: a call's or a
step segment's time shared by images), so that the time spent on requests that expired anyway can be counted.

The event loop is a heap of (time, sequence, event); a running set's steps are not events one by one: a
segment of identical steps runs to the next join, leave or deadline, and is cut short when a request that can
join arrives. Costs come from a `CostProfile` (profiles.py).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from api_server.predict.admission import RUN_TIME_WEIGHT, Backlog, judge
from bench.capacity.profiles import CostProfile
from bench.capacity.traffic import Arrivals, RequestClass

ON_TIME, LATE, EXPIRED, REFUSED = 0, 1, 2, 3
UNRESOLVED = -1


@dataclass(frozen=True)
class Admission:
    """Admission by predicted wait on every simulated deployment, as a catalog entry's `admission` block sets it:
    the safety factor, the API's `MAAS_ADMISSION_WINDOW_SECONDS`, and per model the request class its refused
    requests fall back to (a deployment of the simulation serves that class's model); `fallback_share` of the
    callers allow a fallback (`allow_fallback`), drawn per request with `seed`."""

    safety_factor: float = 1.0
    window_seconds: float = 60.0
    fallback: dict[str, RequestClass] = field(default_factory=dict)
    fallback_share: float = 1.0
    seed: int = 0
    # The most waiting requests the estimate counts; None counts them all, as the API does (its script looks at
    # `SCAN_LIMIT` a priority and takes the rest as waiting). A number shows what a capped count would hide.
    scan_limit: int | None = None


@dataclass(frozen=True)
class ScalerSettings:
    """One deployment's autoscaling, as the rendered ScaledObject and its HPA behaviour say."""

    name: str
    min_replicas: int
    max_replicas: int
    backlog_per_replica: float
    oldest_age_seconds: float
    sync_seconds: float = 15.0
    metric_delay_seconds: float = 120.0
    tolerance: float = 0.1
    up_percent: float = 100.0
    up_pods: int = 4
    up_period: float = 60.0
    up_window: float = 0.0
    down_percent: float = 10.0
    down_period: float = 60.0
    down_window: float = 600.0
    buffer_nodes: int = 1


@dataclass(frozen=True)
class PodTiming:
    """Seconds from a pod's creation to serving: a node first (unless a buffer node is warm), then the pod's own
    start (image pull, weights download, pipeline load and warm-up)."""

    node_provision_seconds: float = 180.0
    pod_start_seconds: float = 90.0


@dataclass(frozen=True)
class ModelDeployment:
    """What the simulation needs of one catalog deployment (one model here)."""

    model: str
    max_batch_size: int
    timeout_seconds: float
    image_input: bool
    scaler: ScalerSettings
    gpu_share: float = 1.0  # a time-shared pod holds this much of a GPU and runs at this share of its speed


@dataclass(frozen=True)
class BatchBacklog:
    """`images` batch lines submitted at `hour` of the day; Spot workers (0: none) as the renderer deploys them."""

    images: int
    hour: float = 0.0
    spot_max_replicas: int = 0
    spot_backlog_per_replica: float = 32.0  # infra/k8s/render.py: BATCH_BACKLOG_CALLS full calls
    in_flight: int = 1000  # lines the feeder keeps published per model: all the Spot autoscaler sees
    # Lines an idle on-demand worker runs at once (MAAS_BATCH_IMAGES; 0, the worker's default: max_batch_size); Spot
    # workers run full batches.
    fill_images: int = 0
    spot_cooldown_seconds: float = 300.0


@dataclass
class BatchOutcome:
    """What a day did with its batch lines."""

    submitted: int = 0
    done_on_demand: int = 0  # on idle on-demand workers
    done_spot: int = 0
    restarted: int = 0  # lines whose request-level call an interactive request (or a scale-down) cut short
    on_demand_busy_seconds: float = 0.0  # GPU seconds on-demand workers spent on batch lines (incl. cut calls)
    spot_seconds: float = 0.0  # Spot GPU-seconds held (from the pod's creation: node and start included)
    spot_peak: int = 0
    last_done: float = math.nan

    @property
    def done(self) -> int:
        return self.done_on_demand + self.done_spot


@dataclass
class SimulationResult:
    scheduling: str
    scaler: str
    arrival: np.ndarray
    done: np.ndarray  # answered at (seconds; nan: expired)
    outcome: np.ndarray  # ON_TIME, LATE, EXPIRED
    deadline: np.ndarray
    model_of: np.ndarray  # index into `models`
    models: list[str]
    start: float
    # Per autoscaler tick (every sync_seconds): time, and per model the pods held (GPUs), serving, replicas asked.
    ticks: list[float] = field(default_factory=list)
    held: dict[str, list[float]] = field(default_factory=dict)
    serving: dict[str, list[int]] = field(default_factory=dict)
    desired: dict[str, list[int]] = field(default_factory=dict)
    busy_seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # per hour of the day
    buffer_nodes: int = 0
    max_replicas_seen: dict[str, int] = field(default_factory=dict)
    batch: BatchOutcome | None = None
    # Admission (issue 43): which requests were answered by their model's fallback, and the device seconds spent on
    # each request (GPU-seconds: a time-shared pod's share).
    fell_back: np.ndarray | None = None
    spent: np.ndarray | None = None


class _Worker:
    __slots__ = ("id", "dep", "ready_at", "created_at", "removed", "pool", "pool_images", "running", "images",
                 "key", "seg_start", "seg_step", "seg_steps", "seg_end", "version", "busy_until",
                 "lines", "paused", "fill_start", "fill_step", "fill_steps", "fill_end", "fill_version")  # fmt: skip

    def __init__(self, wid: int, dep: _Deployment, created_at: float, ready_at: float) -> None:
        self.id, self.dep = wid, dep
        self.created_at, self.ready_at = created_at, ready_at
        self.removed = False
        self.pool: list[int] = []
        self.pool_images = 0
        self.running: list[list[int]] = []  # [request, calls left]
        self.images = 0
        self.key: tuple | None = None
        self.seg_start = self.seg_step = self.seg_end = 0.0
        self.seg_steps = 0
        self.version = 0
        self.busy_until: float | None = None  # set while the device runs something
        # Batch lines: those running (calls left each), those paused (step-level), the running call or segment.
        self.lines: list[int] = []
        self.paused: list[int] = []
        self.fill_start = self.fill_step = 0.0
        self.fill_steps = 0
        self.fill_end: float | None = None
        self.fill_version = 0


class _Deployment:
    def __init__(self, index: int, spec: ModelDeployment) -> None:
        self.index, self.spec = index, spec
        self.queue: deque[int] = deque()
        self.workers: dict[int, _Worker] = {}  # serving or starting, in creation order
        self.starting: dict[int, _Worker] = {}
        self.idle: dict[int, None] = {}
        self.open: dict[int, None] = {}
        self.draining: set[int] = set()
        self.history: deque[tuple[float, int, float]] = deque()  # (time, backlog, oldest age)
        self.recommendations: deque[tuple[float, int]] = deque()
        self.scale_events: deque[tuple[float, int]] = deque()  # (time, +added / -removed)
        self.replicas = 0
        # What admission sees (issue 43): answers in its window, the workers holding requests (samples, a running
        # maximum over the window), the count last seen, and the smoothed run time.
        self.answered: deque[float] = deque()
        self.holding: deque[tuple[float, int]] = deque()
        self.last_holding = 0
        self.run_seconds: float | None = None


class Simulation:
    def __init__(
        self,
        arrivals: Arrivals,
        deployments: list[ModelDeployment],
        profile: CostProfile,
        scheduling: str,
        timing: PodTiming = PodTiming(),
        overhead_seconds: float = 0.0,
        initial_replicas: dict[str, int] | None = None,
        autoscale: bool = True,
        batch: BatchBacklog | None = None,
        admission: Admission | None = None,
    ) -> None:
        if scheduling not in ("request", "step"):
            raise ValueError(f"scheduling must be request or step, not {scheduling!r}")
        self.arrivals, self.profile, self.scheduling = arrivals, profile, scheduling
        self.timing, self.overhead = timing, overhead_seconds
        self.autoscale = autoscale
        self.deps = [_Deployment(i, spec) for i, spec in enumerate(deployments)]
        by_model = {spec.model: i for i, spec in enumerate(deployments)}
        mix = arrivals.mix
        missing = sorted({c.model for c in mix} - set(by_model))
        if missing:
            raise ValueError(f"no deployment for {missing}")
        # Per request class: deployment, images, model calls, batch keys (request-level and step-level).
        self.class_dep = [by_model[c.model] for c in mix]
        self.class_images = [c.images for c in mix]
        self.class_calls = [profile.calls(c.steps, c.strength if deployments[by_model[c.model]].image_input else None)
                            for c in mix]  # fmt: skip
        self.class_key = [
            (c.model, c.width, c.height) if scheduling == "step" else (c.model, c.steps, c.width, c.height, c.strength)
            for c in mix
        ]
        n = len(arrivals)
        self.cls = arrivals.classes.copy()  # a request that falls back changes class
        self.admission = admission
        # Per deployment: the request class its refused requests fall back to (one more class in the tables above).
        self._fallback_class: dict[int, int] = {}
        for model, fallback in (admission.fallback if admission else {}).items():
            if model not in by_model or fallback.model not in by_model:
                raise ValueError(f"fallback {model} -> {fallback.model}: both need a deployment")
            self._fallback_class[by_model[model]] = len(self.class_dep)
            self.class_dep.append(by_model[fallback.model])
            self.class_images.append(fallback.images)
            image_input = deployments[by_model[fallback.model]].image_input
            self.class_calls.append(profile.calls(fallback.steps, fallback.strength if image_input else None))
            self.class_key.append((fallback.model, fallback.width, fallback.height) if scheduling == "step" else
                                  (fallback.model, fallback.steps, fallback.width, fallback.height, fallback.strength))  # fmt: skip
        self._allows_fallback = (
            np.random.default_rng(admission.seed).random(n) < admission.fallback_share if admission else None
        )
        self.started = np.full(n, np.nan)
        self.at = arrivals.times
        timeouts = np.array([deployments[d].timeout_seconds for d in self.class_dep])
        self.deadline = self.at + timeouts[self.cls] if n else np.zeros(0)
        self.done = np.full(n, np.nan)
        self.outcome = np.full(n, UNRESOLVED, dtype=np.int8)
        self._heap: list = []
        self._seq = 0
        self._next_worker = 0
        self._all_workers: dict[int, _Worker] = {}
        # Warm nodes of the capacity reservation (one GPU pool: every simulated model's `hardware` is the same).
        self._buffer_warm = max((d.spec.scaler.buffer_nodes for d in self.deps), default=0)
        self._buffer_total = self._buffer_warm
        self.result = SimulationResult(
            scheduling, deployments[0].scaler.name if deployments else "", self.at, self.done, self.outcome,
            self.deadline, np.array(self.class_dep, dtype=np.int32)[self.cls] if n else np.zeros(0, np.int32),
            [d.model for d in deployments], arrivals.start, buffer_nodes=self._buffer_total,
            fell_back=np.zeros(n, dtype=bool), spent=np.zeros(n),
        )  # fmt: skip
        self.batch = batch
        self.batch_left = 0  # lines submitted and not taken by a worker
        self._day_end = arrivals.start + arrivals.span
        self._spot: dict[int, _Worker] = {}
        self._spot_history: deque[tuple[float, int]] = deque()
        self._spot_quiet_since: float | None = None
        if batch is not None:
            self.result.batch = BatchOutcome(submitted=batch.images)
            first = next(i for i, c in enumerate(mix) if by_model[c.model] == 0)
            self._batch_calls = self.class_calls[first]
            self._push(arrivals.start + batch.hour * 3600, _SUBMIT, None)
        for dep in self.deps:
            name = dep.spec.model
            self.result.held[name], self.result.serving[name], self.result.desired[name] = [], [], []
            self.result.busy_seconds[name] = {}
            self.result.max_replicas_seen[name] = 0
            first = (initial_replicas or {}).get(name, dep.spec.scaler.min_replicas)
            start = float(arrivals.times[0]) if n else 0.0
            for _ in range(first):
                self._create_worker(dep, start, ready_at=start)
            dep.replicas = first

    # -- the event loop ------------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, obj, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, obj, version))

    def run(self) -> SimulationResult:
        times, n = self.at, len(self.at)
        # Ticks (and so the pods' count) run from the day's start, or the warm-up's, to its end at least.
        first = min(float(times[0]), self.arrivals.start) if n else self.arrivals.start
        for dep in self.deps:  # the autoscaler's ticks also sample the pods held, autoscaling or not
            self._push(first, _TICK, dep)
        heap, index = self._heap, 0
        handlers = {_READY: self._on_ready, _SEGMENT: self._on_segment, _TICK: self._on_tick,
                    _BUFFER: self._on_buffer, _SUBMIT: self._on_submit, _FILL: self._on_fill,
                    _SPOT_TICK: self._on_spot_tick, _SPOT_READY: self._on_spot_ready, _SPOT_CALL: self._on_spot_call}  # fmt: skip
        last = max(float(times[-1]) if n else 0.0, self.arrivals.start + self.arrivals.span)
        while index < n or heap:
            if index < n and (not heap or times[index] <= heap[0][0]):
                self._on_arrival(index, float(times[index]))
                index += 1
                continue
            at, _, kind, obj, version = heapq.heappop(heap)
            if kind == _TICK and index >= n and at > last and self._settled():
                continue  # nothing left to serve: the autoscaler's ticks stop
            handlers[kind](obj, at, version)
        self.batch_settle()
        return self.result

    def _settled(self) -> bool:
        return not np.any(self.outcome == UNRESOLVED)

    # -- arrivals and delivery (Pub/Sub to the workers' pools) ---------------------------------------------

    def _on_arrival(self, request: int, now: float) -> None:
        dep = self.deps[self.class_dep[self.cls[request]]]
        if self.admission is not None and not self._admitted(dep, self.deadline[request] - now, now):
            fallback = self._fallback_class.get(dep.index)
            if fallback is None or not self._allows_fallback[request]:
                self._resolve(request, now, REFUSED)
                return
            dep = self.deps[self.class_dep[fallback]]
            deadline = self.at[request] + dep.spec.timeout_seconds
            if not self._admitted(dep, deadline - now, now):
                self._resolve(request, now, REFUSED)  # the fallback is overloaded too: the refusal stands
                return
            self.cls[request], self.deadline[request] = fallback, deadline
            self.result.fell_back[request] = True
        dep.queue.append(request)
        self._deliver(dep, now)

    # -- admission (issue 43) ------------------------------------------------------------------------------

    def _admitted(self, dep: _Deployment, left_seconds: float, now: float) -> bool:
        """The API's verdict (`judge`) on a request with `left_seconds` to its deadline, from what the API sees."""
        admission = self.admission
        window = admission.window_seconds
        while dep.answered and dep.answered[0] <= now - window:
            dep.answered.popleft()
        backlog = Backlog(
            ahead=len(dep.queue) if admission.scan_limit is None else min(len(dep.queue), admission.scan_limit),
            held=0,
            workers=self._workers_seen(dep, now, window),
            per_worker=dep.spec.max_batch_size,
            answered=len(dep.answered),
            window_seconds=window,
            run_seconds=dep.run_seconds,
        )
        return judge(backlog, left_seconds, admission.safety_factor).admitted

    @staticmethod
    def _workers_seen(dep: _Deployment, now: float, window: float) -> int:
        """The most workers seen holding the model's requests at once in the window; after an idle window, the
        count last seen (the API keeps it an hour: a simulated burst is shorter)."""
        holding = len(dep.workers) - len(dep.starting) - len(dep.idle)
        samples = dep.holding  # decreasing counts: the window's maximum is the first
        while samples and samples[-1][1] <= holding:
            samples.pop()
        samples.append((now, holding))
        while samples[0][0] <= now - window:
            samples.popleft()
        if holding:
            dep.last_holding = holding
        return samples[0][1] or dep.last_holding

    def _deliver(self, dep: _Deployment, now: float) -> None:
        """Hands queued requests to workers with room: idle workers first (oldest first), then busy ones."""
        queue, capacity = dep.queue, dep.spec.max_batch_size
        while queue:
            if dep.idle:
                worker = dep.workers[next(iter(dep.idle))]
            elif dep.open:
                worker = dep.workers[next(iter(dep.open))]
            else:
                return
            # One pull takes as many messages as the pool has room for.
            held_before = len(worker.pool)
            while queue and worker.pool_images < capacity:
                request = queue.popleft()
                if self.deadline[request] < now:
                    self._resolve(request, now, EXPIRED)  # the worker answers `expired` at once, no device time
                    continue
                worker.pool.append(request)
                worker.pool_images += self.class_images[self.cls[request]]
            self._refresh(worker)
            if not worker.pool:
                continue
            if worker.busy_until is None:
                self._next_turn(worker, now)
            elif self.scheduling == "step" and held_before == 0:
                self._maybe_cut_segment(worker, now)

    def _refresh(self, worker: _Worker) -> None:
        dep = dep_of = worker.dep
        wid = worker.id
        dep.idle.pop(wid, None)
        dep.open.pop(wid, None)
        if worker.removed or wid in dep_of.starting:
            return
        if worker.busy_until is None and not worker.pool and not worker.running:
            dep.idle[wid] = None
        elif worker.pool_images < dep.spec.max_batch_size:
            dep.open[wid] = None

    # -- the device ----------------------------------------------------------------------------------------

    def _take_batch(self, worker: _Worker, now: float) -> list[int]:
        """pool.py's take_batch: drops the expired, then the oldest and every request sharing its key, to the limit."""
        self._drop_expired_held(worker, now)
        if not worker.pool:
            return []
        limit = worker.dep.spec.max_batch_size
        key = self.class_key[self.cls[worker.pool[0]]]
        batch, rest, used = [], [], 0
        for request in worker.pool:
            size = self.class_images[self.cls[request]]
            if self.class_key[self.cls[request]] == key and used + size <= limit:
                batch.append(request)
                used += size
            else:
                rest.append(request)
        worker.pool, worker.pool_images = rest, worker.pool_images - used
        return batch

    def _take_joiners(self, worker: _Worker, now: float) -> list[int]:
        """pool.py's take_joiners: in order, stopping at the first that cannot join the running set."""
        self._drop_expired_held(worker, now)
        room = worker.dep.spec.max_batch_size - worker.images
        joiners = []
        for request in worker.pool:
            size = self.class_images[self.cls[request]]
            if self.class_key[self.cls[request]] != worker.key or size > room:
                break
            joiners.append(request)
            room -= size
        if joiners:
            worker.pool = worker.pool[len(joiners) :]
            worker.pool_images -= sum(self.class_images[self.cls[r]] for r in joiners)
        return joiners

    def _drop_expired_held(self, worker: _Worker, now: float) -> None:
        if any(self.deadline[r] < now for r in worker.pool):
            kept = []
            for request in worker.pool:
                if self.deadline[request] < now:
                    self._resolve(request, now, EXPIRED)
                    worker.pool_images -= self.class_images[self.cls[request]]
                else:
                    kept.append(request)
            worker.pool = kept

    def _next_turn(self, worker: _Worker, now: float) -> None:
        """The device is free: starts the next batch (request-level) or the running set's next segment (step)."""
        now = self._interrupt_lines(worker, now)  # batch lines give way at their next step boundary
        if self.scheduling == "request":
            self._start_batch(worker, now)
        else:
            self._start_segment(worker, now)
        self._refresh(worker)
        if worker.pool_images < worker.dep.spec.max_batch_size and not worker.removed:
            self._deliver(worker.dep, now)

    def _speed(self, worker: _Worker) -> float:
        return 1.0 / worker.dep.spec.gpu_share

    def _start_batch(self, worker: _Worker, now: float) -> None:
        batch = [] if worker.removed and not worker.pool else self._take_batch(worker, now)
        if not batch:
            worker.busy_until = None
            self._maybe_leave(worker, now)
            self._fill(worker, now)
            return
        cls = self.cls[batch[0]]
        images = sum(self.class_images[self.cls[r]] for r in batch)
        cost = self.profile.pipeline_call(images, self.class_calls[cls], worker.dep.spec.image_input)
        end = now + cost * self._speed(worker)
        latest = max(self.deadline[r] for r in batch)
        stopped = latest < end
        if stopped:  # everyone gave up: the batch stops at the step after the last deadline
            end = max(now, latest)
        worker.running = [[r, 0] for r in batch]
        self.started[batch] = now
        self._charge(worker, batch, end - now)
        worker.seg_steps = 0 if stopped else 1
        worker.images = images
        worker.busy_until = end
        worker.seg_start = now
        worker.version += 1
        self._add_busy(worker, now, end - now)
        self._push(end, _SEGMENT, worker, worker.version)

    def _start_segment(self, worker: _Worker, now: float) -> None:
        spec = worker.dep.spec
        joiners = [] if worker.removed else (self._take_joiners(worker, now) if worker.running
                                             else self._take_batch(worker, now))  # fmt: skip
        begin = now
        if joiners:
            if not worker.running:
                worker.key = self.class_key[self.cls[joiners[0]]]
            for request in joiners:
                images = self.class_images[self.cls[request]]
                begin += self.profile.start(images, spec.image_input) * self._speed(worker)
                worker.running.append([request, self.class_calls[self.cls[request]]])
                worker.images += images
                self.started[request] = now
        # Requests past their deadline leave before the step (stepping.py's `step`).
        if any(self.deadline[r] < now for r, _ in worker.running):
            for entry in [e for e in worker.running if self.deadline[e[0]] < now]:
                worker.running.remove(entry)
                worker.images -= self.class_images[self.cls[entry[0]]]
                self._resolve(entry[0], now, EXPIRED)
        if not worker.running:
            worker.key, worker.busy_until = None, None
            self._add_busy(worker, now, begin - now)
            if worker.pool and not worker.removed:  # all ran out of time; what is held starts a new set
                self._start_segment(worker, begin)
                return
            self._maybe_leave(worker, now)
            self._fill(worker, now)
            return
        step = self.profile.denoise(worker.images) * self._speed(worker)
        steps = min(left for _, left in worker.running)
        earliest = min(self.deadline[r] for r, _ in worker.running)
        if earliest < begin + steps * step:
            steps = max(1, min(steps, math.ceil((earliest - begin) / step)))
        if self._can_join(worker):
            steps = 1
        self._plan(worker, begin, step, steps)
        self._add_busy(worker, now, worker.seg_end - now)
        self._charge(worker, [r for r, _ in worker.running], worker.seg_end - now)

    def _plan(self, worker: _Worker, begin: float, step: float, steps: int) -> None:
        finishing = sum(self.class_images[self.cls[r]] for r, left in worker.running if left == steps)
        end = begin + steps * step
        if finishing:
            end += self.profile.decode(finishing) * self._speed(worker)
        worker.seg_start, worker.seg_step, worker.seg_steps, worker.seg_end = begin, step, steps, end
        worker.busy_until = end
        worker.version += 1
        self._push(end, _SEGMENT, worker, worker.version)

    def _can_join(self, worker: _Worker) -> bool:
        if not worker.pool or worker.removed:
            return False
        head = worker.pool[0]
        room = worker.dep.spec.max_batch_size - worker.images
        return self.class_key[self.cls[head]] == worker.key and self.class_images[self.cls[head]] <= room

    def _maybe_cut_segment(self, worker: _Worker, now: float) -> None:
        """Requests just held by a worker that held none, the first of which can join: the segment ends at the next
        step boundary instead (a held request that could not join before cannot now: the set has not changed)."""
        if worker.seg_steps <= 1 or not self._can_join(worker):
            return
        done = max(1, math.ceil((now - worker.seg_start) / worker.seg_step))
        if done >= worker.seg_steps:
            return
        old_end = worker.seg_end
        self._add_busy(worker, worker.seg_start, -(worker.seg_end - worker.seg_start))
        self._plan(worker, worker.seg_start, worker.seg_step, done)
        self._add_busy(worker, worker.seg_start, worker.seg_end - worker.seg_start)
        self._charge(worker, [r for r, _ in worker.running], worker.seg_end - old_end)

    def _on_segment(self, worker: _Worker, now: float, version: int) -> None:
        if version != worker.version:
            return  # a segment cut short: its replacement is on the heap
        if self.scheduling == "request":
            for request, _ in worker.running:
                if worker.seg_steps == 0:  # stopped: nobody waited for it any more
                    self._resolve(request, now, EXPIRED)
                else:
                    self._answer(request, now)
            worker.running, worker.images = [], 0
        else:
            steps = worker.seg_steps
            kept = []
            for entry in worker.running:
                entry[1] -= steps
                if entry[1] <= 0:
                    request = entry[0]
                    worker.images -= self.class_images[self.cls[request]]
                    self._answer(request, now)
                else:
                    kept.append(entry)
            worker.running = kept
            if not kept:
                worker.key = None
        worker.busy_until = None
        self._next_turn(worker, now)

    def _answer(self, request: int, now: float) -> None:
        """Off the device: PNG encoding (per image), then the way back to the client."""
        at = now + self.profile.reply_s * self.class_images[self.cls[request]] + self.overhead
        self._resolve(request, at, LATE if at > self.deadline[request] else ON_TIME)
        if self.admission is not None:  # the API sees the reply: one more answer, and its run time
            dep = self.deps[self.class_dep[self.cls[request]]]
            dep.answered.append(now)
            ran = now - self.started[request]
            dep.run_seconds = (
                ran if dep.run_seconds is None else dep.run_seconds + RUN_TIME_WEIGHT * (ran - dep.run_seconds)
            )

    def _charge(self, worker: _Worker, requests: list[int], seconds: float) -> None:
        """Device seconds of a call or a step segment, shared among its requests by images."""
        if seconds and requests:
            images = sum(self.class_images[self.cls[r]] for r in requests)
            share = seconds * worker.dep.spec.gpu_share / images
            for request in requests:
                self.result.spent[request] += share * self.class_images[self.cls[request]]

    def _resolve(self, request: int, at: float, outcome: int) -> None:
        self.outcome[request] = outcome
        if outcome != EXPIRED:
            self.done[request] = at

    def _add_busy(self, worker: _Worker, at: float, seconds: float) -> None:
        if seconds:
            hours = self.result.busy_seconds[worker.dep.spec.model]
            hour = math.floor(at / 3600)
            hours[hour] = hours.get(hour, 0.0) + seconds * worker.dep.spec.gpu_share

    # -- pods ----------------------------------------------------------------------------------------------

    def _create_worker(self, dep: _Deployment, now: float, ready_at: float | None = None) -> None:
        if ready_at is None:
            ready_at = now + self.timing.pod_start_seconds
            if self._buffer_warm > 0:
                self._buffer_warm -= 1
                self._push(now + self.timing.node_provision_seconds, _BUFFER, None)
            else:
                ready_at += self.timing.node_provision_seconds
        self._next_worker += 1
        worker = _Worker(self._next_worker, dep, now, ready_at)
        dep.workers[worker.id] = worker
        self._all_workers[worker.id] = worker
        if ready_at > now:
            dep.starting[worker.id] = worker
            self._push(ready_at, _READY, worker)
        else:
            self._refresh(worker)

    def _on_ready(self, worker: _Worker, now: float, _version: int) -> None:
        dep = worker.dep
        if worker.removed or dep.starting.pop(worker.id, None) is None:
            return
        self._refresh(worker)
        self._deliver(dep, now)
        self._fill(worker, now)

    def _on_buffer(self, _obj, now: float, _version: int) -> None:
        self._buffer_warm += 1

    def _remove_worker(self, dep: _Deployment, now: float) -> None:
        """The ReplicaSet's choice: a pod not yet ready first, then an idle one, then the newest."""
        if dep.starting:
            wid = next(reversed(dep.starting))
            dep.starting.pop(wid)
            dep.workers.pop(wid).removed = True
            return
        wid = next(reversed(dep.idle)) if dep.idle else next(reversed(dep.workers))
        worker = dep.workers.pop(wid)
        worker.removed = True
        self._hand_back_lines(worker, now)
        dep.idle.pop(wid, None)
        dep.open.pop(wid, None)
        # SIGTERM: the pool goes back to the queue (oldest first), the running work is finished (the drain).
        for request in reversed(worker.pool):
            dep.queue.appendleft(request)
        worker.pool, worker.pool_images = [], 0
        if worker.busy_until is not None:
            dep.draining.add(wid)
        self._deliver(dep, now)

    def _maybe_leave(self, worker: _Worker, now: float) -> None:
        if worker.removed:
            worker.dep.draining.discard(worker.id)

    # -- the autoscaler (KEDA's ScaledObject through the HPA) ----------------------------------------------

    def _on_tick(self, dep: _Deployment, now: float, _version: int) -> None:
        scaler = dep.spec.scaler
        if self.batch_left and dep.index == 0:  # lines handed back meanwhile: idle workers pull them
            for wid in list(dep.idle):
                self._fill(dep.workers[wid], now)
        backlog, oldest = self._unacked(dep, now)
        dep.history.append((now, backlog, now - oldest))
        self._record(dep, now)
        seen = None
        while dep.history and dep.history[0][0] <= now - scaler.metric_delay_seconds:
            seen = dep.history.popleft()
        if seen is not None:
            dep.history.appendleft(seen)
            if self.autoscale:
                self._scale(dep, now, seen[1], seen[2])
        self._push(now + scaler.sync_seconds, _TICK, dep)

    def _unacked(self, dep: _Deployment, now: float) -> tuple[int, float]:
        """Pub/Sub's unacked messages (`num_undelivered_messages`, KEDA's backlog) and the oldest one's arrival:
        queued, held in a pool or running (a worker acks once it has answered)."""
        count, oldest = len(dep.queue), (self.at[dep.queue[0]] if dep.queue else now)
        for worker in list(dep.workers.values()) + self._draining_workers(dep):
            count += len(worker.pool) + len(worker.running)
            for request in worker.pool:
                oldest = min(oldest, self.at[request])
            for request, _ in worker.running:
                oldest = min(oldest, self.at[request])
        return count, oldest

    def _draining_workers(self, dep: _Deployment) -> list[_Worker]:
        return [self._all_workers[wid] for wid in dep.draining]

    def _scale(self, dep: _Deployment, now: float, backlog: int, oldest: float) -> None:
        scaler = dep.spec.scaler
        current = dep.replicas
        wanted = []
        by_backlog = backlog / max(current, 1) / scaler.backlog_per_replica
        wanted.append(
            current if abs(by_backlog - 1) <= scaler.tolerance else math.ceil(backlog / scaler.backlog_per_replica)
        )
        by_age = oldest / scaler.oldest_age_seconds
        wanted.append(current if abs(by_age - 1) <= scaler.tolerance else math.ceil(current * by_age))
        desired = min(max(max(wanted), scaler.min_replicas), scaler.max_replicas)
        # Scale-down stabilization: the highest recommendation of the window.
        dep.recommendations.append((now, desired))
        while dep.recommendations and dep.recommendations[0][0] < now - scaler.down_window:
            dep.recommendations.popleft()
        if desired < current:
            desired = min(current, max(r for _, r in dep.recommendations))
        while dep.scale_events and dep.scale_events[0][0] <= now - max(scaler.up_period, scaler.down_period):
            dep.scale_events.popleft()
        if desired > current:
            added = sum(d for t, d in dep.scale_events if d > 0 and t > now - scaler.up_period)
            base = current - added
            limit = max(base + math.ceil(base * scaler.up_percent / 100), base + scaler.up_pods)
            desired = min(desired, limit, scaler.max_replicas)
        elif desired < current:
            removed = -sum(d for t, d in dep.scale_events if d < 0 and t > now - scaler.down_period)
            base = current + removed
            limit = math.floor(base * (1 - scaler.down_percent / 100))
            desired = max(desired, limit, scaler.min_replicas)
        if desired == current:
            return
        dep.scale_events.append((now, desired - current))
        for _ in range(desired - current):
            self._create_worker(dep, now)
        for _ in range(current - desired):
            self._remove_worker(dep, now)
        dep.replicas = desired

    def _record(self, dep: _Deployment, now: float) -> None:
        name = dep.spec.model
        if dep.index == 0:
            self.result.ticks.append(now)
        held = len(dep.workers) + len(dep.draining)
        self.result.held[name].append(held * dep.spec.gpu_share)
        self.result.serving[name].append(len(dep.workers) - len(dep.starting))
        self.result.desired[name].append(dep.replicas)
        self.result.max_replicas_seen[name] = max(self.result.max_replicas_seen[name], dep.replicas, len(dep.workers))

    # -- batch lines (issue 35) -----------------------------------------------------------------------------

    def _on_submit(self, _obj, now: float, _version: int) -> None:
        self.batch_left = self.batch.images
        for worker in list(self.deps[0].workers.values()):
            self._fill(worker, now)
        if self.batch.spot_max_replicas:
            self._push(now, _SPOT_TICK, None)

    def _fill(self, worker: _Worker, now: float) -> None:
        """An idle on-demand worker takes batch lines: its paused ones first (step-level), then new ones, a batch."""
        if (self.batch is None or worker.removed or worker.dep.index != 0 or worker.id in worker.dep.starting
                or worker.busy_until is not None or worker.pool or worker.running or worker.fill_end is not None
                or now >= self._day_end):  # fmt: skip
            return
        spec = worker.dep.spec
        lines, worker.paused = worker.paused, []
        take = max(
            0,
            min(min(spec.max_batch_size, self.batch.fill_images or spec.max_batch_size) - len(lines), self.batch_left),
        )
        self.batch_left -= take
        lines += [self._batch_calls] * take
        if not lines:
            return
        # Three phases, as in the worker: the new lines' start (prompt and image encoding) and the finishing lines'
        # decode cannot be cut short; the denoising steps between them give way at a step boundary.
        speed = self._speed(worker)
        begin = now + (self.profile.start(take, spec.image_input) * speed if take else 0.0)
        step = self.profile.denoise(len(lines)) * speed
        steps = min(lines)
        end = begin + steps * step + self.profile.decode(lines.count(steps)) * speed
        worker.lines, worker.fill_start, worker.fill_step, worker.fill_steps, worker.fill_end = (
            lines, begin, step, steps, end)  # fmt: skip
        worker.fill_version += 1
        self.result.batch.on_demand_busy_seconds += (end - now) * spec.gpu_share
        self._push(end, _FILL, worker, worker.fill_version)

    def _on_fill(self, worker: _Worker, now: float, version: int) -> None:
        if version != worker.fill_version:
            return
        self._finish_lines(worker, now)
        self._fill(worker, now)

    def _finish_lines(self, worker: _Worker, now: float) -> None:
        done = [calls for calls in worker.lines if calls <= worker.fill_steps]
        worker.paused = [calls - worker.fill_steps for calls in worker.lines if calls > worker.fill_steps]
        self._lines_done(len(done), now, spot=False)
        worker.lines, worker.fill_end = [], None
        worker.fill_version += 1

    def _lines_done(self, count: int, now: float, spot: bool) -> None:
        if not count or now > self._day_end:
            return  # the day absorbed what was done by its end
        outcome = self.result.batch
        if spot:
            outcome.done_spot += count
        else:
            outcome.done_on_demand += count
        outcome.last_done = now

    def _interrupt_lines(self, worker: _Worker, now: float) -> float:
        """An interactive request for a worker running batch lines: they stop at the next step boundary (returned);
        request-level their call starts over later, step-level they pause with their progress."""
        if worker.fill_end is None:
            return now
        done = max(0, math.ceil((now - worker.fill_start) / worker.fill_step)) if worker.fill_step else 0
        if done >= worker.fill_steps and self.scheduling == "step":
            # Decoding: step-level, finished lines are decoded one at a time and the rest wait (the worker's
            # `RunningSet.step`): the request waits for the last step and one line's decode at most.
            decode_start = worker.fill_start + worker.fill_steps * worker.fill_step
            one = max(worker.fill_end - decode_start, 0.0) / max(1, worker.lines.count(worker.fill_steps))
            decoded = max(1, math.ceil((now - decode_start) / one)) if one and now > decode_start else 1
            end = min(worker.fill_end, decode_start + decoded * one)
            finished = [calls for calls in worker.lines if calls <= worker.fill_steps]
            self._lines_done(min(decoded, len(finished)), end, spot=False)
            self.result.batch.on_demand_busy_seconds -= (worker.fill_end - end) * worker.dep.spec.gpu_share
            worker.paused = [0] * max(0, len(finished) - decoded) + [
                calls - worker.fill_steps for calls in worker.lines if calls > worker.fill_steps
            ]
            worker.lines, worker.fill_end = [], None
            worker.fill_version += 1
            return max(now, end)
        if done >= worker.fill_steps:  # its last step is under way: it finishes
            end = worker.fill_end
            self._finish_lines(worker, end)
            return max(now, end)
        boundary = max(now, worker.fill_start + done * worker.fill_step)
        self.result.batch.on_demand_busy_seconds -= (worker.fill_end - boundary) * worker.dep.spec.gpu_share
        if self.scheduling == "step":
            worker.paused = [calls - done for calls in worker.lines]
        else:
            self.batch_left += len(worker.lines)
            self.result.batch.restarted += len(worker.lines)
        worker.lines, worker.fill_end = [], None
        worker.fill_version += 1
        return boundary

    def _hand_back_lines(self, worker: _Worker, now: float) -> None:
        """A pod removed (SIGTERM): its batch lines go back to Pub/Sub unanswered, progress lost."""
        if self.batch is None:
            return
        if worker.fill_end is not None:
            self.result.batch.on_demand_busy_seconds -= max(0.0, worker.fill_end - now) * worker.dep.spec.gpu_share
            self.result.batch.restarted += len(worker.lines)
        self.batch_left += len(worker.lines) + len(worker.paused)
        worker.lines, worker.paused, worker.fill_end = [], [], None
        worker.fill_version += 1

    # -- Spot batch workers ----------------------------------------------------------------------------------

    def _on_spot_tick(self, _obj, now: float, _version: int) -> None:
        """KEDA on the batch subscription's backlog (as Cloud Monitoring shows it, late): from zero, back to zero."""
        batch, scaler = self.batch, self.deps[0].spec.scaler
        outcome = self.result.batch
        remaining = outcome.submitted - outcome.done if now <= self._day_end else 0
        self._spot_history.append((now, min(batch.in_flight, remaining)))
        seen = self._spot_history[0][1]
        while self._spot_history and self._spot_history[0][0] <= now - scaler.metric_delay_seconds:
            seen = self._spot_history.popleft()[1]
        desired = min(batch.spot_max_replicas, math.ceil(seen / batch.spot_backlog_per_replica))
        if now > self._day_end:
            desired = 0
        elif desired == 0:
            self._spot_quiet_since = self._spot_quiet_since or now
            if now - self._spot_quiet_since < batch.spot_cooldown_seconds:
                desired = len(self._spot)
        else:
            self._spot_quiet_since = None
        while len(self._spot) < desired:
            self._next_worker += 1
            ready = now + self.timing.node_provision_seconds + self.timing.pod_start_seconds
            worker = _Worker(self._next_worker, self.deps[0], now, ready)
            self._spot[worker.id] = worker
            self._push(ready, _SPOT_READY, worker)
        while len(self._spot) > desired:
            worker = self._spot.pop(next(reversed(self._spot)))
            worker.removed = True
            outcome.spot_seconds += now - worker.created_at
            self.batch_left += len(worker.lines)  # handed back unanswered
            worker.lines, worker.fill_end = [], None
            worker.fill_version += 1
        outcome.spot_peak = max(outcome.spot_peak, len(self._spot))
        for worker in self._spot.values():  # ready and out of lines: lines handed back meanwhile
            if worker.ready_at <= now and not worker.lines:
                self._spot_call(worker, now)
        if self._spot or now <= self._day_end:
            self._push(now + scaler.sync_seconds, _SPOT_TICK, None)

    def _on_spot_ready(self, worker: _Worker, now: float, _version: int) -> None:
        if not worker.removed:
            self._spot_call(worker, now)

    def _spot_call(self, worker: _Worker, now: float) -> None:
        """Full batch calls back to back while there are lines (a stepped set of batch lines only runs as one)."""
        spec = worker.dep.spec
        take = min(spec.max_batch_size, self.batch_left)
        if not take or now >= self._day_end:
            return
        self.batch_left -= take
        worker.lines = [self._batch_calls] * take
        worker.fill_version += 1
        end = now + self.profile.pipeline_call(take, self._batch_calls, spec.image_input)
        self._push(end, _SPOT_CALL, worker, worker.fill_version)

    def _on_spot_call(self, worker: _Worker, now: float, version: int) -> None:
        if worker.removed or version != worker.fill_version:
            return
        self._lines_done(len(worker.lines), now, spot=True)
        worker.lines = []
        self._spot_call(worker, now)

    def batch_settle(self) -> None:
        """Spot pods still held at the end count their GPU time to the day's end."""
        if self.result.batch is not None:
            for worker in self._spot.values():
                self.result.batch.spot_seconds += max(0.0, self._day_end - worker.created_at)
            self._spot.clear()


_READY, _SEGMENT, _TICK, _BUFFER, _SUBMIT, _FILL, _SPOT_TICK, _SPOT_READY, _SPOT_CALL = range(9)
