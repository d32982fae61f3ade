"""``kiln operator``: run the kopf operator with kiln's handlers.

Flags become the same ``KILN_*`` variables the Helm chart sets, so the startup
handler reads one source of configuration either way.
"""

from __future__ import annotations

import os

import click
from kiln.operator.settings import ConfigError, OperatorConfig


def _namespaces(namespace: tuple[str, ...], all_namespaces: bool) -> tuple[bool, list[str]]:
    """(clusterwide, namespaces) from flags, else from KILN_NAMESPACES (comma-separated, or '*')."""
    if namespace and all_namespaces:
        raise click.UsageError("pass either --namespace (repeatable) or --all-namespaces, not both")
    if all_namespaces:
        return True, []
    names = list(namespace) or [n.strip() for n in os.environ.get("KILN_NAMESPACES", "").split(",") if n.strip()]
    if names == ["*"]:
        return True, []
    if not names:
        raise click.UsageError("which namespaces? pass --namespace NS (repeatable) or --all-namespaces "
                               "(or set KILN_NAMESPACES)")
    return False, names


@click.command("operator")
@click.option("--namespace", "-n", multiple=True, help="Namespace to watch (repeatable; globs like 'ml-*' work).")
@click.option("--all-namespaces", "-A", is_flag=True, help="Watch LLMEngines in every namespace.")
@click.option("--store", metavar="URI", help="Artifact store, e.g. s3://bucket/prefix (env KILN_STORE_URI).")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (env KILN_METRICS_PORT).")
@click.option("--ha", is_flag=True, help="Run several replicas: kopf peering elects one active operator.")
@click.option("--liveness", default="http://0.0.0.0:8080/healthz", show_default=True,
              help="kopf liveness endpoint for the Deployment's probe ('' to disable).")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging.")
def operator(namespace: tuple[str, ...], all_namespaces: bool, store: str | None, metrics_port: int | None,
             ha: bool, liveness: str, verbose: bool) -> None:
    """Run the kiln operator: LLMEngine -> build Job -> artifact -> Deployment."""
    clusterwide, namespaces = _namespaces(namespace, all_namespaces)
    if store:
        os.environ["KILN_STORE_URI"] = store
    if metrics_port is not None:
        os.environ["KILN_METRICS_PORT"] = str(metrics_port)
    if ha:
        os.environ["KILN_HA"] = "true"
    try:
        config = OperatorConfig.from_env()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if not config.store_uri:
        raise click.UsageError("no artifact store: pass --store s3://bucket/prefix or set KILN_STORE_URI")

    # After the flags are in the environment: handlers reads its timer interval when imported.
    import kiln.operator.handlers  # noqa: F401  (registers the handlers)
    import kopf  # only to run: `kiln operator --help` and the flag errors above need no kopf

    kopf.configure(verbose=verbose)
    kopf.run(clusterwide=clusterwide, namespaces=namespaces, standalone=not config.ha,
             peering_name="kiln" if config.ha else None, liveness_endpoint=liveness or None)
