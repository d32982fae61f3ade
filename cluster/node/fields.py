"""A container's environment, as the kubelet builds it: the image's, then ``envFrom``, then ``env`` (with
``valueFrom`` and ``$(VAR)`` references), plus the variables that point a pod at the apiserver."""

from __future__ import annotations

import base64
import math
import re
from typing import Any

_LABEL = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


class EnvError(Exception):
    """A referenced ConfigMap or Secret (or key) is missing: the kubelet's CreateContainerConfigError."""


def field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = _LABEL.fullmatch(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"), "status.podIPs": status.get("podIP"),
        "metadata.labels": "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get("labels") or {}).items())),
        "metadata.annotations": "\n".join(f'{k}="{v}"'
                                          for k, v in sorted((meta.get("annotations") or {}).items())),
    }
    if path not in simple:
        raise EnvError(f"fieldRef {path!r} is not supported by the node agent")
    return str(simple[path] or "")


_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40}


def quantity(text: str | int | float) -> float:
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    if not m or m.group(2) not in _UNITS:
        raise EnvError(f"cannot read the quantity {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _resource(container: dict, ref: dict) -> str:
    kind, _, name = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(name)
    if value is None:
        return "0"
    return str(math.ceil(quantity(value) / quantity(ref.get("divisor", "1"))))


def _source(api: Any, kind: str, name: str, ns: str, optional: bool) -> dict[str, str]:
    from kubernetes.client.exceptions import ApiException

    try:
        if kind == "configMap":
            return dict(api.core.read_namespaced_config_map(name, ns).data or {})
        data = api.core.read_namespaced_secret(name, ns).data or {}
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
    except ApiException as exc:
        if exc.status == 404 and optional:
            return {}
        raise EnvError(f"{kind} {name!r} not found in {ns}") from None


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined name is replaced, an undefined one left as is, $$ is $."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(api: Any, pod: dict, container: dict, base: dict[str, str]) -> dict[str, str]:
    ns = pod["metadata"]["namespace"]
    env = dict(base)
    for src in container.get("envFrom") or []:
        kind = "configMap" if "configMapRef" in src else "secret"
        ref = src.get("configMapRef") or src.get("secretRef")
        for k, v in _source(api, kind, ref["name"], ns, bool(ref.get("optional"))).items():
            env[src.get("prefix", "") + k] = v
    for var in container.get("env") or []:
        env[var["name"]] = _env_value(api, pod, container, var, env)
    return env


def _env_value(api: Any, pod: dict, container: dict, var: dict, env: dict[str, str]) -> str:
    if "valueFrom" not in var:
        return expand(var.get("value") or "", env)
    vf, ns = var["valueFrom"], pod["metadata"]["namespace"]
    if "fieldRef" in vf:
        return field_value(pod, vf["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in vf:
        return _resource(container, vf["resourceFieldRef"])
    kind = "configMap" if "configMapKeyRef" in vf else "secret"
    ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
    data = _source(api, kind, ref["name"], ns, bool(ref.get("optional")))
    if ref["key"] not in data and not ref.get("optional"):
        raise EnvError(f"{kind} {ref['name']!r} has no key {ref['key']!r} (env {var['name']})")
    return data.get(ref["key"], "")
