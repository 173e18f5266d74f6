"""Settings come from the environment; API keys are checked by digest; production refuses to run keyless."""

from __future__ import annotations

import json

import pytest
from flask import Flask, request

from api_server.core.auth import ApiKeyAuth
from api_server.core.errors import ApiError
from contract import naming
from contract.settings import LOCAL_DEFAULT_API_KEY, Settings, api_key_digest


def test_buckets_follow_the_naming_convention():
    settings = Settings.from_env({"MAAS_PROJECT_ID": "acme"})
    assert settings.model_bucket == naming.model_bucket("acme") == "acme-maas-models"
    assert settings.payload_bucket == "acme-maas-payloads"


def test_keys_and_digests_are_both_accepted():
    settings = Settings.from_env({"MAAS_API_KEYS": "a, b", "MAAS_API_KEY_SHA256": api_key_digest("c")})
    assert settings.api_key_sha256 == {api_key_digest(k) for k in "abc"}


@pytest.mark.parametrize(("name", "value"), [("MAAS_REPLY_MODE", "carrier-pigeon"), ("MAAS_ENV", "staging")])
def test_invalid_modes_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value})


def test_production_refuses_to_start_without_keys():
    with pytest.raises(RuntimeError, match="refusing to start"):
        ApiKeyAuth.from_settings(Settings.from_env({"MAAS_ENV": "production"}))


def authenticate(auth: ApiKeyAuth, header: str | None) -> str:
    app = Flask(__name__)
    headers = {"Authorization": header} if header else {}
    with app.test_request_context(headers=headers):
        return auth.authenticate(request)


def test_local_stack_without_keys_uses_the_default_key():
    auth = ApiKeyAuth.from_settings(Settings.from_env({"MAAS_ENV": "local"}))
    assert authenticate(auth, f"Bearer {LOCAL_DEFAULT_API_KEY}") == api_key_digest(LOCAL_DEFAULT_API_KEY)[:12]


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer nope", "Token good"])
def test_bad_credentials_are_401(header):
    auth = ApiKeyAuth(frozenset({api_key_digest("good")}))
    with pytest.raises(ApiError) as caught:
        authenticate(auth, header)
    assert caught.value.status == 401


def test_an_operator_command_finds_the_local_stack_from_its_record(tmp_path):
    from contract.settings import local_stack_environment

    with pytest.raises(FileNotFoundError, match="is the local stack up"):
        local_stack_environment(tmp_path)
    record = {"api_url": "http://127.0.0.1:8080", "STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
              "config": {"api_keys": "secret"}}  # fmt: skip
    (tmp_path / "stack.json").write_text(json.dumps(record))
    assert local_stack_environment(tmp_path) == {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443"}
