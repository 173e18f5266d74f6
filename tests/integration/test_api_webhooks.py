"""Job webhooks against a local https receiver (a self-signed certificate the test app trusts), and SSRF refusal."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from api_server.core.errors import ApiError
from api_server.jobs.webhooks import WebhookTargetPolicy, verify
from api_server.process.app import create_app
from api_server.process.state import app_state
from contract.settings import Settings

pytestmark = pytest.mark.stack
SECRET = "test-webhook-secret"


def self_signed(directory, host: str = "localhost") -> tuple[str, str]:
    """A certificate (its own CA) for `host` and 127.0.0.1, and its key: the paths of both."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "receiver.pem", directory / "receiver.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


class Receiver:
    """An https endpoint that records every call and answers the scripted statuses, then 200."""

    def __init__(self, port: int, cert: str, key: str) -> None:
        self.calls: list[tuple[dict, bytes]] = []
        self.script: dict[str, list[int]] = {}
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                statuses = receiver.script.get(self.path, [])
                status = statuses.pop(0) if statuses else 200
                with receiver.changed:
                    receiver.calls.append(({**dict(self.headers), "path": self.path, "answered": status}, body))
                    receiver.changed.notify_all()
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://localhost:{port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def calls_to(self, path: str, count: int, timeout: float = 30) -> list[tuple[dict, bytes]]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(found := [c for c in self.calls if c[0]["path"] == path]) < count:
                if not self.changed.wait(deadline - time.monotonic()) and time.monotonic() > deadline:
                    return found
            return found


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    port = int(os.environ.get("MAAS_TEST_PORT_OFFSET", "10000")) + 8970
    receiver = Receiver(port, cert, key)
    receiver.cert = cert
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def webhook_app(stack, receiver, tmp_path_factory):
    env = {
        **stack.service_env(),
        "MAAS_WEBHOOK_SIGNING_SECRET": SECRET,
        "MAAS_WEBHOOK_CA_FILE": receiver.cert,
        "MAAS_WEBHOOK_ALLOW_LOOPBACK": "1",
        "MAAS_WEBHOOK_ATTEMPTS": "3",
        "MAAS_LOG_SPOOL_DIR": str(tmp_path_factory.mktemp("spool")),
    }
    app = create_app(Settings.from_env(env))
    yield app
    app_state(app).close()


def submit(app, auth_headers, webhook_url: str, prompt: str = "webhook"):
    return app.test_client().post(
        "/v1/models/noop/jobs",
        json={"instances": [{"prompt": prompt}], "parameters": {"width": 64, "height": 64}, "webhook_url": webhook_url},
        headers=auth_headers,
    )


def test_a_finished_job_calls_its_webhook_once_signed(webhook_app, receiver, auth_headers):
    accepted = submit(webhook_app, auth_headers, f"{receiver.url}/done")
    assert accepted.status_code == 202, accepted.get_json()
    job_id = accepted.get_json()["id"]
    (headers, body), *more = receiver.calls_to("/done", 1)
    assert verify(SECRET, headers["X-MaaS-Timestamp"], body, headers["X-MaaS-Signature"])
    assert not verify("another secret", headers["X-MaaS-Timestamp"], body, headers["X-MaaS-Signature"])
    assert not verify(SECRET, headers["X-MaaS-Timestamp"], body + b" ", headers["X-MaaS-Signature"])
    delivered = json.loads(body)
    assert (delivered["id"], delivered["status"], headers["X-MaaS-Job-Id"]) == (job_id, "succeeded", job_id)
    assert delivered["result"]["predictions"][0]["mime_type"] == "image/png"
    time.sleep(2.5)  # several rounds of every process's finder: still one call
    assert len(receiver.calls_to("/done", 1)) == 1


def test_a_failing_receiver_is_retried_with_backoff_until_it_accepts(webhook_app, receiver, auth_headers):
    receiver.script["/flaky"] = [503, 500]
    submit(webhook_app, auth_headers, f"{receiver.url}/flaky")
    calls = receiver.calls_to("/flaky", 3)
    assert [call[0]["answered"] for call in calls] == [503, 500, 200]
    # Each retry is signed afresh, over the same body.
    assert len({body for _, body in calls}) == 1
    assert all(verify(SECRET, h["X-MaaS-Timestamp"], body, h["X-MaaS-Signature"]) for h, body in calls)


def test_a_final_refusal_is_not_retried(webhook_app, receiver, auth_headers):
    receiver.script["/gone"] = [410]
    submit(webhook_app, auth_headers, f"{receiver.url}/gone")
    receiver.calls_to("/gone", 1)
    time.sleep(1.5)  # past the first backoff
    assert [call[0]["answered"] for call in receiver.calls_to("/gone", 1)] == [410]


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/hook",
        "https://10.1.2.3/hook",
        "https://192.168.0.10/hook",
        "https://169.254.169.254/computeMetadata/v1/",
        "https://[fd00::1]/hook",
        "https://224.0.0.1/hook",
        "https://0.0.0.0/hook",
        "https://user:password@localhost/hook",
        "https://no-such-host.invalid/hook",
    ],
)
def test_webhooks_to_private_or_odd_targets_are_a_422(webhook_app, auth_headers, url):
    refused = submit(webhook_app, auth_headers, url)
    assert refused.status_code == 422 and refused.get_json()["error"]["field"] == "webhook_url"


@pytest.mark.parametrize(
    "url", ["https://127.0.0.1/hook", "https://localhost:8443/hook", "https://[::1]/", "https://[::ffff:127.0.0.1]/"]
)
def test_loopback_is_refused_outside_tests(url):
    with pytest.raises(ApiError, match="non-public"):
        WebhookTargetPolicy(enabled=True).check(url)


def test_without_a_signing_secret_webhooks_are_refused(stack, auth_headers):
    import requests

    refused = requests.post(
        f"{stack.api_url}/v1/models/noop/jobs",
        json={"instances": [{"prompt": "x"}], "webhook_url": "https://example.com/hook"},
        headers=auth_headers,
        timeout=10,
    )
    assert refused.status_code == 422 and "not enabled" in refused.json()["error"]["message"]


def test_an_ended_batch_calls_its_webhook_once_signed(webhook_app, receiver, auth_headers):
    lines = [{"custom_id": f"w-{index}", "model": "noop", "instances": [{"prompt": f"batch webhook {index}"}]}
             for index in range(3)]  # fmt: skip
    created = webhook_app.test_client().post(
        "/v1/batches", json={"requests": lines, "webhook_url": f"{receiver.url}/batch"}, headers=auth_headers
    )
    assert created.status_code == 200, created.get_json()
    batch_id = created.get_json()["id"]
    (headers, body), *more = receiver.calls_to("/batch", 1)
    assert verify(SECRET, headers["X-MaaS-Timestamp"], body, headers["X-MaaS-Signature"])
    delivered = json.loads(body)
    assert (delivered["id"], delivered["status"], headers["X-MaaS-Batch-Id"]) == (batch_id, "completed", batch_id)
    assert delivered["request_counts"]["succeeded"] == 3 and not more
