"""A model's control models (ControlNets, IP-Adapters): listed for every key, registered (`PUT`) only with an admin
key."""

from __future__ import annotations

from flask import Blueprint, jsonify, request
from spectree import Response

from api_server.core.errors import ApiError
from api_server.process.openapi import ADMIN_ONLY, ControlInfo, ControlList, ControlRegistration, documented, errors
from api_server.process.routes.access import authenticated, require_admin
from api_server.process.state import app_state

bp = authenticated(Blueprint("controls", __name__))


@bp.get("/v1/models/<model:model>/controls")
@documented(Response(HTTP_200=ControlList, **errors(401, 404, 503)), tags=["models"])
def list_controls(model: str):
    """The ControlNets and IP-Adapters registered for this model"""
    state = app_state()
    spec = state.serving.stable(model)
    return jsonify({"controls": [record.model_dump() for record in state.controls.listing(spec)]})


@bp.put("/v1/models/<model:model>/controls/<name>")
@documented(
    Response(HTTP_200=ControlInfo, **errors(401, 403, 404, 422, 503)),
    json=ControlRegistration,
    tags=["models"],
    security=ADMIN_ONLY,
)
def register_control(model: str, name: str):
    """Registers (checks against the model's base UNet, then makes current) a ControlNet or IP-Adapter version
    already uploaded under `adapters/_controls/{model}/{name}/{version}/` in the model bucket; admin keys only"""
    require_admin(f"register control {name} for {model}")
    state = app_state()
    spec = state.serving.stable(model)
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or set(body) != {"kind", "version"}:
        raise ApiError(422, 'body: must be {"kind": "controlnet" or "ip_adapter", "version": "..."}', "body")
    return jsonify(state.controls.register(spec, name, body["kind"], body["version"]).model_dump())
