"""The local stack's few-step example (`sd15-lcm` in contract/models.local.yaml: LCMScheduler, 4 steps, guidance
1 by default) answers predict through its own worker, and its step limit is the catalog's."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.stack


def test_the_few_step_example_answers_with_its_defaults_and_refuses_more_steps_than_its_limit(stack, auth_headers):
    url = f"{stack.api_url}/v1/models/sd15-lcm:predict"
    body = {"instances": [{"prompt": "a lighthouse at dawn"}], "parameters": {"width": 64, "height": 64, "seed": 4}}
    response = requests.post(url, json=body, headers=auth_headers, timeout=90)
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["image_b64"]
    body["parameters"]["num_inference_steps"] = 9
    refused = requests.post(url, json=body, headers=auth_headers, timeout=30)
    assert refused.status_code == 422 and "num_inference_steps" in refused.text, refused.text
