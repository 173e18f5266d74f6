"""The one authentication point: a `before_request` on every authenticated blueprint sets the caller (or 401s);
views read it with `caller()` and never check a key themselves."""

from __future__ import annotations

import logging

from flask import Blueprint, g, request

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.process.state import app_state

log = logging.getLogger(__name__)


def authenticated(bp: Blueprint) -> Blueprint:
    """Guards every route of `bp`; call after any `before_request` that must see unauthenticated requests."""
    bp.before_request(_authenticate)
    return bp


def _authenticate() -> None:
    g.caller = app_state().auth.caller(request)


def caller() -> Caller:
    return g.caller


def require_admin(action: str) -> Caller:
    """The caller if it holds an admin key; any other key gets a 403, and the refusal is logged (who, what)."""
    who = caller()
    if not who.is_admin:
        log.warning("refused admin action %s for key %s: not an admin key", action, who.key_id)
        raise ApiError(403, f"{action} needs an admin API key (MAAS_ADMIN_KEY_SHA256)")
    return who
