"""A pod's volumes as folders, written the way the kubelet writes them and kept current.

configMap, secret, projected (service-account token, CA, namespace) and downwardAPI volumes are written
with the kubelet's atomic layout: the files live in a timestamped folder, ``..data`` points at it, and each
key is a link through ``..data``, so a reader never sees half of an update; ``refresh`` rewrites them when
the source changes (a ConfigMap edit reaches a running pod without a restart). emptyDir is a fresh folder
(``medium: Memory`` a tmpfs), hostPath the host's path, and a persistentVolumeClaim a folder per claim
under the node's folder, kept across pods.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kiln_cluster.node.fields import field_value

TOKEN_REFRESH_S = 600  # a projected token is re-requested this often (its lifetime is at least an hour)


class VolumeError(Exception):
    """A volume's source is missing or unreadable (the pod waits, as the kubelet's would)."""


class Volumes:
    def __init__(self, api: Any, pod: dict, pod_root: Path, node_root: Path) -> None:
        self.api, self.pod = api, pod
        self.root = pod_root / "volumes"
        self.node_root = node_root
        self._contents: dict[str, dict[str, tuple[bytes, int]]] = {}
        self._token_at: float = 0.0
        self.paths: dict[str, Path] = {}
        self.tmpfs: set[str] = set()

    @property
    def ns(self) -> str:
        return self.pod["metadata"]["namespace"]

    def setup(self) -> None:
        for vol in self.pod["spec"].get("volumes") or []:
            self.paths[vol["name"]] = self._setup_one(vol)

    def _setup_one(self, vol: dict) -> Path:
        name = vol["name"]
        if "emptyDir" in vol:
            path = self.root / "empty" / name
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            if (vol["emptyDir"] or {}).get("medium") == "Memory":
                self.tmpfs.add(name)
            return path
        if "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                path.mkdir(parents=True, exist_ok=True)
            return path
        if "persistentVolumeClaim" in vol:
            path = self.node_root / "claims" / self.ns / vol["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
            return path
        if any(k in vol for k in ("configMap", "secret", "projected", "downwardAPI")):
            path = self.root / "atomic" / name
            path.mkdir(parents=True, exist_ok=True)
            self._write_atomic(vol, path)
            return path
        kinds = sorted(k for k in vol if k != "name")
        raise VolumeError(f"volume {name!r}: the node agent cannot provide volumes of kind {kinds}")

    def refresh(self) -> None:
        """Rewrite the atomic volumes whose sources changed (and tokens due for renewal)."""
        for vol in self.pod["spec"].get("volumes") or []:
            if vol["name"] in self.paths and self.root / "atomic" / vol["name"] == self.paths[vol["name"]]:
                self._write_atomic(vol, self.paths[vol["name"]])

    def _write_atomic(self, vol: dict, path: Path) -> None:
        files = self._render(vol)
        if files == self._contents.get(vol["name"]):
            return
        stamp = path / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
        stamp.mkdir()
        for rel, (data, mode) in files.items():
            dest = stamp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            dest.chmod(mode)
        tmp = path / "..data_tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(stamp.name)
        old = os.readlink(path / "..data") if (path / "..data").is_symlink() else None
        os.replace(tmp, path / "..data")
        for top in {rel.split("/", 1)[0] for rel in files}:
            link = path / top
            if not link.is_symlink():
                link.symlink_to(f"..data/{top}")
        if old:
            shutil.rmtree(path / old, ignore_errors=True)
        self._contents[vol["name"]] = files

    def _render(self, vol: dict) -> dict[str, tuple[bytes, int]]:
        if "configMap" in vol:
            return self._keyed("configMap", vol["configMap"], vol["configMap"].get("defaultMode", 0o644))
        if "secret" in vol:
            src = dict(vol["secret"], name=vol["secret"]["secretName"])
            return self._keyed("secret", src, vol["secret"].get("defaultMode", 0o644))
        if "downwardAPI" in vol:
            mode = vol["downwardAPI"].get("defaultMode", 0o644)
            return {i["path"]: (field_value(self.pod, i["fieldRef"]["fieldPath"]).encode(), i.get("mode", mode))
                    for i in vol["downwardAPI"].get("items") or []}
        return self._projected(vol["projected"])

    def _projected(self, proj: dict) -> dict[str, tuple[bytes, int]]:
        mode = proj.get("defaultMode", 0o644)
        files: dict[str, tuple[bytes, int]] = {}
        for src in proj.get("sources") or []:
            if "serviceAccountToken" in src:
                files[src["serviceAccountToken"]["path"]] = (self._token(src["serviceAccountToken"]), mode)
            elif "configMap" in src:
                files.update(self._keyed("configMap", src["configMap"], mode))
            elif "secret" in src:
                files.update(self._keyed("secret", src["secret"], mode))
            elif "downwardAPI" in src:
                for i in src["downwardAPI"].get("items") or []:
                    files[i["path"]] = (field_value(self.pod, i["fieldRef"]["fieldPath"]).encode(), i.get("mode", mode))
        return files

    def _keyed(self, kind: str, src: dict, mode: int) -> dict[str, tuple[bytes, int]]:
        data = self._read(kind, src["name"], optional=bool(src.get("optional")))
        items = src.get("items")
        if not items:
            return {k: (v, mode) for k, v in data.items()}
        out = {}
        for item in items:
            if item["key"] not in data:
                if src.get("optional"):
                    continue
                raise VolumeError(f"{kind} {src['name']!r} has no key {item['key']!r}")
            out[item["path"]] = (data[item["key"]], item.get("mode", mode))
        return out

    def _read(self, kind: str, name: str, optional: bool) -> dict[str, bytes]:
        from kubernetes.client.exceptions import ApiException

        try:
            if kind == "configMap":
                obj = self.api.core.read_namespaced_config_map(name, self.ns)
                data = {k: v.encode() for k, v in (obj.data or {}).items()}
                return data | {k: base64.b64decode(v) for k, v in (obj.binary_data or {}).items()}
            obj = self.api.core.read_namespaced_secret(name, self.ns)
            return {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
        except ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise VolumeError(f"{kind} {name!r} in {self.ns}: {exc.reason} ({exc.status})") from None

    def _token(self, spec: dict) -> bytes:
        key = "..token"
        cached = self._contents.get(key)
        if cached and time.monotonic() - self._token_at < TOKEN_REFRESH_S:
            return cached[spec["path"]][0]
        meta = self.pod["metadata"]
        body = {"spec": {"audiences": [spec["audience"]] if spec.get("audience") else None,
                         "expirationSeconds": spec.get("expirationSeconds", 3607),
                         "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                            "uid": meta["uid"]}}}
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.api.core.create_namespaced_service_account_token(sa, self.ns, body)
        except ApiException as exc:  # e.g. 403 "no relationship found between node ... and this object": the
            # apiserver's node authorizer has not yet seen the pod bound here; the kubelet retries, and so does this
            raise VolumeError(f"serviceAccountToken of {sa!r} in {self.ns}: {exc.reason} ({exc.status})") from None
        token = resp.status.token.encode()
        self._contents[key] = {spec["path"]: (token, 0o644)}
        self._token_at = time.monotonic()
        return token
