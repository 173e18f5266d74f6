"""GET /openapi.json (the generated OpenAPI document) and GET /docs (Swagger UI over it, served from this process).

Swagger UI's files come from the pinned `swagger-ui-bundle-v2` package (swagger-ui-dist), under a URL that names
their version, so the page works where nothing outside the machine can be reached (a private network, the
local stack) and a browser may keep them for good. spectree's own page loads them from a public CDN: it is
not used. `Content-Security-Policy` tells the browser to load nothing from anywhere else either.
"""

from __future__ import annotations

from flask import Blueprint, Response, abort, jsonify, send_from_directory
from spectree import Response as SpecResponse
from swagger_ui_bundle import swagger_ui_path

from api_server.process.openapi import PUBLIC, documented, openapi_document
from api_server.process.state import app_state

bp = Blueprint("docs", __name__)

SWAGGER_UI_VERSION = swagger_ui_path.name.removeprefix("swagger-ui-")
ASSETS = f"/docs/assets/{SWAGGER_UI_VERSION}"
# The files the page loads; nothing else of the package is served.
SWAGGER_UI_FILES = frozenset(
    {"swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "favicon-32x32.png"}
)
# Same origin only; Swagger UI sets inline styles and shows its logo as a data: image.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'"
)

PAGE = f"""<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>Model-as-a-Service API</title>
  <link rel="icon" type="image/png" href="{ASSETS}/favicon-32x32.png">
  <link rel="stylesheet" href="{ASSETS}/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui" data-spec-url="/openapi.json"></div>
  <script src="{ASSETS}/swagger-ui-bundle.js"></script>
  <script src="{ASSETS}/swagger-ui-standalone-preset.js"></script>
  <script src="{ASSETS}/initializer.js"></script>
</body>
</html>
"""

# validatorUrl null: Swagger UI otherwise shows a badge fetched from a public validator.
INITIALIZER = """window.ui = SwaggerUIBundle({
  url: document.getElementById("swagger-ui").dataset.specUrl,
  dom_id: "#swagger-ui",
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
  layout: "StandaloneLayout",
  validatorUrl: null,
  deepLinking: true,
});
"""


@bp.get("/openapi.json")
@documented(SpecResponse("HTTP_200"), security=PUBLIC, tags=["operations"])
def openapi_json():
    """This document"""
    state = app_state()
    if (document := state.lazy.get("openapi")) is None:
        document = state.lazy.setdefault(
            "openapi", openapi_document([*state.catalog.names(), *(state.flows.names() if state.flows else [])])
        )
    return jsonify(document)


@bp.get("/docs")
@documented(SpecResponse("HTTP_200"), security=PUBLIC, tags=["operations"])
def docs():
    """Interactive documentation (Swagger UI)"""
    response = Response(PAGE, content_type="text/html; charset=utf-8")
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return response


@bp.get(f"{ASSETS}/<name>")
def docs_asset(name: str):
    """Swagger UI's files and the page's initializer; versioned URLs, so a browser keeps them a year."""
    if name == "initializer.js":
        response = Response(INITIALIZER, content_type="text/javascript; charset=utf-8")
    elif name in SWAGGER_UI_FILES:
        response = send_from_directory(swagger_ui_path, name, max_age=0)
    else:
        abort(404)
    response.headers["Cache-Control"] = "public, max-age=31536000, immutable"
    return response
