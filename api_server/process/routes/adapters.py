"""A model's LoRA adapters: listed for every key, registered (`PUT`) only with an admin key."""

from __future__ import annotations

from flask import Blueprint, jsonify, request
from spectree import Response

from api_server.core.errors import ApiError
from api_server.process.openapi import ADMIN_ONLY, AdapterInfo, AdapterList, AdapterRegistration, documented, errors
from api_server.process.routes.access import authenticated, require_admin
from api_server.process.state import app_state

bp = authenticated(Blueprint("adapters", __name__))


@bp.get("/v1/models/<model:model>/adapters")
@documented(Response(HTTP_200=AdapterList, **errors(401, 404)), tags=["models"])
def list_adapters(model: str):
    """The LoRA adapters a request to this model may name in `parameters.adapters`"""
    state = app_state()
    spec = state.serving.stable(model)
    records = state.adapters.listing(spec) if spec.adapters else []
    return jsonify({"adapters": [record.model_dump() for record in records]})


@bp.put("/v1/models/<model:model>/adapters/<name>")
@documented(
    Response(HTTP_200=AdapterInfo, **errors(401, 403, 404, 422)),
    json=AdapterRegistration,
    tags=["models"],
    security=ADMIN_ONLY,
)
def register_adapter(model: str, name: str):
    """Registers (checks, then makes current) an adapter version already uploaded under
    `adapters/{model}/{name}/{version}/` in the model bucket; admin keys only"""
    require_admin(f"register adapter {name} for {model}")
    state = app_state()
    spec = state.serving.stable(model)
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or set(body) != {"version"}:
        raise ApiError(422, 'body: must be {"version": "..."}', "body")
    return jsonify(state.adapters.register(spec, name, body["version"]).model_dump())
