"""Idle and slow connections cost the API no thread: a predict beside a hundred of them is answered in time.

Under gunicorn's gthread worker a connection that sent a request line and one header held a thread until its
headers were complete; some forty of them held every thread. The API now reads headers and bodies on its
event loop (`api_server/process/asgi.py`), and closes a connection whose headers do not arrive in time.
"""

from __future__ import annotations

import socket

import pytest
import requests

from chaos.slow_clients import HEADER_ONLY, SlowClients
from emulators.stack import local_catalog

pytestmark = pytest.mark.stack


def test_a_predict_beside_a_hundred_idle_connections_is_answered_within_its_deadline(stack, auth_headers):
    host, port = stack.api_url.removeprefix("http://").rsplit(":", 1)
    deadline = local_catalog().models["noop"].request_timeout_seconds
    with SlowClients(host, int(port), 100, auth_headers["Authorization"]) as slow:
        # All opened, none refused (one the API closed at its header timeout is opened again at once, so a count of
        # those open now could catch one in between on a slow machine).
        assert slow.opened >= 100 and slow.refused == 0, (slow.opened, slow.refused)
        for attempt in range(3):
            response = requests.post(
                f"{stack.api_url}/v1/models/noop:predict",
                json={"instances": [{"prompt": f"beside idle sockets {attempt}"}]},
                headers=auth_headers,
                timeout=deadline,
            )
            assert response.status_code == 200, response.text
            assert len(response.json()["predictions"]) == 1


def test_a_connection_that_never_finishes_its_headers_is_closed_by_the_api(stack):
    host, port = stack.api_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(HEADER_ONLY)
        # The header read timeout (10 s) closes it; a server without one would leave recv() waiting for 60 s.
        assert connection.recv(1024) == b""
