"""The admin key role: only admin digests pass `require_admin`; an admin key also authenticates."""

from __future__ import annotations

import pytest
from flask import Flask, g

from api_server.core.auth import ApiKeyAuth
from api_server.core.errors import ApiError
from api_server.process.routes.access import require_admin
from contract.settings import LOCAL_DEFAULT_ADMIN_KEY, Settings, api_key_digest


def _caller(auth: ApiKeyAuth, key: str):
    app = Flask(__name__)
    with app.test_request_context(headers={"Authorization": f"Bearer {key}"}):
        return auth.caller(__import__("flask").request)


def test_admin_keys_come_from_plain_keys_and_digests():
    settings = Settings.from_env({"MAAS_ADMIN_KEYS": "boss", "MAAS_ADMIN_KEY_SHA256": "AB" * 32, "MAAS_API_KEYS": "u"})
    assert settings.admin_key_sha256 == {api_key_digest("boss"), "ab" * 32}


def test_the_local_admin_key_exists_only_locally():
    assert Settings.from_env({}).admin_key_sha256 == {api_key_digest(LOCAL_DEFAULT_ADMIN_KEY)}
    production = Settings.from_env({"MAAS_ENV": "production", "MAAS_API_KEY_SHA256": "cd" * 32})
    assert production.admin_key_sha256 == frozenset()


def test_only_an_admin_key_passes_and_it_also_authenticates():
    auth = ApiKeyAuth.from_settings(Settings.from_env({"MAAS_API_KEYS": "user", "MAAS_ADMIN_KEYS": "boss"}))
    admin, user = _caller(auth, "boss"), _caller(auth, "user")
    assert admin.is_admin and not user.is_admin
    app = Flask(__name__)
    with app.app_context():
        g.caller = user
        with pytest.raises(ApiError) as refused:
            require_admin("changing the traffic split")
        assert refused.value.status == 403
        g.caller = admin
        assert require_admin("changing the traffic split") is admin
