"""A webhook is posted to the address its check resolved, not to a second resolution of its name (DNS rebinding),
and IPv6 forms that carry or translate to an IPv4 address are judged by it (6to4) or refused (NAT64, Teredo)."""

from __future__ import annotations

import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from api_server.core.errors import ApiError
from api_server.jobs import webhooks
from api_server.jobs.webhooks import WebhookNotifier, WebhookTargetPolicy
from tests.integration.test_api_webhooks import self_signed

HOST = "hooks.example"


@pytest.fixture
def receiver(tmp_path):
    """An https server on 127.0.0.1 with a certificate for HOST; records each call's Host header and path."""
    cert, key = self_signed(tmp_path, HOST)
    calls: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append((self.headers["Host"], self.path))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], cert, calls
    server.shutdown()
    server.server_close()


def test_a_delivery_connects_to_the_checked_address_not_a_second_resolution(receiver, monkeypatch):
    port, cert, calls = receiver
    answers = iter(["127.0.0.1"])  # the checked answer; every later one rebinds elsewhere (nothing listens there)
    resolved: list[str] = []
    real = socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host != HOST:
            return real(host, *args, **kwargs)
        address = next(answers, "127.0.0.2")
        resolved.append(address)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    notifier = WebhookNotifier(None, None, WebhookTargetPolicy(True, allow_loopback=True), "secret", attempts=1,
                               ca_file=cert)  # fmt: skip
    try:
        assert notifier.send(f"https://{HOST}:{port}/done?n=1", b"{}", "job-1")
    finally:
        notifier.stop()
    assert resolved == ["127.0.0.1"], "the name was resolved again to connect"
    assert calls == [(f"{HOST}:{port}", "/done?n=1")]


def test_tls_still_verifies_the_urls_host_name_at_the_pinned_address(receiver, monkeypatch):
    port, cert, calls = receiver
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "",
                                                                       ("127.0.0.1", port))])  # fmt: skip
    notifier = WebhookNotifier(None, None, WebhookTargetPolicy(True, allow_loopback=True), "secret", attempts=1,
                               ca_file=cert)  # fmt: skip
    try:
        assert not notifier.send(f"https://other.example:{port}/done", b"{}", "job-2")
    finally:
        notifier.stop()
    assert calls == []


@pytest.mark.parametrize(
    "address",
    [
        "2002:a9fe:a9fe::1",  # 6to4 around the metadata server (169.254.169.254)
        "2002:0a00:0001::1",  # 6to4 around 10.0.0.1
        "2002:7f00:0001::1",  # 6to4 around loopback
        "64:ff9b::a9fe:a9fe",  # NAT64 (well-known prefix)
        "64:ff9b:1::a00:1",  # NAT64 (local-use prefix)
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "::a9fe:a9fe",  # IPv4-compatible
        "::ffff:169.254.169.254",  # IPv4-mapped
    ],
)
def test_ipv6_forms_that_reach_an_ipv4_address_are_not_public(address, monkeypatch):
    monkeypatch.setattr(webhooks.socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET6, 1, 6, "", (address, 443))])
    with pytest.raises(ApiError, match="non-public"):
        WebhookTargetPolicy(True, allow_loopback=True).check("https://hooks.example/done")


def test_a_6to4_address_around_a_public_ipv4_is_public(monkeypatch):
    monkeypatch.setattr(webhooks.socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET6, 1, 6, "",
                                                                          ("2002:0808:0808::1", 443))])  # fmt: skip
    assert WebhookTargetPolicy(True).check("https://hooks.example/done") == "https://hooks.example/done"
