"""The job status stream (GET /v1/jobs/{id}/events) over real HTTP, Redis, Pub/Sub and workers."""

from __future__ import annotations

import json
import uuid

import pytest
import requests

from tests.conftest import TEST_API_KEYS

pytestmark = pytest.mark.stack
OTHER_KEY = {"Authorization": f"Bearer {TEST_API_KEYS[1]}"}
TERMINAL = {"succeeded", "failed", "expired", "cancelled", "deadline"}


def submit(stack, model: str, headers: dict, prompt: str, images: int = 1, **parameters) -> str:
    payload = {
        "instances": [{"prompt": prompt}] * images,
        "parameters": {"width": 64, "height": 64, **parameters},
    }
    response = requests.post(f"{stack.api_url}/v1/models/{model}/jobs", json=payload, headers=headers, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def open_stream(stack, job_id: str, headers: dict, last_event_id: str | None = None) -> requests.Response:
    extra = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    return requests.get(
        f"{stack.api_url}/v1/jobs/{job_id}/events", headers={**headers, **extra}, stream=True, timeout=(5, 30)
    )


def events(response: requests.Response, stop_after: str | None = None):
    """(event, id, data) per event, until the server closes the stream (or an event of type `stop_after`)."""
    fields: dict[str, str] = {}
    for line in response.iter_lines(decode_unicode=True):
        if line == "":
            if "event" in fields:
                yield fields["event"], fields.get("id"), json.loads(fields["data"])
                if fields["event"] == stop_after:
                    response.close()
                    return
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


def test_events_arrive_in_order_and_end_with_exactly_one_terminal_event(stack, auth_headers):
    # The tiny diffusion pipeline at 40 steps runs for about a second: several progress ticks.
    job_id = submit(stack, "sd15-txt2img", auth_headers, f"stream {uuid.uuid4().hex}", num_inference_steps=40, seed=3)
    with open_stream(stack, job_id, auth_headers) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        seen = list(events(response))
    kinds = [kind for kind, _, _ in seen]
    assert kinds[-1] == "succeeded" and sum(kind in TERMINAL for kind in kinds) == 1, kinds
    body = kinds[:-1]
    assert body == ["queued"] * body.count("queued") + ["running"] * body.count("running") and len(body) > 0
    assert body.count("queued") <= 1
    steps = [data["progress"]["step"] for kind, _, data in seen if kind == "running"]
    assert steps and steps == sorted(set(steps)), steps
    assert [event_id for kind, event_id, _ in seen if kind == "running"] == [str(step) for step in steps]
    _, last_id, final = seen[-1]
    assert last_id == "end" and final["id"] == job_id and final["result"]["predictions"][0]["seed"] == 3


def test_a_reconnect_resumes_after_the_last_event_and_never_repeats_the_end(stack, auth_headers):
    job_id = submit(stack, "sd15-txt2img", auth_headers, f"resume {uuid.uuid4().hex}", num_inference_steps=40)
    with open_stream(stack, job_id, auth_headers) as response:
        first = list(events(response, stop_after="running"))
    kind, last_id, _ = first[-1]
    assert kind == "running"  # the first connection left mid-run: the second picks up after that step
    with open_stream(stack, job_id, auth_headers, last_event_id=last_id) as response:
        rest = list(events(response))
    assert all(kind != "queued" for kind, _, _ in rest)
    assert all(int(event_id) > int(last_id) for kind, event_id, _ in rest if kind == "running")
    assert [kind for kind, _, _ in rest if kind in TERMINAL] == ["succeeded"]
    # After the terminal event nothing is left: 204, which tells an EventSource to stop reconnecting.
    with open_stream(stack, job_id, auth_headers, last_event_id="end") as response:
        assert response.status_code == 204 and response.content == b""
    # A fresh watcher of a finished job gets its terminal event alone.
    with open_stream(stack, job_id, auth_headers) as response:
        assert [kind for kind, _, _ in events(response)] == ["succeeded"]


def test_another_keys_job_is_a_404_and_a_bad_last_event_id_a_422(stack, auth_headers):
    job_id = submit(stack, "noop", auth_headers, f"mine {uuid.uuid4().hex}")
    with open_stream(stack, job_id, OTHER_KEY) as response:
        assert response.status_code == 404 and response.json()["error"]["code"] == 404
    with open_stream(stack, job_id, auth_headers, last_event_id="soon") as response:
        assert response.status_code == 422 and response.json()["error"]["field"] == "Last-Event-ID"
    with open_stream(stack, job_id, auth_headers) as response:
        assert [kind for kind, _, _ in events(response)][-1] == "succeeded"


def test_a_cancelled_job_ends_its_stream_with_cancelled(stack, auth_headers):
    # 50 steps at 256 px take the tiny pipeline many seconds on a CPU: the job is far from done when cancelled
    # (and stops at its next step, so it costs little).
    job_id = submit(stack, "sd15-txt2img", auth_headers, f"cancel {uuid.uuid4().hex}", width=256, height=256,
                    num_inference_steps=50)  # fmt: skip
    with open_stream(stack, job_id, auth_headers) as response:
        seen = events(response)
        kind, _, _ = next(seen)
        assert kind in {"queued", "running"}
        cancelled = requests.delete(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10)
        assert cancelled.status_code == 200, cancelled.text
        rest = list(seen)
    assert rest[-1][:2] == ("cancelled", "end") and sum(kind in TERMINAL for kind, _, _ in rest) == 1
