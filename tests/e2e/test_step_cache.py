"""A step-cached model on the local stack (issue 54): flux-schnell-cached (contract/models.local.yaml, first_block on
flux-schnell's tiny weights in its worker) answers with its cache and with it turned off, and each BigQuery row says
which it ran with and how many steps its images skipped."""

from __future__ import annotations

import uuid

import pytest
import requests

from tests.conftest import query_rows

pytestmark = pytest.mark.stack
MODEL = "flux-schnell-cached"


def test_a_cached_model_answers_with_and_without_its_cache_and_logs_the_steps_skipped(
    stack, auth_headers, bigquery, settings
):
    ids = {}
    for step_cache in (None, False):
        parameters = {"width": 64, "height": 64, "num_inference_steps": 4, "seed": 7}
        if step_cache is not None:
            parameters["step_cache"] = step_cache
        body = {"instances": [{"prompt": f"cached {uuid.uuid4().hex}"}] * 2, "parameters": parameters}
        response = requests.post(f"{stack.api_url}/v1/models/{MODEL}:predict", json=body, headers=auth_headers,
                                 timeout=90)  # fmt: skip
        assert response.status_code == 200, response.text
        assert all(p["image_b64"] for p in response.json()["predictions"])
        ids[step_cache] = response.headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    rows = query_rows(
        bigquery, f"SELECT request_id, status, step_cache, steps_skipped FROM {table} "
        f"WHERE request_id IN ('{ids[None]}', '{ids[False]}')", 2, timeout=60,
    )  # fmt: skip
    by_id = {row["request_id"]: row for row in rows}
    cached, off = by_id[ids[None]], by_id[ids[False]]
    # The tiny transformer's first block moves less than the entry's threshold 0.5: its two images skip steps
    # (each image's first step is always full, so at most 3 of 4 each).
    assert (cached["status"], cached["step_cache"]) == ("ok", "first_block")
    assert 0 < cached["steps_skipped"] <= 2 * 3
    assert (off["status"], off["step_cache"], off["steps_skipped"]) == ("ok", None, None)


def test_a_flow_stage_on_a_cached_model_runs_and_logs_its_cache(stack, auth_headers, bigquery, settings):
    body = {"instances": [{"prompt": f"flow {uuid.uuid4().hex}"}],
            "parameters": {"width": 64, "height": 64, "num_inference_steps": 4, "seed": 7}}  # fmt: skip
    response = requests.post(f"{stack.api_url}/v1/models/flux-cached-draft-edit:predict", json=body,
                             headers=auth_headers, timeout=90)  # fmt: skip
    assert response.status_code == 200, response.text
    request_id = response.headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    rows = query_rows(
        bigquery, f"SELECT model, stage, step_cache, steps_skipped FROM {table} "
        f"WHERE flow_request_id = '{request_id}'", 2, timeout=60,
    )  # fmt: skip
    by_stage = {row["stage"]: row for row in rows}
    assert (by_stage["draft"]["model"], by_stage["draft"]["step_cache"]) == ("flux-schnell-cached", "first_block")
    assert 0 < by_stage["draft"]["steps_skipped"] <= 3  # its first step full, at most 3 of 4 skipped
    assert (by_stage["edit"]["step_cache"], by_stage["edit"]["steps_skipped"]) == (None, None)
