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
from kiln.operator.naming import BUILD_KEY_SECRET, VERIFY_KEY_SECRET

from kiln.skus import GPU_SKUS

DEFAULT_GPU_LABEL = "nvidia.com/gpu.product"
DEFAULT_IMAGE = "ghcr.io/kiln-dev/kiln:0.1.0"
# Recorded in every artifact this operator builds and required of every artifact it serves; the chart
# sets "<namespace>/<service account>" (value operatorId overrides it).
DEFAULT_OPERATOR_ID = "kiln-operator"
# The Secret, in the operator's namespace, holding the key pair build Jobs sign with and serving pods verify
# with (kiln.operator.keys); the operator creates it unless the chart names one (signing.secretName).
DEFAULT_KEY_SECRET = "kiln-signing-key"
WRITE_IN_SERVING_HINT = ("store.credentialsSecret (KILN_STORE_SECRET) is set but store.servingCredentialsSecret "
                         "(KILN_SERVING_STORE_SECRET) is not: serving pods only read the store, so they do not get "
                         "the build's write credentials. Set store.servingCredentialsSecret to a read-only Secret "
                         "(docs/operator-trust.md has an S3 policy), or set store.allowWriteCredentialsInServing "
                         "(KILN_ALLOW_WRITE_CREDENTIALS_IN_SERVING=true) to give serving pods the write Secret")


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
    # ... and of serving pods (they only read: read-only credentials). None: no store credentials (pod
    # identity), or store_secret when allow_write_in_serving (from_env refuses a write Secret alone).
    serving_store_secret: str | None = None
    allow_write_in_serving: bool = False
    # Where the operator runs (its key pair Secret lives there), and that Secret when the admin brings one.
    operator_namespace: str = "default"
    signing_secret: str | None = None
    # Where build Jobs run, and so the only namespace besides the operator's that holds the private key (None:
    # the operator's). Engine namespaces get the public key only (kiln.operator.keys).
    build_namespace: str | None = None
    # Build Jobs that fail on a storage error (the builder's exit code 3) are retried this many times, the
    # first after build_retry_delay_seconds, each next one after twice as long.
    build_retries: int = 3
    build_retry_delay_seconds: float = 60.0
    # Copy a spec's credentialsSecret next to its build Job (chart build.copyCredentials). False: the operator reads
    # no Secret of an engine namespace; the user creates kiln-cred-<namespace>.<secret> in the jobs namespace.
    copy_credentials: bool = True
    # A NetworkPolicy per engine: the serving port open, every other port only to the engine's own pods.
    network_policy: bool = True
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
    # How long after a pool first lists an engine its pods have surely loaded the engine list (its mounted
    # ConfigMap synced by the kubelet: about a minute with the kubelet's default --sync-frequency; chart value
    # pools.listSyncSeconds). Until then an engine that served alone keeps its own pods (docs/pools.md).
    pool_list_sync_seconds: float = 90.0
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
        return _with_trust(env, _with_scale_out(env, cls(
            store_uri=env.get("KILN_STORE_URI", "").strip(),
            builder_image=_image_env(env, "KILN_BUILDER_IMAGE", base.builder_image),
            serving_image=_image_env(env, "KILN_SERVING_IMAGE", base.serving_image),
            image_pull_policy=env.get("KILN_IMAGE_PULL_POLICY", "").strip() or base.image_pull_policy,
            store_secret=store_secret,
            serving_store_secret=env.get("KILN_SERVING_STORE_SECRET", "").strip() or None,
            allow_write_in_serving=_bool_env(env, "KILN_ALLOW_WRITE_CREDENTIALS_IN_SERVING", False),
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
            pool_list_sync_seconds=_positive_env(env, "KILN_POOL_LIST_SYNC_SECONDS", base.pool_list_sync_seconds,
                                                 "pools.listSyncSeconds"),
            metrics_port=_int_env(env, "KILN_METRICS_PORT", 0),
            ha=_bool_env(env, "KILN_HA", False),
        )))

    @property
    def serving_secret(self) -> str | None:
        """The store Secret of serving pods: read-only credentials, never the write Secret unless allowed."""
        return self.serving_store_secret or (self.store_secret if self.allow_write_in_serving else None)

    @property
    def jobs_namespace(self) -> str:
        """The namespace of every build Job, engine and adapter alike."""
        return self.build_namespace or self.operator_namespace

    @property
    def key_secret(self) -> str:
        return self.signing_secret or DEFAULT_KEY_SECRET

    def node_selector(self, sku: str) -> dict[str, str] | None:
        """The nodeSelector for a SKU; None when the map has no entry (a spec error, not a default)."""
        return self.sku_node_labels.get(sku)


def _bool_env(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("1", "true", "yes", "0", "false", "no"):
        raise ConfigError(f"{name} must be true or false, got {raw!r}")
    return raw in ("1", "true", "yes")


def _with_trust(env: Mapping[str, str], config: OperatorConfig) -> OperatorConfig:
    """Keys, least-privilege store credentials, build retries, NetworkPolicies (docs/operator-trust.md)."""
    if config.store_secret and not config.serving_store_secret and not config.allow_write_in_serving:
        raise ConfigError(WRITE_IN_SERVING_HINT)
    signing_secret = env.get("KILN_SIGNING_SECRET", "").strip() or None
    if signing_secret in (BUILD_KEY_SECRET, VERIFY_KEY_SECRET):
        raise ConfigError(f"KILN_SIGNING_SECRET {signing_secret!r} (chart value signing.secretName) is the name of "
                          "the copies the operator writes into engine namespaces; name the key pair Secret otherwise")
    return dataclasses.replace(
        config,
        operator_namespace=env.get("KILN_OPERATOR_NAMESPACE", "").strip() or config.operator_namespace,
        signing_secret=signing_secret,
        build_namespace=env.get("KILN_BUILD_NAMESPACE", "").strip() or None,
        build_retries=_int_env(env, "KILN_BUILD_RETRIES", config.build_retries),
        build_retry_delay_seconds=_float_env(env, "KILN_BUILD_RETRY_DELAY_SECONDS", config.build_retry_delay_seconds),
        network_policy=_bool_env(env, "KILN_NETWORK_POLICY", config.network_policy),
        copy_credentials=_bool_env(env, "KILN_COPY_CREDENTIALS", config.copy_credentials),
    )


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


def _positive_env(env: Mapping[str, str], name: str, default: float, value_name: str) -> float:
    """``name``, seconds, more than 0 (chart value ``value_name``)."""
    value = _float_env(env, name, default)
    if value <= 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value:g} (chart value {value_name})")
    return value


def reconcile_interval_from_env(env: Mapping[str, str]) -> float:
    """``KILN_RECONCILE_INTERVAL`` seconds (default 15): the one reading of it. kopf needs the value
    when the handlers module is imported (its timer decorator), before ``from_env`` runs."""
    return _positive_env(env, "KILN_RECONCILE_INTERVAL", OperatorConfig.reconcile_interval, "reconcileIntervalSeconds")
