"""A small async Kubernetes client on the connection kopf itself logged in with.

kopf's login handler (handlers.login) stores its ``ConnectionInfo`` here, so
the operator reaches Jobs, Deployments and Services with exactly the server,
CA and credentials kopf uses for LLMEngines (in-cluster service account or
kubeconfig), and re-login replaces them for both. Plain JSON over aiohttp:
no model classes, so an object is the dict the renderers return.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import ssl
import tempfile
from datetime import datetime
from typing import Any

import aiohttp
import kopf


def in_cluster_server(info: kopf.ConnectionInfo | None) -> kopf.ConnectionInfo | None:
    """The service account's connection, addressed as client-go's InClusterConfig addresses it.

    kopf's service-account login names ``https://kubernetes.default.svc`` (port 443), which needs cluster
    DNS and a Service proxy; the kubelet gives every pod the apiserver's address in
    ``KUBERNETES_SERVICE_HOST``/``_PORT``, which client-go and the official clients use. A real cluster whose
    pods cannot resolve the name (DNS down, or none: the local cluster, docs/local-cluster.md) still works.
    """
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is None or not host or not port:
        return info
    host = f"[{host}]" if ":" in host else host
    return dataclasses.replace(info, server=f"https://{host}:{port}")


def parse_time(text: str) -> datetime:
    """A timestamp as the API server writes it (RFC 3339, ``...Z``)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def iso(moment: datetime) -> str:
    """``moment`` as the API server writes a timestamp: whole seconds, ``...Z``."""
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def api_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [root, *(["namespaces", namespace] if namespace else []), plural, name or "", subresource or ""]
    return "/" + "/".join(p.strip("/") for p in parts if p)


class KubeClient:
    def __init__(self) -> None:
        self.connection: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_for: kopf.ConnectionInfo | None = None

    def _ssl(self, info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
        if not info.server.startswith("https"):
            return False
        if info.insecure:
            return False
        ctx = ssl.create_default_context(cafile=info.ca_path or None)
        if info.ca_data:
            data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
            ctx.load_verify_locations(cadata=data if "BEGIN" in data else base64.b64decode(data).decode())
        cert, key = info.certificate_path, info.private_key_path
        if info.certificate_data or info.private_key_data:  # load_cert_chain wants files
            cert, key = _tmp(info.certificate_data), _tmp(info.private_key_data)
        if cert:
            ctx.load_cert_chain(cert, key)
        return ctx

    async def _get_session(self) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        info = self.connection
        if info is None:
            raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
        if self._session is None or self._session_for is not info:
            if self._session is not None:
                await self._session.close()
            headers = {"Accept": "application/json"}
            if info.token:
                headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
            auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
            self._session = aiohttp.ClientSession(
                base_url=info.server.rstrip("/") + "/", headers=headers, auth=auth,
                connector=aiohttp.TCPConnector(ssl=self._ssl(info)),
                timeout=aiohttp.ClientTimeout(total=30))
            self._session_for = info
        return self._session, info

    async def request(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        session, _ = await self._get_session()
        headers = {"Content-Type": content_type} if body is not None else {}
        async with session.request(method, path.lstrip("/"), json=body, params=params, headers=headers) as resp:
            raw = await resp.read()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:  # the apiserver answers a path no API serves with text ("404 page not found")
            data = None
        if resp.status >= 400:
            found = data if isinstance(data, dict) else {}
            raise ApiError(resp.status, found.get("reason") or resp.reason or "",
                           found.get("message") or raw.decode(errors="replace").strip()[:200])
        return data

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``api_version`` (discovery; a CRD not installed is a 404)."""
        try:
            found = await self.request("GET", api_path(api_version, ""))
        except ApiError as exc:
            if exc.status in (404, 503):  # 503: an aggregated API that is registered but down
                return False
            raise
        return any(r.get("name") == plural for r in (found or {}).get("resources") or [])

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self.request("GET", path, params=params))["items"] or []

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path, {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _tmp(data: str | bytes | None) -> str | None:
    if not data:
        return None
    raw = data if isinstance(data, bytes) else data.encode()
    if b"BEGIN" not in raw:
        raw = base64.b64decode(raw)
    with tempfile.NamedTemporaryFile(delete=False, suffix=".pem") as f:
        f.write(raw)
        return f.name
