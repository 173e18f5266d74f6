"""GET /playground: the browser playground, and GET /status: the stack's load as a chart per model; static files
from the project (no build step, no CDN)."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response

from api_server.core.errors import ApiError

bp = Blueprint("playground", __name__)
FILES = Path(__file__).resolve().parents[2] / "playground"
TYPES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "status.html": "text/html; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
}
# Only this origin's script and style; images only as data: URLs (the generated PNGs); no inline script,
# no plugins, no framing, no form posts elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@bp.get("/playground")
def page():
    return _file("index.html")


@bp.get("/status")
def status_page():
    """The fleet's load, drawn from GET /v1/status every two seconds (the API key typed in, kept in the tab)."""
    return _file("status.html")


@bp.get("/playground/<name>")
def asset(name: str):
    if name not in TYPES or name.endswith(".html"):
        raise ApiError(404, f"no playground file {name[:64]!r}")
    return _file(name)


def _file(name: str) -> Response:
    response = Response((FILES / name).read_bytes(), content_type=TYPES[name])
    response.headers.update(
        {
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        }
    )
    return response
