"""What a request carries: the service it reaches, its JSON body and its client (who owns its contexts)."""

from __future__ import annotations

import json

from fastapi import Request

from hetero.errors import ConfigError
from hetero.serve.access import OWNER
from hetero.serve.service import Service


def service_of(request: Request) -> Service:
    """The `Service` the app serves (`create_app` keeps it in the app's state)."""
    return request.app.state.service


def client_of(request: Request, body: dict | None = None) -> str:
    """Who owns the contexts of this request: the API key when the server has keys (never a header the
    caller chooses), else the X-Client-Id header or `user` (trusted: without keys every local caller is)."""
    owner = request.scope.get(OWNER)
    if owner is not None:
        return owner
    name = request.headers.get("x-client-id") or (body or {}).get("user") or "default"
    if not isinstance(name, str) or len(name) > 128:
        raise ConfigError("client id (X-Client-Id header or `user`) must be a string of at most 128 characters")
    return name


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError("the request body must be valid JSON") from None
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    return body
