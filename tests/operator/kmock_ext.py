"""A stricter Kubernetes emulator on top of KMock's, for running kopf against it over HTTP.

Stock ``kmock.KubernetesEmulator`` 0.8 stores whatever it is sent. The operator's
correctness depends on API-server behaviour it lacks, so this subclass adds:

- server-set ``uid``, ``resourceVersion`` (one global counter), ``creationTimestamp``,
  ``generation`` (1 on create, +1 when anything outside metadata/status changes);
  ``generateName``; 201 on create;
- 409 ``AlreadyExists`` on create of a live name, 409 ``Conflict`` on a PUT/PATCH that
  carries a stale ``metadata.resourceVersion`` (optimistic concurrency);
- PUT (replace); merge, strategic-merge (treated as merge: lists replace) and JSON patches;
- the status subresource: for resources declared with ``subresources={'status'}``, writes
  to the main endpoint ignore ``status`` and writes to ``/status`` change only ``status``;
  ``status`` is dropped on create;
- ``labelSelector`` (=, ==, !=, exists, !exists, in, notin) and ``fieldSelector``
  (metadata.name, metadata.namespace) on list and watch; watches end after ``timeoutSeconds``;
- 404 ``NotFound`` for any request on a resource the emulator does not serve (a CRD that is not
  installed), where stock KMock would store the object anyway;
- ``/api/v1/namespaces`` (kmock 0.8's path parser fails on it): lists the namespaces that
  hold objects plus ``extra_namespaces``; a watch on it stays open until ``timeoutSeconds``;
- 404 ``NotFound`` for any resource type not declared in ``resources`` or listed in ``uninstalled`` (a CRD
  that is not installed), and, as the real apiserver does, a plain-text ``404 page not found`` when no
  resource of that API group and version is served at all;
- finalizers (deletionTimestamp until the last one is removed) and the garbage collector:
  when an object is gone, dependents lose that ownerReference and are deleted once no owner
  is left (``propagationPolicy: Orphan`` only strips the reference).

Objects stay in ``self.objects`` (KMock's history-keeping array), so tests can also assert on them.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import dicts

Key = tuple[Any, str | None, str]


def _conflict(reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=409, reason=reason, message=message, details={})


def _not_found(kind: str, name: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=404, reason="NotFound", message=f'{kind} "{name}" not found', details={})


def _not_found_resource() -> kmock.KubernetesError:
    return kmock.KubernetesError(status=404, reason="NotFound",
                                 message="the server could not find the requested resource", details={})


_SET_REQ = re.compile(r"^(\S+)\s+(in|notin)\s+\((.*)\)$")
_EQ_REQ = re.compile(r"^([^=!\s]+)\s*(==|=|!=)\s*(\S*)$")


def parse_label_selector(text: str | None) -> list[tuple[str, str, set[str]]]:
    """``a=b,c!=d,e,!f,g in (x,y)`` -> [(key, op, values)]; op in {'=', '!=', 'exists', '!exists', 'in', 'notin'}."""
    if not text:
        return []
    parts, depth, cur = [], 0, ""
    for ch in text:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for part in filter(str.strip, parts):
        part = part.strip()
        if part.startswith("!"):
            out.append((part[1:].strip(), "!exists", set()))
            continue
        if m := _SET_REQ.match(part):
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            out.append((m.group(1), m.group(2), values))
        elif m := _EQ_REQ.match(part):
            out.append((m.group(1), "!=" if m.group(2) == "!=" else "=", {m.group(3)}))
        elif re.match(r"^[A-Za-z0-9_./-]+$", part):
            out.append((part, "exists", set()))
        else:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=f"bad selector {part!r}")
    return out


def labels_match(labels: dict[str, str], selector: list[tuple[str, str, set[str]]]) -> bool:
    for key, op, values in selector:
        present, value = key in labels, labels.get(key)
        ok = {"exists": present, "!exists": not present, "=": present and value in values,
              "!=": not present or value not in values, "in": present and value in values,
              "notin": not present or value not in values}[op]
        if not ok:
            return False
    return True


def _essence(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class StrictKubernetesEmulator(kmock.KubernetesEmulator):
    _revision: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_revision: int = attrs.field(default=0, init=False)

    extra_namespaces: set[str] = attrs.field(factory=set)
    unknown_resources_404: bool = True  # like an API server: only declared resources exist
    uninstalled: set[str] = attrs.field(factory=set)  # plurals a test removed (a CRD deleted from the cluster)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_namespaces(raw_request)
        return await super().__call__(raw_request)

    async def _serve_namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.query.get("watch") == "true":
            response = aiohttp.web.StreamResponse()
            try:
                await response.prepare(raw_request)
                await asyncio.sleep(float(raw_request.query.get("timeoutSeconds") or 60))
                await response.write_eof()
            except ConnectionResetError:  # the operator hung up (it is stopping): a client may, as on a real server
                pass
            return response
        names = {ns for _, ns, _ in self.objects.keys() if ns} | self.extra_namespaces
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "resourceVersion": "1"}}
                 for ns in sorted(names)]
        return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList", "items": items,
                                          "metadata": {"resourceVersion": str(self._last_revision)}})

    # ---- helpers ---------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._last_revision = next(self._revision)
        return str(self._last_revision)

    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _live(self, key: Key) -> dict[str, Any] | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    async def _emit(self, resource: Any, kind: str, obj: dict[str, Any]) -> None:
        await self._buses[resource].put({"type": kind, "object": copy.deepcopy(obj)})

    # ---- dispatch ----------------------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None:
            return await super()._handle(request)
        if self.unknown_resources_404 and (res not in self._get_resources() or res.plural in self.uninstalled):
            # An API server answers 404 for a resource type it does not serve (a CRD that is not installed):
            # as plain text, not a Status, when no resource of that group and version is served at all (what
            # the real apiserver sends, and the operator once failed to parse: docs/local-cluster.md).
            served = [r for r in self._get_resources() if r.plural not in self.uninstalled]
            if not any(r.group == res.group and r.version == res.version for r in served):
                return aiohttp.web.Response(status=404, text="404 page not found\n")
            raise _not_found_resource()
        method = request.method.value if request.method else ""
        if method == "POST" and request.name is None:
            return await self._create(request)
        if method in ("PUT", "PATCH") and request.name is not None:
            return await self._write(request, method)
        if method == "DELETE" and request.name is not None:
            return await self._delete(request)
        return await super()._handle(request)  # fetch, list, watch: via the overridden _serve_* below

    async def _create(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        body = copy.deepcopy(request.data or {})
        meta = body.setdefault("metadata", {})
        namespace = request.namespace or meta.get("namespace")
        if not meta.get("name") and meta.get("generateName"):  # 5 random characters, as the apiserver's; one
            while True:  # not taken (a test posts hundreds of kopf events: a collision's 409 broke one)
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                if self._live((request.resource, namespace, meta["name"])) is None:
                    break
        if not meta.get("name"):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="metadata.name: Required value")
        if request.namespace:
            meta["namespace"] = request.namespace
        key = (request.resource, namespace, meta["name"])
        async with self._lock:
            if self._live(key) is not None:
                raise _conflict("AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
            for field in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(field, None)
            meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1,
                        creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            if self._has_status(request.resource):
                body.pop("status", None)
            if key in self.objects:
                self.objects[key].create(body)
            else:
                self.objects[key] = body
            await self._emit(request.resource, "ADDED", body)
        return aiohttp.web.json_response(body, status=201)

    async def _write(self, request: kmock.Request, method: str) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        data = request.data
        async with self._lock:
            current = self._live(key)
            if current is None:
                raise _not_found(request.resource.plural, request.name)
            wanted_rv = (data.get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
            if wanted_rv and wanted_rv != current["metadata"]["resourceVersion"]:
                raise _conflict("Conflict", f'Operation cannot be fulfilled on {request.resource.plural} '
                                f'"{request.name}": the object has been modified; please apply your changes '
                                f"to the latest version and try again")
            if method == "PUT":
                new = copy.deepcopy(data)
            else:
                new = copy.deepcopy(dict(dicts.patch_dict(current, data)))
            status_only = request.subresource == "status"
            if status_only:
                new = {**current, "status": new.get("status")}
            elif self._has_status(request.resource):
                new["status"] = current.get("status")
            if new.get("status") is None:
                new.pop("status", None)
            meta = new.setdefault("metadata", {})
            for field in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
                if field in current["metadata"]:
                    meta[field] = current["metadata"][field]
            meta["generation"] = current["metadata"].get("generation", 1) + (
                0 if status_only or _essence(new) == _essence(current) else 1)
            meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            if new == current:
                return aiohttp.web.json_response(current)  # a no-op write does not bump the version
            meta["resourceVersion"] = self._next_rv()
            self.objects[key].history.append(new)
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                await self._remove(key, new)
            else:
                await self._emit(request.resource, "MODIFIED", new)
        return aiohttp.web.json_response(new)

    async def _delete(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        options = request.data if isinstance(request.data, dict) else {}
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy") or "Background"
        async with self._lock:
            current = self._live(key)
            if current is None:
                raise _not_found(request.resource.plural, request.name)
            meta = current["metadata"]
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    meta["resourceVersion"] = self._next_rv()
                    self.objects[key].history.append(current)
                    await self._emit(request.resource, "MODIFIED", current)
                return aiohttp.web.json_response(current)
            await self._remove(key, current, orphan=policy == "Orphan")
        return aiohttp.web.json_response(current)

    async def _remove(self, key: Key, obj: dict[str, Any], orphan: bool = False) -> None:
        """Delete for real (lock held), then collect the dependents that have no owner left."""
        self.objects[key].delete()
        await self._emit(key[0], "DELETED", obj)
        uid = obj["metadata"].get("uid")
        for dep_key in list(self.objects.keys()):
            dep = self._live(dep_key)
            refs = (dep or {}).get("metadata", {}).get("ownerReferences") or []
            if not any(ref.get("uid") == uid for ref in refs):
                continue
            rest = [ref for ref in refs if ref.get("uid") != uid]
            dep["metadata"]["ownerReferences"] = rest
            if not rest:
                del dep["metadata"]["ownerReferences"]
            if rest or orphan:
                dep["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[dep_key].history.append(dep)
                await self._emit(dep_key[0], "MODIFIED", dep)
            elif dep["metadata"].get("finalizers"):
                dep["metadata"]["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).isoformat()
                dep["metadata"]["resourceVersion"] = self._next_rv()
                self.objects[dep_key].history.append(dep)
                await self._emit(dep_key[0], "MODIFIED", dep)
            else:
                await self._remove(dep_key, dep)

    # ---- reading -----------------------------------------------------------------------------
    def _selected(self, request: kmock.Request, resource: Any, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        if resource != request.resource:
            return False
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        if not labels_match(meta.get("labels") or {}, parse_label_selector(request.params.get("labelSelector"))):
            return False
        for term in filter(None, (request.params.get("fieldSelector") or "").split(",")):
            field, _, value = term.partition("=")
            negate = field.endswith("!")
            actual = meta.get(field.rstrip("!").removeprefix("metadata."))
            if (actual == value.lstrip("=")) == negate:
                return False
        return True

    def _snapshot(self, request: kmock.Request) -> list[dict[str, Any]]:
        return [obj.raw for (res, _, _), obj in self.objects.items()
                if not obj.deleted and self._selected(request, res, obj.raw)]

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._snapshot(request)
            rv = str(self._last_revision)
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": rv}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else datetime.datetime.now().timestamp() + timeout
        bus = self._buses[request.resource]
        since = int(request.params.get("resourceVersion") or 0)
        async with self._lock:  # snapshot and mark together: no event falls between them
            events = [{"type": "ADDED", "object": raw} for raw in self._snapshot(request)
                      if int(raw["metadata"].get("resourceVersion") or 0) > since]
            marker = await bus.mark()
        try:
            for event in events:
                yield event
            stream = bus.stream(since=marker)
            while True:
                left = None if deadline is None else deadline - datetime.datetime.now().timestamp()
                if left is not None and left <= 0:
                    return
                try:
                    event = await asyncio.wait_for(anext(stream), left)
                except TimeoutError:
                    return
                if self._selected(request, request.resource, event.get("object") or {}):
                    yield event
        finally:
            await bus.unmark(marker)
