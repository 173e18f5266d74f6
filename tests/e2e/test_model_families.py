"""SDXL and FLUX.1 on the local stack: predict, jobs with progress, the family's 422s, rows with the family.

The tiny pipelines of each family are served by their own workers exactly as SD 1.5's: real Pub/Sub, Redis,
GCS-downloaded weights and BigQuery rows.
"""

from __future__ import annotations

import random
import uuid

import pytest
import requests

from tests.conftest import query_rows
from tests.e2e.test_job_events import events, open_stream, submit

pytestmark = pytest.mark.stack
NEW_FAMILIES = {"sdxl-txt2img": "sdxl", "flux-schnell": "flux"}


def predict(stack, auth_headers, model: str, **parameters) -> requests.Response:
    body = {"instances": [{"prompt": f"family {uuid.uuid4().hex}"}], "parameters": {"width": 64, "height": 64,
                                                                                     **parameters}}  # fmt: skip
    return requests.post(f"{stack.api_url}/v1/models/{model}:predict", json=body, headers=auth_headers, timeout=90)


@pytest.mark.parametrize("model", list(NEW_FAMILIES))
def test_each_new_family_answers_predict_and_logs_its_family(stack, auth_headers, bigquery, settings, model):
    seed = random.randrange(10**6)
    response = predict(stack, auth_headers, model, seed=seed, num_inference_steps=3)
    assert response.status_code == 200, response.text
    prediction = response.json()["predictions"][0]
    assert prediction["seed"] == seed and prediction["image_b64"]
    request_id = response.headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=60)
    assert len(rows) == 1
    assert (rows[0]["status"], rows[0]["model"], rows[0]["model_family"]) == ("ok", model, NEW_FAMILIES[model])


@pytest.mark.parametrize("model", list(NEW_FAMILIES))
def test_each_new_family_runs_a_job_with_progress_events(stack, auth_headers, model):
    # Long enough on the tiny pipelines (about a second) for several progress ticks.
    steps, size = (8, 256) if model == "flux-schnell" else (40, 128)
    job_id = submit(stack, model, auth_headers, f"job {uuid.uuid4().hex}", num_inference_steps=steps, seed=5,
                    width=size, height=size)  # fmt: skip
    with open_stream(stack, job_id, auth_headers) as response:
        assert response.status_code == 200
        seen = list(events(response))
    kinds = [kind for kind, _, _ in seen]
    assert kinds[-1] == "succeeded", kinds
    steps_seen = [data["progress"]["step"] for kind, _, data in seen if kind == "running"]
    assert steps_seen and steps_seen == sorted(set(steps_seen)) and max(steps_seen) <= steps
    assert seen[-1][2]["result"]["predictions"][0]["seed"] == 5


def test_the_family_rules_are_422s_naming_the_field(stack, auth_headers):
    cases = [
        ("flux-schnell", {"width": 72}, "parameters.width"),
        ("flux-schnell", {"negative_prompt": "blurry"}, "parameters.negative_prompt"),
        ("flux-schnell", {"guidance_scale": 3.5}, "parameters.guidance_scale"),
        ("sdxl-txt2img", {"adapters": [{"name": "tiny-ink", "scale": 1.0}]}, "parameters.adapters"),
    ]
    for model, parameters, field in cases:
        response = predict(stack, auth_headers, model, **parameters)
        assert response.status_code == 422, (model, parameters, response.text)
        assert response.json()["error"]["field"] == field


def test_the_model_list_shows_each_family(stack, auth_headers):
    response = requests.get(f"{stack.api_url}/v1/models", headers=auth_headers, timeout=10)
    families = {model["name"]: (model["family"], model["guidance"]) for model in response.json()["models"]}
    assert families["sd15-txt2img"] == ("sd15", "cfg")
    assert families["sdxl-txt2img"] == ("sdxl", "cfg")
    assert families["flux-schnell"] == ("flux", "none")


def test_a_versioned_model_under_step_scheduling_serves_each_version_pinned_and_through_the_split(stack, auth_headers):
    # Each version's worker steps on its own runner (keyed `{model}--{version}`): the defect that killed the
    # worker at its first step looked the runner up by the model's name.
    base = f"{stack.api_url}/v1/models/flux-versions"
    for version in ("1", "2"):
        body = {"instances": [{"prompt": f"pinned {uuid.uuid4().hex}"}], "parameters": {"num_inference_steps": 2}}
        response = requests.post(f"{base}/versions/{version}:predict", json=body, headers=auth_headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model_version"] == version
    served = set()
    for _ in range(20):  # a 50/50 split: both versions answer (all 20 on one version: p = 2e-6)
        body = {"instances": [{"prompt": f"split {uuid.uuid4().hex}"}], "parameters": {"num_inference_steps": 2}}
        response = requests.post(f"{base}:predict", json=body, headers=auth_headers, timeout=60)
        assert response.status_code == 200, response.text
        served.add(response.json()["model_version"])
    assert served == {"1", "2"}
