"""Routing objects: a pure function of (spec, names) -> a Gateway API Inference Extension ``InferencePool``.

The pool selects this engine's serving pods (the Deployment's own immutable selector, so pods of every
version in a rollout are candidates, and only Ready ones receive traffic) on the engine's API port, and
names the endpoint picker (EPP) that scores them. kiln pods export what the picker reads under the names it
reads by default (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info``,
see docs/prefix-routing.md), so the picker needs no metric flags. The picker itself is deployed with the
upstream chart or manifests (``--pool-name <engine> --pool-namespace <namespace>``); docs/scale-out.md.
"""

from __future__ import annotations

from typing import Any

from kiln.operator.naming import picker_name, selector_labels, service_name, serving_labels

from kiln.api import LLMEngineSpec
from kiln.serving_options import RoutingOptions

INFERENCE_API = "inference.networking.k8s.io/v1"


def endpoint_picker_name(spec: LLMEngineSpec, name: str) -> str:
    """``spec.serving.routing.endpointPicker``, else ``<engine>-epp``: the engine's Service name (which starts with
    a letter: ``llme-<engine>`` for an engine named with a digit first) plus ``-epp`` (:func:`naming.picker_name`)."""
    return picker_name(spec.serving.routing, service_name(name))


def inference_pool(spec: LLMEngineSpec, name: str, namespace: str,
                   owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The InferencePool of ``spec.serving.routing.inferencePool: true``; None when routing is off."""
    routing = spec.serving.routing
    if not routing.inference_pool:
        return None
    return build_inference_pool(routing, name, namespace, serving_labels(name), selector_labels(name),
                                spec.serving.port, endpoint_picker_name(spec, name), owner)


def build_inference_pool(routing: RoutingOptions, name: str, namespace: str, labels: dict[str, str],
                         selector: dict[str, str], port: int, picker: str,
                         owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """An InferencePool ``name`` over the pods ``selector`` matches, on ``port``, scored by the picker Service
    ``picker`` (an engine's, above, or a pool's: ``kiln.operator.pools.build_pool_inference_pool``)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        meta["ownerReferences"] = [owner]
    return {
        "apiVersion": INFERENCE_API,
        "kind": "InferencePool",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {
                "group": "", "kind": "Service", "name": picker,
                "port": {"number": routing.endpoint_picker_port},
                "failureMode": routing.endpoint_picker_failure_mode,
            },
        },
    }
