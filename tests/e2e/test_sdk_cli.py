"""The SDK and the `maas` command line against the real local stack: no mocks, the public HTTP API only."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import typing
import uuid
from pathlib import Path

import pytest
import requests
from PIL import Image
from pydantic import BaseModel
from typer.testing import CliRunner

from emulators.processes import ProcessRegistry, http_ok
from emulators.stack import restart
from maas_client import AsyncClient, Client, JobCancelled, Unauthorized, ValidationError, cli, types
from tests.conftest import TEST_API_KEYS, query_rows

pytestmark = pytest.mark.stack
MAAS = str(Path(sys.executable).parent / "maas")
TINY = {"size": "64x64", "steps": 4}


@pytest.fixture
def client(stack):
    with Client(stack.api_url, TEST_API_KEYS[0]) as maas:
        yield maas


def run_cli(stack, *args: str, key: str = TEST_API_KEYS[0], tmp_path: Path | None = None):
    env = {"MAAS_URL": stack.api_url, "MAAS_API_KEY": key, "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:  # a checkout other than the one the console script was installed from
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if tmp_path is not None:
        env["MAAS_HOME"] = str(tmp_path / "home")
    return subprocess.run([MAAS, *args], env=env, capture_output=True, text=True, timeout=120)


def test_sdk_types_match_the_servers_openapi_document(stack):
    components = requests.get(f"{stack.api_url}/openapi.json", timeout=10).json()["components"]["schemas"]
    checked = []
    for name, model in vars(types).items():
        if not (isinstance(model, type) and issubclass(model, BaseModel) and name in components):
            continue
        ours, theirs = model.model_json_schema(by_alias=True), components[name]
        assert set(ours["properties"]) == set(theirs["properties"]), name
        assert set(ours.get("required", [])) == set(theirs.get("required", [])), name
        for field, schema in theirs["properties"].items():
            if "enum" in schema:
                assert set(ours["properties"][field]["enum"]) == set(schema["enum"]), (name, field)
        checked.append(name)
    assert {"ModelInfo", "PredictResponse", "JobView", "JobList", "JobAccepted", "Usage", "Prediction"} <= set(checked)


def test_models_lists_the_catalog_with_each_models_versions(client):
    models = {model.name: model for model in client.models()}
    assert {"noop", "sd15-txt2img"} <= set(models) and client.model("noop").task == "text-to-image"
    assert models["noop"].versions == [models["noop"].version]
    assert models["canary"].versions == ["1", "2"] and models["canary"].version == "1"


def test_cli_models_piped_shows_every_name_whole(stack, client):
    """`maas models | cat`: plain rows, nothing cut (a table at 80 columns printed `sd15-txt…`)."""
    done = run_cli(stack, "models")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert {row[0] for row in rows} == {model.name for model in client.models()}, done.stdout
    versions = {row[0]: row[1] for row in rows}
    assert versions["canary"] == "1*,2" and versions["noop"] == "1"
    families = {row[0]: row[2] for row in rows}
    assert families["sdxl-txt2img"] == "sdxl" and families["flux-schnell"] == "flux" and families["noop"] == "-"
    assert "…" not in done.stdout


def test_cli_predict_as_a_user_first_types_it_answers_in_seconds(stack, tmp_path):
    """`maas predict sdxl-txt2img "a lighthouse at dawn"`, no options: the local stack's small defaults for its tiny
    pipelines (256x256, 8 steps) answer in seconds; the catalog's 1024x1024 at 30 steps ran past 5 minutes on CPU.
    Checked by what ran (the size and the steps the progress counted), not by a clock; `run_cli`'s 120 s ends a
    run that took the catalog's defaults."""
    done = run_cli(stack, "predict", "sdxl-txt2img", "a lighthouse at dawn", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "8/8" in done.stderr and "/30" not in done.stderr, done.stderr
    [path] = tmp_path.glob("*.png")
    assert Image.open(path).size == (256, 256)


def test_an_sdk_call_across_an_api_restart_longer_than_10s_succeeds_once_with_one_row(stack, bigquery, settings):
    """The API is stopped for 12 s and started again (`restart`, as `make restart-api` with an outage): a call
    made while it is gone retries until it is back, is answered once, and leaves one log row."""
    registry = ProcessRegistry(stack.stack_dir)
    before = registry.pid("api")
    outage = threading.Thread(target=restart, args=(stack, "api"), kwargs={"stopped_for": 12.0}, daemon=True)
    outage.start()
    deadline = time.monotonic() + 60
    while http_ok(f"{stack.api_url}/healthz"):
        assert time.monotonic() < deadline, "the API did not stop"
        time.sleep(0.1)
    seed = random.randrange(10**9)  # the call's rows are found by it (retries carry it too)
    began = time.monotonic()
    try:
        with Client(stack.api_url, TEST_API_KEYS[0]) as maas:
            result = maas.predict("noop", f"across a restart {uuid.uuid4().hex}", seed=seed)
        waited = time.monotonic() - began
    finally:
        outage.join(timeout=120)  # the API is back for the next test, whatever happened here
    assert not outage.is_alive() and registry.pid("api") != before
    assert result.seed == seed and waited > 5, waited  # it rode out the outage, not a lucky first try
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    sql = f"SELECT request_id, status, http_status FROM {table} WHERE model = 'noop' AND seed = {seed}"
    assert query_rows(bigquery, sql, 1, timeout=60)
    rows = query_rows(bigquery, sql, 2, timeout=10)  # a second row gets 10 s more to show up
    assert [(row["request_id"], row["status"], row["http_status"]) for row in rows] == [(result.request_id, "ok", 200)]


def test_cli_predict_shows_the_same_live_progress_as_jobs_wait(stack, tmp_path):
    done = run_cli(stack, "predict", "sd15-txt2img", f"progress {uuid.uuid4().hex}", "--size", "128x128",
                   "--steps", "30", "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "sd15-txt2img" in done.stderr and "step" in done.stderr and "30/30" in done.stderr, done.stderr
    assert len(list(tmp_path.glob("*.png"))) == 1


def test_predict_returns_a_png_of_the_asked_size(client):
    result = client.predict("sd15-txt2img", f"lighthouse {uuid.uuid4().hex}", size="64x64", steps=2, seed=11, n=2)
    assert result.seeds == [11, 12] and result.request_id and result.timings_ms["inference"] > 0
    for data in result.images:
        image = Image.open(io.BytesIO(data))
        assert image.format == "PNG" and image.size == (64, 64)


def test_a_job_is_followed_to_its_end_with_strictly_increasing_progress(client):
    job = client.submit("sd15-txt2img", f"progress {uuid.uuid4().hex}", size="64x64", steps=40, seed=5)
    steps: list[tuple[int, int]] = []
    result = job.wait(on_progress=lambda step, total: steps.append((step, total)))
    assert result.job_id == job.id and result.seed == 5
    assert steps and all(later[0] > earlier[0] for earlier, later in zip(steps, steps[1:], strict=False)), steps
    assert job.status().status == "succeeded"


def test_a_cancelled_job_raises_job_cancelled(client):
    # Many steps at 256 px keep the tiny pipeline busy for seconds; the cancel stops it at its next step.
    job = client.submit("sd15-txt2img", f"cancel {uuid.uuid4().hex}", size="256x256", steps=50)
    assert job.cancel().status == "cancelled"
    with pytest.raises(JobCancelled):
        job.wait()


def test_a_422_names_its_field(client):
    with pytest.raises(ValidationError) as caught:
        client.predict("noop", "too wide", size="4096x64")
    assert caught.value.field == "parameters.width" and caught.value.status == 422


def test_a_retry_after_a_dropped_connection_does_not_run_the_model_twice(stack):
    """A proxy forwards each request to the API but drops the client's connection on the first answer:
    the SDK retries with the same Idempotency-Key and gets the first run's answer replayed."""
    proxy = DroppingProxy(stack.api_port)
    with Client(f"http://127.0.0.1:{proxy.port}", TEST_API_KEYS[0]) as maas:
        maas.retry.base_seconds = 0.05
        result = maas.predict("noop", f"dropped {uuid.uuid4().hex}")
    proxy.close()
    first, second = proxy.answers
    assert first["key"] == second["key"] and first["key"].startswith("maas-sdk-")
    assert second["replayed"] == "true" and first["replayed"] is None
    # The model ran for the first request only: both answers name it.
    assert first["body_request_id"] == first["request_id"] == second["body_request_id"] == result.request_id


def test_the_asyncio_client_runs_16_predicts_concurrently(stack):
    async def main():
        async with AsyncClient(stack.api_url, TEST_API_KEYS[0]) as maas:
            prompts = [f"async {i} {uuid.uuid4().hex}" for i in range(16)]
            return await asyncio.gather(*(maas.predict("noop", prompt, seed=i) for i, prompt in enumerate(prompts)))

    results = asyncio.run(main())
    assert [result.seed for result in results] == list(range(16))
    assert len({result.request_id for result in results}) == 16


def test_cli_predict_writes_pngs_and_prints_paths_request_id_and_timings(stack, tmp_path):
    out = tmp_path / "out"
    done = run_cli(stack, "predict", "sd15-txt2img", f"cli {uuid.uuid4().hex}", "--size", "64x64", "--steps", "2",
                   "--n", "2", "--seed", "3", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    paths = sorted(out.glob("*.png"))
    assert len(paths) == 2 and all(str(path) in done.stdout for path in paths)
    assert Image.open(paths[0]).size == (64, 64)
    assert "request id" in done.stdout and "inference" in done.stdout


def test_cli_jobs_submit_wait_status_and_list_with_json(stack, tmp_path):
    submitted = run_cli(stack, "--json", "jobs", "submit", "noop", f"j {uuid.uuid4().hex}", tmp_path=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    waited = run_cli(stack, "--json", "jobs", "wait", job_id, "--out", str(tmp_path), tmp_path=tmp_path)
    assert waited.returncode == 0, waited.stderr
    assert json.loads(waited.stdout)["job_id"] == job_id and (tmp_path / f"{job_id}-0.png").exists()
    status = json.loads(run_cli(stack, "--json", "jobs", "status", job_id, tmp_path=tmp_path).stdout)
    assert status["status"] == "succeeded"
    listed = json.loads(run_cli(stack, "--json", "jobs", "list", "--limit", "1", tmp_path=tmp_path).stdout)
    assert [row["id"] for row in listed] == [job_id]  # the server's list: this key's newest job
    with Client(stack.api_url, TEST_API_KEYS[0]) as client:
        assert next(iter(client.list_jobs(state="succeeded"))).id == job_id
        assert [view.id for view in client.list_jobs(limit=3)][0] == job_id
    refused = run_cli(stack, "jobs", "cancel", job_id)
    assert refused.returncode == 1 and "already finished" in refused.stderr


def test_cli_exit_codes_bad_key_bad_flags_and_unreachable(stack, tmp_path):
    bad_key = run_cli(stack, "models", key="not-a-key")
    assert bad_key.returncode == 3 and "invalid API key" in bad_key.stderr
    # Flags are refused before any request: in-process (the same app the console script runs), no server needed.
    (tmp_path / "notes.png").write_text("not an image")
    for args, message in [
        (["predict", "noop", "x", "--size", "64by64"], "WIDTHxHEIGHT"),
        (["predict", "noop", "x", "--steps", "0"], "--steps"),
        (["predict", "sd15-img2img", "x", "--image", str(tmp_path / "missing.png")], "not found"),
        (["predict", "sd15-img2img", "x", "--image", str(tmp_path / "notes.png")], "not a PNG"),
        (["usage", "--since", "last week"], "--since"),
        (["jobs", "list", "--state", "done"], "--state"),
        (["jobs", "list", "--limit", "0"], "--limit"),
    ]:
        done = CliRunner().invoke(cli.app, args, env={"MAAS_URL": "http://127.0.0.1:9", "MAAS_API_KEY": "k"})
        assert done.exit_code == 2 and message in done.stderr, (args, done.output)
        assert "Traceback" not in done.output and isinstance(done.exception, SystemExit)
    # An unreachable API is retried until the retry deadline (MAAS_RETRY_DEADLINE; 60 s by default), then refused.
    env = {"MAAS_URL": f"http://127.0.0.1:{free_port()}", "MAAS_API_KEY": "k", "PATH": "/usr/bin:/bin",
           "MAAS_RETRY_DEADLINE": "2"}  # fmt: skip
    down = subprocess.run([MAAS, "models"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 5 and down.stderr.count("\n") == 1 and "cannot reach" in down.stderr
    invalid = run_cli(stack, "predict", "noop", "x", "--size", "4096x64")
    assert invalid.returncode == 1 and "parameters.width" in invalid.stderr


def test_cli_usage_shows_only_the_callers_key(stack):
    with Client(stack.api_url, "wrong") as stranger, pytest.raises(Unauthorized):
        stranger.usage()
    with Client(stack.api_url, TEST_API_KEYS[0]) as maas:
        mine = maas.usage("1d")
    done = run_cli(stack, "--json", "usage", "--since", "1d")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["api_key_id"] == mine.api_key_id and all(row["requests"] >= 0 for row in report["days"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class DroppingProxy:
    """Forwards HTTP requests to the API; the first answer is dropped (the client's connection is closed)."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = f"http://127.0.0.1:{upstream_port}"
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.answers: list[dict[str, typing.Any]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        method, path, _ = reader.readline().decode().split(" ", 2)
        headers = {}
        while (line := reader.readline().decode().strip()) != "":
            name, _, value = line.partition(":")
            headers[name.strip()] = value.strip()
        body = reader.read(int(headers.get("Content-Length", headers.get("content-length", "0"))))
        forward = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection", "content-length")}
        response = requests.request(method, self._upstream + path, headers=forward, data=body, timeout=60)
        self.answers.append({
            "key": headers.get("Idempotency-Key") or headers.get("idempotency-key"),
            "replayed": response.headers.get("Idempotent-Replayed"),
            "request_id": response.headers.get("X-Request-Id"),
            "body_request_id": response.json().get("request_id"),
        })  # fmt: skip
        if len(self.answers) == 1:
            return  # dropped: closed without an answer
        head = f"HTTP/1.1 {response.status_code} OK\r\nContent-Type: application/json\r\n"
        for name in ("X-Request-Id", "Idempotent-Replayed"):
            if name in response.headers:
                head += f"{name}: {response.headers[name]}\r\n"
        head += f"Content-Length: {len(response.content)}\r\nConnection: close\r\n\r\n"
        conn.sendall(head.encode() + response.content)

    def close(self) -> None:
        self._server.close()
