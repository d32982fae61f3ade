"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is raised as :class:`APIError` and rendered
by the handlers installed here; pydantic validation errors become a 400 that
names the offending parameter (OpenAI uses 400 where FastAPI defaults to 422).
An unexpected exception is logged with its traceback on the server side and
answered with a 500 that carries no internals.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kiln.serving")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

# pydantic's names for union members and wrappers; they appear in `loc` but are not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}


class APIError(Exception):
    """An error answered to the client as OpenAI error JSON with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item not in _TYPE_TAGS and "[" not in item:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its parameter (``messages[0].role``)."""
    errors = exc.errors(include_url=False)
    # Union members each report an error; prefer the one that names a concrete field problem.
    first = min(errors, key=lambda e: len(e["loc"]))
    param = _param_from_loc(tuple(first["loc"]))
    kind = first["type"]
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"{param} is required"
    else:
        value = first.get("input")
        shown = (
            json.dumps(value)[:80]
            if isinstance(value, str | int | float | bool | None)
            else type(value).__name__
        )
        message = f"{param}: {first['msg']} (got {shown})"
    return APIError(
        400, message, param=param, code="invalid_value" if kind != "missing" else "missing_required"
    )


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why not."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON ({exc}); send a JSON object with "
                       "Content-Type: application/json", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(
            400, f"The request body must be a JSON object, got {type(obj).__name__}", code="invalid_json"
        )
    return obj


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"Unknown path {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions"
            )
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(
            500, "Internal server error; the server log has the details", type="server_error"
        ).response()
