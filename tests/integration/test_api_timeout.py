"""The API's timeout path over HTTP, with a catalog model that has a queue but no worker."""

from __future__ import annotations

import time
import uuid
from datetime import datetime

import pytest
import yaml
from google.api_core import exceptions

from api_server.process.app import create_app
from api_server.process.state import app_state
from contract import google_clients, naming
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.messages import InferenceReply
from contract.settings import Settings
from emulators.bootstrap import bootstrap_pubsub
from tests.conftest import query_rows

pytestmark = pytest.mark.stack
GHOST = "ghost-txt2img"


@pytest.fixture(scope="module")
def ghost_app(stack, settings, tmp_path_factory):
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    raw["models"][GHOST] = {**raw["models"]["sd15-txt2img"], "weights_path": "ghost/1"}
    path = tmp_path_factory.mktemp("catalog") / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    bootstrap_pubsub(settings, ModelCatalog.from_yaml(path))
    app_settings = Settings.from_env({**stack.service_env(), "MAAS_CATALOG_PATH": str(path)})
    app = create_app(app_settings)
    # A 2 s timeout keeps the test short; the catalog itself refuses it (ack deadlines are at least 10 s and
    # at most a third of the timeout), so it is set on the loaded entry.
    catalog = app_state(app).catalog
    catalog.models[GHOST] = catalog.models[GHOST].model_copy(update={"request_timeout_seconds": 2})
    yield app
    app_state(app).close()


def test_reply_that_never_comes_hands_over_a_job_and_the_subscription_is_deleted(
    ghost_app, auth_headers, settings, bigquery
):
    client = ghost_app.test_client()
    arrived = time.time()
    response = client.post(
        f"/v1/models/{GHOST}:predict",
        json={
            "instances": [{"prompt": "nobody listens"}],
            "parameters": {"seed": 1, "num_inference_steps": 2, "width": 64, "height": 64},
        },
        headers=auth_headers,
    )
    # The work is not lost: the request stays queued as a job the caller can poll.
    assert response.status_code == 202
    accepted = response.get_json()
    assert GHOST in accepted["message"] and response.headers["Location"] == f"/v1/jobs/{accepted['id']}"
    answered = time.time()
    queued = client.get(response.headers["Location"], headers=auth_headers).get_json()
    assert queued["status"] == "queued" and queued["started_at"] is None and queued["finished_at"] is None
    # Created when the request arrived, not when the 202 left the model's timeout (2 s) later.
    created = datetime.fromisoformat(queued["created_at"]).timestamp()
    assert arrived - 0.01 <= created < answered - 1.9, (arrived, created, answered)
    subscription = google_clients.subscriber_client().subscription_path(
        settings.project_id, naming.reply_subscription(accepted["id"])
    )
    with pytest.raises(exceptions.NotFound):
        google_clients.subscriber_client().get_subscription(request={"subscription": subscription})
    # Its log row waits for the job's outcome: here a worker answers `expired` (as one would that pulled it late).
    serving = app_state(ghost_app)
    serving.results.put(
        InferenceReply(
            request_id=accepted["id"], model=GHOST, model_version="1", status="expired", error_kind="expired",
            error="deadline passed before a worker was free", worker_id="late-worker", attempt=1,
            answered_ms=int(answered * 1000) + 500,
        )
    )  # fmt: skip
    ended = client.get(response.headers["Location"], headers=auth_headers).get_json()
    assert ended["status"] == "expired" and ended["started_at"] is None
    assert datetime.fromisoformat(ended["finished_at"]).timestamp() == (int(answered * 1000) + 500) / 1000
    # Written now, or already by the app's own job-log round (on a busy machine it may claim the row first): the row
    # query below finds it exactly once either way.
    serving.job_log.finish_ended()
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    columns = "status, http_status, endpoint, job_id, worker_id, created_at, replied_at, total_ms"
    [row] = query_rows(bigquery, f"SELECT {columns} FROM {table} WHERE request_id = '{accepted['id']}'", 1)
    # The job's end is the worker's answer, half a second after the 202: its total runs to there, end to end.
    assert row.pop("created_at").timestamp() == pytest.approx(created, abs=0.001)  # the job's, in ms
    assert row.pop("replied_at") == datetime.fromisoformat(ended["finished_at"])
    assert row.pop("total_ms") == pytest.approx((int(answered * 1000) + 500) - created * 1000, abs=1.5)
    assert row == {
        "status": "expired",
        "http_status": 202,
        "endpoint": "job",
        "job_id": accepted["id"],
        "worker_id": "late-worker",
    }
    # The unanswered request is still queued for the (absent) workers: nothing was silently dropped.
    subscriber = google_clients.subscriber_client()
    queued = subscriber.subscription_path(settings.project_id, naming.worker_subscription(GHOST))
    pulled = subscriber.pull(request={"subscription": queued, "max_messages": 10}, timeout=10)
    assert accepted["id"] in {m.message.attributes["request_id"] for m in pulled.received_messages}


def test_queue_unavailable_is_503(stack, auth_headers, tmp_path):
    # A catalog model whose topic was never created: publishing fails, the client is told to retry.
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    name = f"missing-{uuid.uuid4().hex[:6]}"
    raw["models"][name] = dict(raw["models"]["sd15-txt2img"])
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    app = create_app(Settings.from_env({**stack.service_env(), "MAAS_CATALOG_PATH": str(path)}))
    try:
        response = app.test_client().post(
            f"/v1/models/{name}:predict",
            json={"instances": [{"prompt": "x"}], "parameters": {"width": 64, "height": 64}},
            headers=auth_headers,
        )
    finally:
        app_state(app).close()
    assert response.status_code == 503
    assert response.headers["Retry-After"]
