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
import re
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
    408: "invalid_request_error",
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


def engine_dead_error(type: str | None = None) -> APIError:
    """What a request sees once the engine's step loop failed (a rank of its group died): only a restart helps.
    ``type``: a stream that already started says ``server_error``, as for any failure mid-stream."""
    return APIError(503, "The engine's step loop failed; this replica needs a restart (see /health)",
                    code="engine_dead", type=type)


def engine_died(engine: Any) -> bool:
    """The engine's step loop has failed (it fails every request it holds with the same error)."""
    return not getattr(engine, "is_running", True)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif (isinstance(item, str) and item not in _TYPE_TAGS and "[" not in item
              and not item.startswith("constrained-")):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _specificity(error: dict[str, Any]) -> tuple[bool, int]:
    """Sort key: a broken rule (too long, out of range) before a union member's type mismatch,
    then the shortest location."""
    kind = error["type"]
    mismatch = kind.endswith("_type") or kind in ("model_attributes_type", "is_instance_of")
    return mismatch, len(error["loc"])


def from_validation_error(exc: ValidationError) -> APIError:
    """The most telling pydantic error as a 400 naming its parameter (``messages[0].role``)."""
    errors = exc.errors(include_url=False)
    # Union members each report an error; prefer the one that names a concrete field problem.
    first = min(errors, key=_specificity)
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


MAX_JSON_DEPTH = 32  # nesting of arrays and objects; OpenAI bodies need 5


def _bad_json(message: str) -> APIError:
    return APIError(400, message, code="invalid_json")


def _refuse_constant(name: str) -> Any:
    raise _bad_json(f"The request body holds {name}, which is not JSON (RFC 8259); send finite numbers")


def _json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays/objects in the UTF-8 ``raw``, counted outside strings, in C.

    Brackets are ASCII, and UTF-8 never uses ASCII bytes inside a multi-byte character.
    """
    import numpy as np

    codes = np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)  # strings' brackets do not nest
    steps = ((codes == 0x5B) | (codes == 0x7B)).astype(np.int8) - ((codes == 0x5D) | (codes == 0x7D))
    return int(steps.cumsum(dtype=np.int64).max(initial=0))


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why not.

    Stricter than ``json.loads``: UTF-8 only (no UTF-16/32 guessing, no invalid bytes),
    no ``NaN``/``Infinity``, no lone surrogate escapes (they cannot be tokenized), and at
    most ``MAX_JSON_DEPTH`` levels of nesting (refused before parsing, so a deep body
    never reaches a recursive parser).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad_json(f"The request body is not valid UTF-8 (byte {exc.start}); JSON must be sent as "
                        "UTF-8") from None
    depth = _json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise _bad_json(f"The request body nests arrays/objects {depth} levels deep; at most "
                        f"{MAX_JSON_DEPTH} are allowed")
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _bad_json(f"The request body is not valid JSON ({exc}); send a JSON object with "
                        "Content-Type: application/json") from None
    if not isinstance(obj, dict):
        raise _bad_json(f"The request body must be a JSON object, got {type(obj).__name__}")
    if "\\ud" in text.lower():  # only an escape can make a surrogate: UTF-8 cannot encode one
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad_json("The request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                            "not in a pair); send valid Unicode text") from None
    return obj


# The Messages API's error shape ({"type": "error", "error": {"type", "message"}}), kiln's status codes.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(exc: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def anthropic_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(exc), status_code=exc.status, headers=exc.headers)


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
        anthropic = request.url.path.startswith("/v1/messages")  # an Anthropic SDK reads its own shape
        if exc.status_code == 404:
            message = (f"Unknown path {request.url.path}; kiln serves POST /v1/messages and /v1/messages/count_tokens "
                       "of Anthropic's API" if anthropic else f"Unknown path {request.url.path}; see /v1/models, "
                       "/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages")
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        error = APIError(exc.status_code, message, headers=getattr(exc, "headers", None))
        if anthropic:
            return anthropic_error_response(error)
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(
            500, "Internal server error; the server log has the details", type="server_error"
        ).response()
