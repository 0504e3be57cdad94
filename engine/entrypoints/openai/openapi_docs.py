"""The request bodies' schemas in ``/openapi.json``.

The route handlers read the raw body (to answer 400 in OpenAI's shape, not FastAPI's 422), so FastAPI
cannot see their request models: ``request_body_docs`` puts each model's JSON schema, inlined, in the
route's ``openapi_extra``.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter


def request_body_docs(model: Any) -> dict | None:
    """The ``openapi_extra`` documenting a JSON body of ``model`` (a request model or a union of them); None
    for a route without one (``model`` None)."""
    if model is None:
        return None
    schema = TypeAdapter(model).json_schema()
    schema = _inline_refs(schema, schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inline_refs(node: Any, defs: dict) -> Any:
    # The app's OpenAPI components hold no models, so a "#/$defs/..." reference would dangle.
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    inlined = {key: _inline_refs(value, defs) for key, value in node.items() if key != "$ref"}
    if "$ref" in node:
        inlined = {**_inline_refs(defs[node["$ref"].removeprefix("#/$defs/")], defs), **inlined}
    return inlined
