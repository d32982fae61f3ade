"""Operator configuration: one frozen dataclass, read from ``KILN_*`` environment variables.

The Helm chart sets these on the operator Deployment; ``kiln operator`` flags
override a few of them. Renderers receive the whole object, so a rendered Job
or Deployment is a pure function of (spec, names, version, config).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.operator.images import parse_allow_entry, parse_image

from kiln.skus import GPU_SKUS

DEFAULT_GPU_LABEL = "nvidia.com/gpu.product"
DEFAULT_IMAGE = "ghcr.io/kiln-dev/kiln:0.1.0"
# Recorded in every artifact this operator builds and required of every artifact it serves; the chart
# sets "<namespace>/<service account>" (value operatorId overrides it).
DEFAULT_OPERATOR_ID = "kiln-operator"


class ConfigError(ValueError):
    """A ``KILN_*`` variable that cannot be used; the message names it."""


def default_sku_node_labels() -> dict[str, dict[str, str]]:
    """SKU -> nodeSelector, from GPU feature discovery's product label; ``cpu`` selects nothing."""
    return {
        sku: ({DEFAULT_GPU_LABEL: gpu.product_label} if gpu.product_label else {})
        for sku, gpu in GPU_SKUS.items()
    }


def _json_env(env: Mapping[str, str], name: str, default: Any, kind: type) -> Any:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def _int_env(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _allowed_images(env: Mapping[str, str]) -> tuple[str, ...]:
    entries = _json_env(env, "KILN_ALLOWED_IMAGES", [], list)
    for i, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise ConfigError(f"KILN_ALLOWED_IMAGES[{i}] must be a string, got {type(entry).__name__}")
        try:
            parse_allow_entry(entry)
        except ValueError as exc:
            raise ConfigError(f"KILN_ALLOWED_IMAGES[{i}] {entry!r}: {exc} (chart value allowedImages; forms: "
                              "repo:tag, repo@sha256:..., repo, registry/path/*)") from None
    return tuple(entries)


def _image_env(env: Mapping[str, str], name: str, default: str) -> str:
    image = env.get(name, "").strip() or default
    try:
        parse_image(image)
    except ValueError as exc:
        raise ConfigError(f"{name} {image!r} is not an image reference: {exc}") from None
    return image


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None


@dataclass(frozen=True)
class OperatorConfig:
    store_uri: str = ""
    builder_image: str = DEFAULT_IMAGE
    serving_image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    # Secret with AWS_* (or other store) credentials: envFrom of the build container (it publishes) ...
    store_secret: str | None = None
    # ... and of serving pods (they only read: give them read-only credentials); None: store_secret.
    serving_store_secret: str | None = None
    # Images an LLMEngine may name in spec.build.image / spec.serving.image besides the chart's own
    # (forms: kiln.operator.images). Empty: only the chart's images.
    allowed_images: tuple[str, ...] = ()
    operator_id: str = DEFAULT_OPERATOR_ID
    sku_node_labels: dict[str, dict[str, str]] = field(default_factory=default_sku_node_labels)
    gpu_tolerations: list[dict[str, Any]] = field(default_factory=lambda: [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    build_resources: dict[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "2", "memory": "8Gi"}})
    serving_resources: dict[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "1", "memory": "4Gi"}})
    build_backoff_limit: int = 1
    build_ttl_seconds: int = 86400
    startup_timeout_seconds: int = 1800
    prestop_sleep_seconds: int = 5
    builder_service_account: str | None = None
    serving_service_account: str | None = None
    reconcile_interval: float = 15.0
    metrics_port: int = 0  # 0 = no metrics server
    ha: bool = False
    # -- scale out (docs/scale-out.md): what renders spec.serving.autoscaling, and where the scalers live --
    autoscaler: str = "keda"  # "keda": KEDA ScaledObject (+ HTTP add-on for minReplicas 0); "hpa": HPA v2
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"  # KEDA's prometheus trigger
    keda_http_scaler_address: str = "keda-add-ons-http-external-scaler.keda:9090"  # HTTP add-on external scaler
    hpa_metric_prefix: str = "kiln_"  # Pods metrics as a metrics adapter names kiln:* series (kiln_num_requests_waiting)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        labels = default_sku_node_labels()
        custom = _json_env(env, "KILN_SKU_NODE_LABELS", {}, dict)
        for sku, selector in custom.items():
            if not isinstance(selector, dict) or not all(isinstance(v, str) for v in selector.values()):
                raise ConfigError(f"KILN_SKU_NODE_LABELS[{sku!r}] must map label keys to string values")
            labels[sku] = dict(selector)
        base = cls()
        store_secret = env.get("KILN_STORE_SECRET", "").strip() or None
        return _with_scale_out(env, cls(
            store_uri=env.get("KILN_STORE_URI", "").strip(),
            builder_image=_image_env(env, "KILN_BUILDER_IMAGE", base.builder_image),
            serving_image=_image_env(env, "KILN_SERVING_IMAGE", base.serving_image),
            image_pull_policy=env.get("KILN_IMAGE_PULL_POLICY", "").strip() or base.image_pull_policy,
            store_secret=store_secret,
            serving_store_secret=env.get("KILN_SERVING_STORE_SECRET", "").strip() or None,
            allowed_images=_allowed_images(env),
            operator_id=env.get("KILN_OPERATOR_ID", "").strip() or base.operator_id,
            sku_node_labels=labels,
            gpu_tolerations=_json_env(env, "KILN_GPU_TOLERATIONS", base.gpu_tolerations, list),
            tolerations=_json_env(env, "KILN_TOLERATIONS", [], list),
            build_resources=_json_env(env, "KILN_BUILD_RESOURCES", base.build_resources, dict),
            serving_resources=_json_env(env, "KILN_SERVING_RESOURCES", base.serving_resources, dict),
            build_backoff_limit=_int_env(env, "KILN_BUILD_BACKOFF_LIMIT", base.build_backoff_limit),
            build_ttl_seconds=_int_env(env, "KILN_BUILD_TTL_SECONDS", base.build_ttl_seconds),
            startup_timeout_seconds=_int_env(env, "KILN_STARTUP_TIMEOUT_SECONDS", 1800, minimum=10),
            prestop_sleep_seconds=_int_env(env, "KILN_PRESTOP_SLEEP_SECONDS", 5),
            builder_service_account=env.get("KILN_BUILDER_SERVICE_ACCOUNT", "").strip() or None,
            serving_service_account=env.get("KILN_SERVING_SERVICE_ACCOUNT", "").strip() or None,
            reconcile_interval=reconcile_interval_from_env(env),
            metrics_port=_int_env(env, "KILN_METRICS_PORT", 0),
            ha=env.get("KILN_HA", "").strip().lower() in ("1", "true", "yes"),
        ))

    @property
    def serving_secret(self) -> str | None:
        return self.serving_store_secret or self.store_secret

    def node_selector(self, sku: str) -> dict[str, str] | None:
        """The nodeSelector for a SKU; None when the map has no entry (a spec error, not a default)."""
        return self.sku_node_labels.get(sku)


# ---- scale out (issue 14) -------------------------------------------------------------------------------------
AUTOSCALERS = ("keda", "hpa")


def _with_scale_out(env: Mapping[str, str], config: OperatorConfig) -> OperatorConfig:
    """The KILN_* variables of docs/scale-out.md (chart values autoscaling.*)."""
    autoscaler = env.get("KILN_AUTOSCALER", "").strip().lower() or config.autoscaler
    if autoscaler not in AUTOSCALERS:
        raise ConfigError(f"KILN_AUTOSCALER must be one of {', '.join(AUTOSCALERS)}, got {autoscaler!r} "
                          "(chart value autoscaling.engine)")
    return dataclasses.replace(
        config, autoscaler=autoscaler,
        prometheus_address=env.get("KILN_PROMETHEUS_ADDRESS", "").strip() or config.prometheus_address,
        keda_http_scaler_address=env.get("KILN_KEDA_HTTP_SCALER_ADDRESS", "").strip()
        or config.keda_http_scaler_address,
        hpa_metric_prefix=env.get("KILN_HPA_METRIC_PREFIX", "").strip() or config.hpa_metric_prefix,
    )


def reconcile_interval_from_env(env: Mapping[str, str]) -> float:
    """``KILN_RECONCILE_INTERVAL`` seconds (default 15): the one reading of it. kopf needs the value
    when the handlers module is imported (its timer decorator), before ``from_env`` runs."""
    value = _float_env(env, "KILN_RECONCILE_INTERVAL", OperatorConfig.reconcile_interval)
    if value <= 0:
        raise ConfigError(f"KILN_RECONCILE_INTERVAL must be > 0 seconds, got {value:g}")
    return value
