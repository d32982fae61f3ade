"""Optional API-key auth: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on the ``/v1`` endpoints.

The key comes from ``--api-key-file`` or ``$KILN_API_KEY`` and is compared in
constant time. It is never logged or echoed; probes and ``/metrics`` stay
open so kubelet and Prometheus need no secret.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from kiln.serving.errors import APIError


async def require_api_key(request: Request) -> None:
    key = request.app.state.kiln.config.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Missing or incorrect API key; send the header 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
