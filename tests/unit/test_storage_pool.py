"""The storage client keeps a connection per thread that uses it (no urllib3 "Connection pool is full" warnings)."""

from __future__ import annotations

from contract import google_clients
from contract.settings import Settings


def test_the_storage_clients_pool_holds_a_connection_per_user_thread(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    client = google_clients.storage_client(Settings(), connections=49)
    for url in ("https://storage.googleapis.com/b/o", "http://127.0.0.1:1/b/o"):
        adapter = client._http.get_adapter(url)
        assert adapter._pool_maxsize == 49 and adapter._pool_connections == 49
