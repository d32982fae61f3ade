"""Errors of the Messages API in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

The status codes are kiln's everywhere else (400, 401, 404, 413, 429 with ``Retry-After``, 503); the
error ``type`` is Anthropic's name for each (``errors.ANTHROPIC_TYPES``, beside the unknown-path handler that
uses it too). :class:`AnthropicRoute` renders every :class:`APIError`
its endpoints raise (the API-key check included) this way, so an Anthropic SDK reads the message
and raises its own exception class for the status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from kiln.serving.errors import APIError, anthropic_error_response

log = logging.getLogger("kiln.serving")

class AnthropicRoute(APIRoute):
    """A route whose errors are Anthropic-shaped (its dependencies' errors too: they run inside the handler)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                response = await handler(request)
                if "x-request-id" in response.headers:  # the header the Anthropic SDK reads (_request_id)
                    response.headers["request-id"] = response.headers["x-request-id"]
                return response
            except APIError as exc:
                return anthropic_error_response(exc)
            except Exception:
                log.exception("internal error on %s %s", request.method, request.url.path)
                return anthropic_error_response(APIError(500, "Internal server error; the server log has the details"))

        return anthropic_errors
