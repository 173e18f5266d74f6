"""Bring your own model, end to end: a FLUX fine-tune shared as one file is imported as version 2 of a served
model, answers pinned requests at 0% of the traffic, then takes a canary share, is promoted and rolled back.
The file's transformer differs from the base's in every tensor, and version 2's images are the file's, not
the base's (version 1's).

The catalog is read when a process starts, so the test writes the catalog an operator would (the local overlay
plus the model, its new version at 0%) and starts a worker and an API process on it, as the stack starts its
own: real Pub/Sub, GCS, Redis and BigQuery; the traffic calls and the log rows are the stack's own.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import requests
import yaml
from PIL import Image

from api_server.versions.traffic import choose_version
from contract.catalog import load_catalog
from emulators.processes import ProcessRegistry, http_ok, wait_port_free
from emulators.stack import LOCAL_CATALOG_OVERLAY, ROOT
from tests.conftest import TEST_ADMIN_KEY, query_rows
from tests.single_file_checkpoints import CARRIED, fine_tune, write_flux_checkpoint

pytestmark = pytest.mark.stack
MODEL = "byom-flux"
ADMIN = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}
HEALTH_INDEX = 70


def catalog_with_the_new_version(path):
    """The local overlay plus the model: version 1 served, version 2 (the import's) listed at 0%."""
    overlay = yaml.safe_load(LOCAL_CATALOG_OVERLAY.read_text())
    entry = {**overlay["models"]["flux-versions"], "worker_group": MODEL, "weights_path": f"{MODEL}/1"}
    entry["versions"] = {"1": {}, "2": {"weights_path": f"{MODEL}/2"}}
    entry["traffic"] = {"1": 100, "2": 0}
    overlay["models"][MODEL] = entry
    path.write_text(yaml.safe_dump(overlay))
    return path


@pytest.fixture(scope="module")
def byom(stack, settings, tmp_path_factory):
    """Imports both versions: version 1 the served base (a diffusers folder), version 2 a fine-tune of it shared as
    one file, its transformer (all a FLUX file carries) changed in every tensor. The work folder, base, fine-tune."""
    from contract import google_clients
    from emulators.tiny_pipeline import build_pipeline
    from model_worker.weights.importer import import_model

    work = tmp_path_factory.mktemp("byom")
    storage = google_clients.storage_client(settings)
    base = build_pipeline(work / "base", "FluxPipeline", "none")
    import_model(storage, settings.model_bucket, base, MODEL, "1", "flux")
    tuned = fine_tune(base, work / "tuned", CARRIED["flux"])
    finetune = write_flux_checkpoint(tuned, work / "my-flux-finetune.safetensors")
    done = subprocess.run(
        [sys.executable, "-m", "model_worker.weights", "import", str(finetune), "--model", MODEL, "--version", "2",
         "--base", f"gs://{settings.model_bucket}/{MODEL}/1"],
        cwd=ROOT, env={**stack.client_env(), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f'"2": {{weights_path: {MODEL}/2, pipeline: FluxPipeline}}' in done.stdout
    return work, base, tuned


@pytest.fixture(scope="module")
def served(stack, byom):
    """Starts the model's worker and an API process on the catalog with the new version; its URL."""
    from contract.settings import Settings
    from emulators.bootstrap import bootstrap_pubsub

    work = byom[0]
    overlay = catalog_with_the_new_version(work / "models.yaml")
    catalog = load_catalog(None, str(overlay))
    bootstrap_pubsub(Settings.from_env({**stack.service_env(), "MAAS_CATALOG_OVERLAY": str(overlay)}), catalog)
    registry = ProcessRegistry(stack.stack_dir)
    service = {**stack.service_env(), "MAAS_CATALOG_OVERLAY": str(overlay)}
    health = f"http://127.0.0.1:{stack.worker_health_port(HEALTH_INDEX)}/readyz"
    api_port = stack.worker_health_port(HEALTH_INDEX + 1)  # a port of the range the tests keep for extra processes
    assert wait_port_free(api_port, timeout=10)
    worker = {**service, "MAAS_MODELS": ",".join(spec.queue for spec in catalog.deployments()[MODEL]),
              "MAAS_WORKER_HEALTH_PORT": str(stack.worker_health_port(HEALTH_INDEX)),
              "MAAS_WORKER_HEALTH_HOST": "127.0.0.1", "MAAS_WEIGHTS_CACHE_DIR": str(work / "weights"),
              "MAAS_TORCH_THREADS": "1"}  # fmt: skip
    api = {**service, "PORT": str(api_port), "MAAS_API_HOST": "127.0.0.1", "MAAS_API_WORKERS": "1",
           "MAAS_LOG_SPOOL_DIR": str(work / "log-spool")}  # fmt: skip
    names = ("worker-byom", "api-byom")
    try:
        registry.start(names[0], [sys.executable, "-m", "model_worker"], worker, cwd=ROOT)
        registry.start(names[1], [sys.executable, "-m", "gunicorn", "--config", "api_server/process/gunicorn_conf.py",
                                  "api_server.process.asgi:app"], api, cwd=ROOT)  # fmt: skip
        url = f"http://127.0.0.1:{api_port}"
        registry.wait_until(names[0], lambda: http_ok(health), timeout=180)
        registry.wait_until(names[1], lambda: http_ok(f"{url}/healthz"), timeout=180)  # a hang bound: a busy machine
        yield url
    finally:
        for name in names:
            registry.stop(name, timeout=30)


def predict(url, auth_headers, version: str | None = None, body: dict | None = None) -> tuple[str, str]:
    """(the version that answered, the request id)."""
    return answer(url, auth_headers, version, body)[:2]


def answer(url, auth_headers, version: str | None = None, body: dict | None = None) -> tuple[str, str, dict]:
    """(the version that answered, the request id, the reply's body)."""
    path = f"/v1/models/{MODEL}/versions/{version}:predict" if version else f"/v1/models/{MODEL}:predict"
    body = body or {"instances": [{"prompt": f"byom {uuid.uuid4().hex}"}], "parameters": {"num_inference_steps": 2}}
    response = requests.post(url + path, json=body, headers=auth_headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["model_version"], response.headers["X-Request-Id"], response.json()


def rendered(folder, version: str, body: dict) -> np.ndarray:
    """The image the worker's runner makes from the weights in `folder` for `body`, in this process (uint8)."""
    from api_server.predict.schemas import PredictBody, resolve_parameters
    from model_worker.model.pipeline import DiffusionRunner
    from model_worker.model.runners import GenerationItem

    spec = load_catalog(None, str(catalog_with_the_new_version(folder.parent / "render.yaml"))).unit(
        f"{MODEL}--{version}"
    )
    params = resolve_parameters(PredictBody.model_validate(body), spec)
    item = GenerationItem(prompt=body["instances"][0]["prompt"], seed=params.seed)
    image = DiffusionRunner(spec, folder).generate([item], params, lambda step, total: None)[0]
    return (np.clip(image, 0, 1) * 255).round().astype(np.int16)


def test_the_imported_version_serves_the_files_weights_not_the_bases(served, byom, auth_headers):
    """Version 2's images are the fine-tune's, made from the file's transformer; version 1's the base's. (Within
    2/255: the worker batches step by step, on its own thread count, which moves a pixel by a rounding.)"""
    _, base, tuned = byom
    body = {"instances": [{"prompt": "a lighthouse at dawn"}], "parameters": {"num_inference_steps": 2, "seed": 11}}
    served_images = {}
    for version in ("1", "2"):
        answered, _, reply = answer(served, auth_headers, version, body)
        assert answered == version
        png = base64.b64decode(reply["predictions"][0]["image_b64"])
        served_images[version] = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    from_base, from_file = rendered(base, "1", body), rendered(tuned, "2", body)
    assert np.abs(served_images["1"] - from_base).max() <= 2
    assert np.abs(served_images["2"] - from_file).max() <= 2
    assert np.abs(served_images["2"] - from_base).max() > 2 * 2, "version 2 answers with the base's images"


def set_traffic(url, traffic: dict | None) -> dict:
    """Sets the split (None: back to the catalog's) and waits until the API process applies it; returns it."""
    target = f"{url}/v1/models/{MODEL}/traffic"
    if traffic is None:
        response = requests.delete(target, headers=ADMIN, timeout=10)
    else:
        response = requests.put(target, json={"traffic": traffic, "reason": "byom test"}, headers=ADMIN, timeout=10)
    assert response.status_code == 200, response.text
    wanted = response.json()["traffic"]
    deadline = time.monotonic() + 60  # bounds a hang only: the split is re-read every 0.5 s
    while requests.get(f"{url}/v1/models/{MODEL}", headers=ADMIN, timeout=10).json()["traffic"]["traffic"] != wanted:
        assert time.monotonic() < deadline, f"the split {wanted} never came in force"
        time.sleep(0.1)
    return wanted


def test_the_imported_version_answers_pinned_requests_while_it_takes_no_traffic(served, auth_headers):
    assert predict(served, auth_headers, "2")[0] == "2"
    assert {predict(served, auth_headers)[0] for _ in range(4)} == {"1"}


def test_the_imported_version_as_a_canary_then_promoted_then_rolled_back(served, auth_headers, bigquery, settings):
    try:
        split = set_traffic(served, {"1": 50, "2": 50})
        answered = [predict(served, auth_headers) for _ in range(20)]  # all 20 on one version: p = 2e-6
        assert {version for version, _ in answered} == {"1", "2"}
        assert all(version == choose_version(split, request_id) for version, request_id in answered)
        table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
        ids = ", ".join(f"'{request_id}'" for _, request_id in answered)
        rows = query_rows(bigquery, f"SELECT request_id, model, model_version FROM {table} WHERE request_id IN ({ids})",
                          len(answered), timeout=60)  # fmt: skip
        assert {row["request_id"]: (row["model"], row["model_version"]) for row in rows} == {
            request_id: (MODEL, version) for version, request_id in answered
        }
        set_traffic(served, {"1": 0, "2": 100})  # promote
        assert {predict(served, auth_headers)[0] for _ in range(3)} == {"2"}
        set_traffic(served, None)  # roll back: the catalog's split
        assert {predict(served, auth_headers)[0] for _ in range(3)} == {"1"}
    finally:
        requests.delete(f"{served}/v1/models/{MODEL}/traffic", headers=ADMIN, timeout=10)
