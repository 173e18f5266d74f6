"""API keys: compared by SHA-256 digest, so production stores only hashes (Secret Manager)."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from flask import Request

from api_server.core.errors import ApiError
from contract.settings import LOCAL_DEFAULT_API_KEY, Settings, api_key_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who made the request: the key's id (a digest prefix, safe to log) and its full SHA-256 digest."""

    key_id: str
    digest: str
    is_admin: bool = False


class ApiKeyAuth:
    def __init__(self, digests: frozenset[str], admin_digests: frozenset[str] = frozenset()) -> None:
        if not digests:
            raise ValueError("no API keys configured")
        self._digests = digests | admin_digests
        self._admin_digests = admin_digests

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeyAuth:
        if settings.api_key_sha256:
            return cls(settings.api_key_sha256, settings.admin_key_sha256)
        if settings.env == "local":
            log.warning("MAAS_API_KEYS is unset: accepting the local key %r", LOCAL_DEFAULT_API_KEY)
            return cls(frozenset({api_key_digest(LOCAL_DEFAULT_API_KEY)}), settings.admin_key_sha256)
        raise RuntimeError("refusing to start: set MAAS_API_KEY_SHA256 (or MAAS_API_KEYS) outside the local stack")

    def authenticate(self, request: Request) -> str:
        """Returns the key's id (a digest prefix, safe to log) or raises 401."""
        return self.identify(request)[0]

    def caller(self, request: Request) -> Caller:
        """The request's caller, or raises 401."""
        key_id, digest = self.identify(request)
        return Caller(key_id, digest, any(hmac.compare_digest(digest, admin) for admin in self._admin_digests))

    def identify(self, request: Request) -> tuple[str, str]:
        """The key's id and its full SHA-256 digest (for per-key permissions), or raises 401."""
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401, "missing API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
            )
        digest = api_key_digest(key.strip())
        if not any(hmac.compare_digest(digest, known) for known in self._digests):
            raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return digest[:12], digest
