"""The fault scenarios: traffic through the API while a fault is injected into the real processes.

Every process is signalled by the PID the stack recorded and brought back with the stack's own commands
(`emulators.stack.restart`, the bootstrap, or its supervisor), exactly as an operator would by hand.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from chaos.batches import batch_faults
from chaos.evidence import keep_evidence
from chaos.overload import overload
from chaos.traffic import Outcome, Traffic, predict_body
from chaos.verdict import ScenarioResult, late_runs, leaked_reply_subscriptions, row_copies
from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import StackConfig, bootstrap_resources, components, restart


@dataclass
class ChaosContext:
    """The stack under test and the clients the checks use."""

    config: StackConfig
    settings: object
    bigquery: object
    subscriber: object
    headers: dict[str, str]
    timeouts: dict[str, float]
    row_wait_seconds: float = 90.0
    # Headers of an API key with tight rate and concurrency limits (the burst scenario), when the stack has one.
    limited_headers: dict[str, str] | None = None
    # Each worker SIGKILL of the running scenario: when, the requests the worker held (holder leases), and
    # whether another worker of its deployment was ready to take them.
    kills: list[tuple[float, set[str], bool]] = field(default_factory=list)
    # The worker (name and pid) each of those held requests was held by, for a failed run's evidence.
    held_by: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Where a failed scenario keeps its evidence and a copy of the stack's logs (chaos/evidence.py); None: nowhere.
    evidence_dir: Path | None = None

    @classmethod
    def for_stack(cls, config: StackConfig, settings, headers: dict[str, str], **kwargs) -> ChaosContext:
        """The context for a running stack: its BigQuery and Pub/Sub clients and the catalog's timeouts."""
        from contract import google_clients

        return cls(
            config=config,
            settings=settings,
            bigquery=google_clients.bigquery_client(settings),
            subscriber=google_clients.subscriber_client(),
            headers=headers,
            timeouts={name: float(spec.request_timeout_seconds) for name, spec in config.catalog().models.items()},
            **kwargs,
        )

    @property
    def registry(self) -> ProcessRegistry:
        return ProcessRegistry(self.config.stack_dir)

    def signal(self, name: str, sig: signal.Signals) -> None:
        pid = self.registry.pid(name)
        if pid is None:
            raise RuntimeError(f"{name} is not running")
        os.killpg(pid, sig)

    def held_unanswered(self, pid: int) -> set[str]:
        """The requests the worker with `pid` holds (holder leases) that have no stored answer yet."""
        import redis

        from contract import naming
        from contract.stores.inflight import InflightStore

        client = redis.Redis.from_url(self.settings.redis_url, socket_timeout=2)
        held = [r for r, holder in InflightStore(client).holders().items() if holder.endswith(f"-{pid}")]
        stored = client.mget([naming.result_key(r) for r in held]) if held else []
        return {request_id for request_id, result in zip(held, stored, strict=True) if result is None}

    def kill_worker(self, name: str, holding: bool = False, other_ready: bool = True) -> set[str]:
        """SIGKILLs a worker and records the requests it held unanswered at that moment (their holder leases outlive
        it by seconds). `holding`: first wait (up to 30 s) for a moment it holds some, found with it stopped."""
        pid = self.registry.pid(name)
        if pid is None:
            raise RuntimeError(f"{name} is not running")
        give_up = time.monotonic() + 30
        while holding and time.monotonic() < give_up:
            os.killpg(pid, signal.SIGSTOP)  # frozen, it can neither take nor answer: the snapshot is exact
            if self.held_unanswered(pid):
                break
            os.killpg(pid, signal.SIGCONT)
            time.sleep(0.01)
        self.signal(name, signal.SIGKILL)
        killed_at = time.time()
        held = self.held_unanswered(pid)
        self.kills.append((killed_at, held, other_ready))
        self.held_by.update({request_id: f"{name} (pid {pid})" for request_id in held})
        return held

    def restart(self, name: str) -> None:
        restart(self.config, name)

    def bootstrap(self) -> None:
        bootstrap_resources(self.config)

    def wait_ready(self, timeout: float = 90.0) -> None:
        """The API answers /readyz 200 and every worker of the stack is running again (the supervisor's work)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers_up = all(self.registry.is_running(name) for name in components(self.config) if "worker-" in name)
            if workers_up and http_ok(f"{self.config.api_url}/readyz", timeout=3):
                return
            time.sleep(0.5)
        raise RuntimeError("the stack did not become ready again")


Fault = tuple[float, Callable[[ChaosContext], None]]


def run_scenario(
    ctx: ChaosContext,
    name: str,
    model: str,
    concurrency: int,
    seconds: float,
    faults: list[Fault],
    body: Callable[[int], dict] | None = None,
    extra: Callable[[ChaosContext], list[Outcome]] | None = None,
) -> ScenarioResult:
    """Traffic for `seconds`; each fault runs at its offset; then every answer and row is checked."""
    result = ScenarioResult(name)
    ctx.kills.clear()
    ctx.held_by.clear()
    ctx.notes.clear()
    began = time.monotonic()
    traffic = Traffic(ctx.config.api_url, ctx.headers, model, concurrency, ctx.timeouts[model], body).start()
    extra_outcomes: list[Outcome] = []
    extra_thread = None
    if extra is not None:
        extra_thread = threading.Thread(target=lambda: extra_outcomes.extend(extra(ctx)), daemon=True)
        extra_thread.start()
    for at, fault in sorted(faults, key=lambda item: item[0]):
        time.sleep(max(0.0, at - (time.monotonic() - began)))
        try:
            fault(ctx)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not hidden
            result.notes.append(f"fault at {at}s failed: {exc}")
    time.sleep(max(0.0, seconds - (time.monotonic() - began)))
    outcomes = traffic.stop()
    if extra_thread is not None:
        extra_thread.join(600)
    outcomes += extra_outcomes
    result.record(outcomes)
    result.record_recovery(ctx.kills, outcomes)
    result.notes += ctx.notes
    ctx.wait_ready()
    expected = [outcome.request_id for outcome in outcomes if outcome.request_id]
    copies = row_copies(ctx.bigquery, ctx.settings, expected, ctx.row_wait_seconds)
    result.record_rows(expected, copies)
    result.ran_after_deadline = late_runs(ctx.bigquery, ctx.settings, expected, ctx.timeouts)
    result.leaked_subscriptions = len(leaked_reply_subscriptions(ctx.subscriber, ctx.settings.project_id))
    result.seconds = round(time.monotonic() - began, 1)
    keep_evidence(ctx, result, outcomes)
    return result


def _sigkill_worker(deployment: str) -> Callable[[ChaosContext], None]:
    replicas = [f"worker-{deployment}", f"worker-{deployment}-2"]
    counter = {"n": 0}

    def fault(ctx: ChaosContext) -> None:
        name, other = replicas[counter["n"] % len(replicas)], replicas[(counter["n"] + 1) % len(replicas)]
        counter["n"] += 1
        if ctx.registry.is_running(name):
            # With the other replica still restarting, the requests wait for a worker to start: timed apart.
            other_ready = components(ctx.config)[other].health()[0]
            if not other_ready:
                ctx.notes.append(f"{name} killed while {other} was not ready (restarting)")
            ctx.kill_worker(name, other_ready=other_ready)  # the supervisor starts it again, as Kubernetes would

    return fault


def worker_kill(ctx: ChaosContext, seconds: float = 40) -> ScenarioResult:
    kill = _sigkill_worker("synthetic")
    faults = [(at, kill) for at in range(5, int(seconds) - 5, 10)]
    return run_scenario(ctx, "worker SIGKILL every 10 s", "sleep", 12, seconds, faults)


def worker_kill_held(ctx: ChaosContext, seconds: float = 20) -> ScenarioResult:
    """One SIGKILL at a moment the worker holds requests, its twin up: how fast the watchdog gets them answered."""
    fault = (5, lambda c: c.kill_worker("worker-synthetic", holding=True))
    return run_scenario(ctx, "worker SIGKILL holding requests, twin up", "sleep", 12, seconds, [fault])


def redis_outage(ctx: ChaosContext, seconds: float = 35, outage: float = 20) -> ScenarioResult:
    faults = [(5, lambda c: c.signal("redis", signal.SIGKILL)), (5 + outage, lambda c: c.restart("redis"))]
    return run_scenario(ctx, f"Redis killed {outage:.0f} s", "sleep", 8, seconds, faults)


def bigquery_pause(ctx: ChaosContext, seconds: float = 45, pause: float = 30) -> ScenarioResult:
    faults = [
        (5, lambda c: c.signal("bigquery", signal.SIGSTOP)),
        (5 + pause, lambda c: c.signal("bigquery", signal.SIGCONT)),
    ]
    return run_scenario(ctx, f"BigQuery SIGSTOP {pause:.0f} s", "noop", 8, seconds, faults)


def bigquery_restart(ctx: ChaosContext, seconds: float = 30) -> ScenarioResult:
    return run_scenario(ctx, "BigQuery killed, restarted", "noop", 8, seconds, [(5, lambda c: c.restart("bigquery"))])


def pubsub_restart(ctx: ChaosContext, seconds: float = 40) -> ScenarioResult:
    def restart_and_bootstrap(c: ChaosContext) -> None:
        c.restart("pubsub")
        c.bootstrap()

    return run_scenario(ctx, "Pub/Sub killed, restarted, bootstrap", "noop", 8, seconds, [(5, restart_and_bootstrap)])


def _long_requests(
    count: int, width: int = 256, steps: int = 20, cancel_job: bool = False
) -> Callable[[ChaosContext], list[Outcome]]:
    """Long tiny-diffusion requests in flight while the fault happens (`cancel_job`: their clients give up)."""

    def send(ctx: ChaosContext) -> list[Outcome]:
        from chaos.traffic import Client

        client = Client(ctx.config.api_url, ctx.headers)
        body = predict_body("long", seed=1, width=width, height=width, num_inference_steps=steps)
        timeout = ctx.timeouts["sd15-txt2img"]
        return [client.predict("sd15-txt2img", body, timeout, {"long"}, cancel_job) for _ in range(count)]

    return send


def api_sigterm(ctx: ChaosContext, seconds: float = 30) -> ScenarioResult:
    return run_scenario(
        ctx, "API SIGTERM under load", "sleep", 8, seconds, [(5, lambda c: c.signal("api", signal.SIGTERM))],
        extra=_long_requests(2),
    )  # fmt: skip


def worker_sigterm(ctx: ChaosContext, seconds: float = 30) -> ScenarioResult:
    faults = [(5, lambda c: c.signal("worker-synthetic", signal.SIGTERM))]
    return run_scenario(ctx, "worker SIGTERM under load", "sleep", 12, seconds, faults)


def poison(ctx: ChaosContext, seconds: float = 30) -> ScenarioResult:
    def body(index: int) -> dict:
        prompt = "!crash poison" if index % 10 == 0 else f"good {uuid.uuid4().hex[:6]}"
        return predict_body(prompt, seed=index)

    return run_scenario(ctx, "poison request among good ones", "sleep", 8, seconds, [], body=body)


def abandoned_long(ctx: ChaosContext, seconds: float = 40) -> ScenarioResult:
    def body(index: int) -> dict:
        return predict_body(f"short {uuid.uuid4().hex[:6]}", seed=index, width=64, height=64, num_inference_steps=2)

    return run_scenario(
        ctx, "abandoned long request ahead of short ones", "sd15-txt2img", 4, seconds, [], body=body,
        extra=_long_requests(1, width=1024, steps=50, cancel_job=True),
    )  # fmt: skip


def rate_limited_burst(ctx: ChaosContext, requests_total: int = 500, concurrency: int = 50) -> ScenarioResult:
    """500 requests at once from a key limited to 60 a minute and 4 at a time: each is served or told 429."""
    from concurrent.futures import ThreadPoolExecutor

    from chaos.traffic import Client

    result = ScenarioResult("burst of 500 on a rate-limited key")
    if ctx.limited_headers is None:
        result.notes.append("no rate-limited key configured: skipped")
        return result
    began = time.monotonic()

    def send(index: int) -> Outcome:
        client = Client(ctx.config.api_url, ctx.limited_headers)
        return client.predict("noop", predict_body(f"burst {index}", seed=index), ctx.timeouts["noop"])

    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(send, range(requests_total)))
    result.record(outcomes)
    if not result.errors_by_status.get(429):
        result.notes.append("no request was refused: the limits did not apply")
        result.unanswered += 1  # a limit that does not hold is a failure of this scenario
    expected = [outcome.request_id for outcome in outcomes if outcome.request_id]
    result.record_rows(expected, row_copies(ctx.bigquery, ctx.settings, expected, ctx.row_wait_seconds))
    result.leaked_subscriptions = len(leaked_reply_subscriptions(ctx.subscriber, ctx.settings.project_id))
    result.seconds = round(time.monotonic() - began, 1)
    return result


def slow_clients(ctx: ChaosContext, seconds: float = 20, connections: int = 1000) -> ScenarioResult:
    """Sequential predicts alone, then beside `connections` idle or slow connections, then alone again: every
    predict must be answered; the latencies are printed side by side (target: p50 within 10% of alone)."""
    from chaos.slow_clients import SlowClients, sequential_predicts

    result = ScenarioResult(f"{connections} idle or slow connections")
    began = time.monotonic()
    url = ctx.config.api_url
    host, port = url.removeprefix("http://").rsplit(":", 1)
    alone = sequential_predicts(url, ctx.headers, seconds / 2, "alone")
    with SlowClients(host, int(port), connections, ctx.headers["Authorization"]) as slow:
        beside = sequential_predicts(url, ctx.headers, seconds, f"beside {connections} slow connections")
        held = slow.open_now
    again = sequential_predicts(url, ctx.headers, seconds / 2, "alone again")
    for latencies in (alone, beside, again):
        result.sent += len(latencies.seconds) + len(latencies.failures)
        result.ok += len(latencies.seconds)
        result.unanswered += len(latencies.failures)
    ratio = beside.p50 / ((alone.p50 + again.p50) / 2)
    result.notes += [
        alone.line(),
        beside.line(),
        again.line(),
        f"p50 beside / alone {ratio:.2f} (target at most 1.10: {'met' if ratio <= 1.1 else 'MISSED'}); "
        f"{held} slow connections open at the end, {slow.closed_by_server} closed by the API's read timeouts "
        f"and reopened, {slow.refused} refused",
    ]
    result.seconds = round(time.monotonic() - began, 1)
    return result


SCENARIOS: dict[str, Callable[[ChaosContext], ScenarioResult]] = {
    "worker-kill": worker_kill,
    "worker-kill-held": worker_kill_held,
    "redis-outage": redis_outage,
    "bigquery-pause": bigquery_pause,
    "bigquery-restart": bigquery_restart,
    "pubsub-restart": pubsub_restart,
    "api-sigterm": api_sigterm,
    "worker-sigterm": worker_sigterm,
    "poison": poison,
    "abandoned-long": abandoned_long,
    "rate-limited-burst": rate_limited_burst,
    "slow-clients": slow_clients,
    "batch": lambda ctx: batch_faults(ctx),
    "overload": lambda ctx: overload(ctx),
}
QUICK = ("worker-kill", "redis-outage", "api-sigterm")
