"""The one authentication point: a `before_request` on every authenticated blueprint sets the caller (or 401s);
views read it with `caller()` and never check a key themselves."""

from __future__ import annotations

from flask import Blueprint, g, request

from api_server.auth import Caller
from api_server.state import app_state


def authenticated(bp: Blueprint) -> Blueprint:
    """Guards every route of `bp`; call after any `before_request` that must see unauthenticated requests."""
    bp.before_request(_authenticate)
    return bp


def _authenticate() -> None:
    g.caller = app_state().auth.caller(request)


def caller() -> Caller:
    return g.caller
