"""The API's JSON log lines: every line written while a request is handled carries its id and sanitised trace."""

from __future__ import annotations

import io
import json
import logging

import pytest

from api_server.process.app import create_app
from api_server.process.state import app_state
from contract.jsonlog import JsonFormatter
from contract.settings import Settings

pytestmark = pytest.mark.stack
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def app(stack, tmp_path_factory):
    settings = Settings.from_env({**stack.service_env(), "MAAS_LOG_SPOOL_DIR": str(tmp_path_factory.mktemp("spool"))})
    app = create_app(settings)

    @app.get("/test/log-inside")
    def _log_inside():
        logging.getLogger("api_server.somewhere").warning("a line from deep inside the request")
        return {"ok": True}

    yield app
    app_state(app).close()


@pytest.fixture
def lines():
    """The JSON lines the root logger writes during the test, parsed."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    previous = root.level
    root.setLevel(logging.INFO)
    parsed: list[dict] = []

    def read() -> list[dict]:
        parsed[:] = [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
        return parsed

    yield read
    root.removeHandler(handler)
    root.setLevel(previous)


def request_lines(lines, request_id: str) -> list[dict]:
    return [line for line in lines() if line.get("request_id") == request_id]


def test_every_line_of_a_request_carries_its_id_and_the_cloud_trace(app, lines, auth_headers):
    response = app.test_client().get(
        "/test/log-inside", headers={**auth_headers, "X-Cloud-Trace-Context": f"{TRACE}/12345;o=1"}
    )
    assert response.status_code == 200
    mine = request_lines(lines, response.headers["X-Request-Id"])
    messages = [line["message"] for line in mine]
    assert "a line from deep inside the request" in messages and "GET /test/log-inside 200" in messages
    for line in mine:
        assert line["logging.googleapis.com/trace"] == f"projects/{app_state(app).settings.project_id}/traces/{TRACE}"
        assert line["logging.googleapis.com/spanId"] == format(12345, "016x")
        assert line["logging.googleapis.com/trace_sampled"] is True
    access = next(line for line in mine if line["message"].startswith("GET "))
    assert access["httpRequest"]["status"] == 200 and access["httpRequest"]["latency"].endswith("s")
    # Lines written after the request ended carry neither.
    logging.getLogger("api_server.elsewhere").warning("after the request")
    after = next(line for line in lines() if line["message"] == "after the request")
    assert "request_id" not in after and "logging.googleapis.com/trace" not in after


def test_traceparent_is_read_on_the_api_routes(app, lines, auth_headers):
    response = app.test_client().get("/v1/models", headers={**auth_headers, "traceparent": f"00-{TRACE}-{SPAN}-00"})
    (access,) = request_lines(lines, response.headers["X-Request-Id"])
    assert access["logging.googleapis.com/trace"].endswith(f"/traces/{TRACE}")
    assert access["logging.googleapis.com/spanId"] == SPAN and access["logging.googleapis.com/trace_sampled"] is False


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": f"00-{TRACE}-{SPAN}-01 injected", "X-Cloud-Trace-Context": f"{TRACE}zz/1;o=1"},
        {"X-Cloud-Trace-Context": f"{TRACE}/1;o=1\u2028fake"},
        {"traceparent": "00-" + "a" * 500 + f"-{SPAN}-01"},
        {"X-Cloud-Trace-Context": f'{TRACE}/1;o=1 "}}, {{"severity": "EMERGENCY"'},
    ],
)
def test_malformed_trace_headers_are_dropped_and_never_echoed(app, lines, auth_headers, headers):
    response = app.test_client().get("/v1/models", headers={**auth_headers, **headers})
    assert response.status_code == 200
    (access,) = request_lines(lines, response.headers["X-Request-Id"])
    assert "logging.googleapis.com/trace" not in access and "logging.googleapis.com/spanId" not in access
    raw = json.dumps(lines())
    assert "injected" not in raw and "fake" not in raw and "EMERGENCY" not in raw


def test_a_header_with_cr_lf_never_reaches_a_log_line(app, lines, auth_headers):
    # werkzeug's test client refuses CR/LF in headers as a server would; the raw environ is what a broken proxy sends.
    response = app.test_client().get(
        "/v1/models",
        headers=auth_headers,
        environ_overrides={
            "HTTP_TRACEPARENT": f"00-{TRACE}-{SPAN}-01\r\nX-Evil: 1",
            "HTTP_X_CLOUD_TRACE_CONTEXT": f"{TRACE}\r\n",
        },
    )
    (access,) = request_lines(lines, response.headers["X-Request-Id"])
    assert "logging.googleapis.com/trace" not in access and "X-Evil" not in json.dumps(lines())
