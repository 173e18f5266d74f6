"""The model catalog as clients see it."""

from __future__ import annotations

from flask import Blueprint, jsonify
from spectree import Response

from api_server.openapi import ModelInfo, ModelList, documented, errors
from api_server.routes.access import authenticated
from api_server.state import app_state

bp = authenticated(Blueprint("models", __name__))


def _public(spec) -> dict:
    return {
        "name": spec.name,
        "version": spec.version,
        "task": spec.task,
        "max_instances_per_request": spec.max_instances_per_request,
        "request_timeout_seconds": spec.request_timeout_seconds,
        "defaults": spec.defaults.model_dump(exclude_none=True),
        "limits": spec.limits.model_dump(),
    }


@bp.get("/v1/models")
@documented(Response(HTTP_200=ModelList, **errors(401)), tags=["models"])
def list_models():
    """The catalog: names, versions, tasks, defaults and limits"""
    return jsonify({"models": [_public(spec) for _, spec in sorted(app_state().catalog.models.items())]})


@bp.get("/v1/models/<model:model>")
@documented(Response(HTTP_200=ModelInfo, **errors(401, 404)), tags=["models"])
def get_model(model: str):
    """One model of the catalog"""
    return jsonify(_public(app_state().serving.model(model)))
