"""Apply one rendered object: create it, or merge-patch it when its rendering changed.

A hash of the rendered object, stored in its ``serving.kiln.dev/rendered-hash`` annotation,
decides whether anything changed; a diff against the live object would see every field the
API server defaults. Merge patches keep keys they do not name, so the pod fields the
operator owns (:data:`MANAGED_POD_FIELDS`) are cleared explicitly, and an autoscaled
workload's ``spec.replicas`` is set on create only: the autoscaler owns it after that. An object another
object controls is never changed (a 409): two owners whose names clash do not take turns rewriting it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kiln.operator import scale_out
from kiln.operator.autoscaling import REPLICAS_OWNER
from kiln.operator.kube import ApiError, KubeClient, api_path
from kiln.operator.naming import LWS_PLURAL, controller_of, same_owner

HASH_ANNOTATION = "serving.kiln.dev/rendered-hash"
MANAGED_POD_FIELDS = ("nodeSelector", "tolerations", "serviceAccountName")


def rendered_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


async def apply(kube: KubeClient, desired: dict[str, Any]) -> dict[str, Any]:
    """Create, or merge-patch when the rendering changed (a hash annotation, not a diff against
    server-defaulted fields, decides); returns the live object."""
    meta = desired["metadata"]
    meta.setdefault("annotations", {})[HASH_ANNOTATION] = rendered_hash(desired)
    plural = {"Deployment": "deployments", "Service": "services", "PodDisruptionBudget": "poddisruptionbudgets",
              "NetworkPolicy": "networkpolicies", "ConfigMap": "configmaps",
              "LeaderWorkerSet": LWS_PLURAL, **scale_out.PLURALS}
    collection = api_path(desired["apiVersion"], plural[desired["kind"]], meta["namespace"])
    path = f"{collection}/{meta['name']}"
    live = await kube.get(path)
    if live is None:
        try:
            return await kube.create(collection, desired)
        except ApiError as exc:
            if exc.status != 409:
                raise
            live = await kube.get(path) or {}
    if (theirs := controller_of(live)) is not None and not same_owner(theirs, controller_of(desired) or {}):
        raise ApiError(409, "Conflict", f"{desired['kind']} {meta['namespace']}/{meta['name']} belongs to "
                       f"{theirs.get('kind')} {theirs.get('name')}: not changed (its name clashes)")
    if (live.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION) == meta["annotations"][
            HASH_ANNOTATION]:
        return live
    patch = json.loads(json.dumps(desired))
    if desired["kind"] == "Deployment":  # merge patches keep absent keys: clear the ones we own
        pods = [patch["spec"]["template"]["spec"]]
    elif desired["kind"] == "LeaderWorkerSet":
        lwt = patch["spec"]["leaderWorkerTemplate"]
        pods = [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    else:
        pods = []
    for pod in pods:
        for key in MANAGED_POD_FIELDS:
            pod.setdefault(key, None)
        if meta["annotations"].get(REPLICAS_OWNER) == "autoscaler":
            del patch["spec"]["replicas"]  # set on create only: the autoscaler owns it (never fight it)
    return await kube.patch(path, patch)
