"""The server's OpenAPI schema (``GET /openapi.json``), request bodies included: the schema the fuzz tests drive."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies: the routes parse bodies themselves (to bound
    their size and nesting first), so FastAPI cannot see them; the pydantic models are the truth."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from kiln.serving.prefix import KeysRequest
        from kiln.serving.protocol import ChatCompletionRequest, CompletionRequest
        from kiln.serving.tokenizing import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
        from pydantic import TypeAdapter

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, name, model in (
                ("/v1/completions", "CompletionRequest", CompletionRequest),
                ("/v1/chat/completions", "ChatCompletionRequest", ChatCompletionRequest),
                ("/v1/prefix_cache/keys", "KeysRequest", KeysRequest),
                ("/tokenize", "TokenizeRequest", TokenizeCompletionRequest | TokenizeChatRequest),
                ("/detokenize", "DetokenizeRequest", DetokenizeRequest)):
            body = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[name] = body
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema
