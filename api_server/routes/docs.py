"""GET /openapi.json (the generated OpenAPI document) and GET /docs (Swagger UI over it)."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify
from spectree import Response as SpecResponse
from spectree.page import PAGE_TEMPLATES

from api_server.openapi import API_SPEC, PUBLIC, documented, openapi_document
from api_server.state import app_state

bp = Blueprint("docs", __name__)


@bp.get("/openapi.json")
@documented(SpecResponse("HTTP_200"), security=PUBLIC, tags=["operations"])
def openapi_json():
    """This document"""
    state = app_state()
    if (document := state.lazy.get("openapi")) is None:
        document = state.lazy.setdefault("openapi", openapi_document(state.catalog.names()))
    return jsonify(document)


@bp.get("/docs")
@documented(SpecResponse("HTTP_200"), security=PUBLIC, tags=["operations"])
def docs():
    """Interactive documentation (Swagger UI)"""
    page = PAGE_TEMPLATES["swagger"].format(
        spec_url="/openapi.json", spec_path="docs", **API_SPEC.config.swagger_oauth2_config()
    )
    return Response(page, content_type="text/html; charset=utf-8")
