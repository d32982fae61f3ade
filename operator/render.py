"""``kiln render -f MANIFEST``: the Kubernetes objects the operator would create for a manifest, as YAML.

For GitOps users who review diffs, and for tests: the same validation
(:func:`kiln.operator.validation.validate_spec`) and the same renderers the operator
runs (build Job, Deployment or LeaderWorkerSet, Service, PodDisruptionBudget,
NetworkPolicy), so what is printed is what the operator applies, except for what only
a cluster knows: ownerReferences (the LLMEngine's uid), the ``rendered-hash``
annotation, the build the operator pinned (``$KILN_EXPECT_ARTIFACT``, known once the
artifact is published), and the Secrets the operator writes (the signing and verify
key copies, a multi-node engine's group token), which pods name but which hold values
only the operator makes, and the rank label value derived from that token (``RENDERED_RANK_GROUP``).
The build Job is rendered in the namespace the operator runs builds in (``KILN_BUILD_NAMESPACE``, else
``KILN_OPERATOR_NAMESPACE``). The operator's settings come from the same
``KILN_*`` variables the chart sets (:class:`kiln.operator.settings.OperatorConfig`);
``--store`` overrides ``KILN_STORE_URI`` (or ``KILN_STORE``: ``kiln.artifacts.store_from_env``).

An ``LLMEnginePool`` manifest renders as the operator's :func:`kiln.operator.pools.render_pool`: its engine-list
ConfigMap (empty: which engines join is known only in the cluster), Deployment and Service. An LLMEngine with
``spec.serving.pool`` renders its build Job alone, under a comment saying the pool's pods serve it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import click
import yaml
from kiln.operator.jobs import build_job
from kiln.operator.naming import MAX_NAME, pool_engines_name
from kiln.operator.network import build_network_policy
from kiln.operator.pools import render_pool
from kiln.operator.scale_out import extra_objects
from kiln.operator.settings import ConfigError, OperatorConfig
from kiln.operator.validation import InvalidSpec, validate_name, validate_namespace, validate_spec
from kiln.operator.workloads import build_pdb, build_service, build_workload

from kiln.api import KIND, LLMEngine
from kiln.api_base import DNS1123_LABEL
from kiln.cache_cli import env_store
from kiln.envelope import engine_version
from kiln.manifest import ManifestError, load_documents
from kiln.pool_api import POOL_KIND, LLMEnginePool

EXIT_INVALID_SPEC = 2
PLACEHOLDER_STORE = "s3://kiln-engines"
# A multi-node engine's rank label value is an HMAC of its group token, which only the operator makes: rendered
# as this placeholder, the same in the pods and the NetworkPolicy.
RENDERED_RANK_GROUP = "set-by-the-operator"


def artifact_uri(config: OperatorConfig, version: str) -> str:
    return f"{config.store_uri.rstrip('/')}/engines/{version}"


def render_objects(engine: LLMEngine, config: OperatorConfig, namespace: str | None = None) -> list[dict[str, Any]]:
    """Build Job, serving workload, Service, PDB (from 2 replicas), NetworkPolicy and the scale-out objects (KEDA
    ScaledObject / HTTPScaledObject or HPA, InferencePool) when the spec asks; :class:`InvalidSpec` as the
    operator. An engine of a pool (``spec.serving.pool``) gets its build Job alone: the pool's pods serve it."""
    name = engine.metadata.name
    ns = namespace or engine.metadata.namespace or "default"
    validate_name(name)
    if len(ns) > MAX_NAME or not re.fullmatch(DNS1123_LABEL, ns):
        raise InvalidSpec(f"namespace: {ns!r} is not a namespace name (a DNS-1123 label: lowercase letters, digits "
                          "and '-', at most 63 characters); fix -n or metadata.namespace")
    spec = validate_spec(engine.spec.to_k8s(), config)
    validate_namespace(spec, ns, config)  # a pvc:// source outside the jobs namespace: refused as the operator does
    version = engine_version(spec)
    objects = [build_job(spec, name, ns, version, config)]
    if spec.serving.pool is None:
        objects += [build_workload(spec, name, ns, version, artifact_uri(config, version), config,
                                   rank_group=RENDERED_RANK_GROUP),
                    build_service(spec, name, ns)]
        if (pdb := build_pdb(spec, name, ns)) is not None:
            objects.append(pdb)
        if config.network_policy:
            objects.append(build_network_policy(spec, name, ns, rank_group=RENDERED_RANK_GROUP))
        objects += extra_objects(spec, name, ns, version, config)
    # Plain data (no shared sub-objects, so the YAML has no anchors).
    return [json.loads(json.dumps(obj)) for obj in objects]


def pool_note(engine: LLMEngine) -> str:
    """The comment ``kiln render`` prints above an engine of a pool's objects ('' for any other engine)."""
    pool = engine.spec.serving.pool
    if pool is None:
        return ""
    return (f"# spec.serving.pool: {pool}: no Deployment, Service, PodDisruptionBudget or NetworkPolicy of its own;\n"
            f"# once built, the engine is listed in LLMEnginePool {pool}'s engine list (ConfigMap "
            f"{pool_engines_name(pool)})\n# and served by the pool's pods (kiln render -f the pool's manifest)\n")


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(obj, sort_keys=False, width=120) for obj in objects)


def manifest_kind(text: str) -> str:
    """What a manifest's text holds, for its error's header: LLMEnginePool, LLMEngine (also for anything else:
    load_manifest says what is wrong with it), or both."""
    try:
        kinds = {doc.get("kind") for doc in yaml.safe_load_all(text) if isinstance(doc, dict)}
    except yaml.YAMLError:
        return KIND
    return {frozenset([POOL_KIND]): POOL_KIND, frozenset([KIND, POOL_KIND]): f"{POOL_KIND} and {KIND}"}.get(
        frozenset(kinds & {KIND, POOL_KIND}), KIND)


def _refuse(lines: list[str], header: str) -> None:
    click.echo(f"error: {header}:", err=True)
    for line in lines:
        click.echo(f"  {line}", err=True)
    sys.exit(EXIT_INVALID_SPEC)


def render_manifest(manifest: LLMEngine | LLMEnginePool, config: OperatorConfig, namespace: str | None) -> str:
    """The YAML of one LLMEngine's or LLMEnginePool's objects; :class:`InvalidSpec` as the operator."""
    if isinstance(manifest, LLMEnginePool):
        name = manifest.metadata.name
        return (f"# the engine list is empty here: the operator lists each LLMEngine with spec.serving.pool: "
                f"{name} once it is built\n"
                + to_yaml(render_pool(manifest, name, namespace or manifest.metadata.namespace or "default", config)))
    return pool_note(manifest) + to_yaml(render_objects(manifest, config, namespace))


def _render_text(text: str, where: str, config: OperatorConfig, namespace: str | None) -> str:
    """The YAML ``kiln render`` prints for a manifest's text: every LLMEngine and LLMEnginePool it holds (a GitOps
    file may hold a pool and its members), in order; exits 2 naming each problem when one is refused."""
    try:
        manifests = load_documents(text)
    except ManifestError as exc:
        _refuse(exc.problems, f"invalid {manifest_kind(text)} manifest {where}")
    parts, refused = [], []
    for manifest in manifests:
        try:
            parts.append(render_manifest(manifest, config, namespace))
        except InvalidSpec as exc:
            who = f"{manifest.kind} {manifest.metadata.name}: " if len(manifests) > 1 else ""
            refused.append(f"{who}{exc}")
    if refused:
        _refuse(refused, f"the operator would refuse {where}")
    return "---\n".join(parts)


@click.command()
@click.option("-f", "--file", "manifest", required=True, metavar="MANIFEST",
              help="LLMEngine or LLMEnginePool manifest (YAML or JSON); '-' reads stdin.")
@click.option("--store", default=env_store(), metavar="URI",
              help=f"Artifact store the operator uses (default: $KILN_STORE_URI or $KILN_STORE, else "
                   f"{PLACEHOLDER_STORE}).")
@click.option("-n", "--namespace", default=None, help="Namespace (default: the manifest's, else 'default').")
def render(manifest: str, store: str | None, namespace: str | None) -> None:
    """Print the Kubernetes objects the operator would create for a manifest, as YAML.

    An LLMEngine: build Job, Deployment (or LeaderWorkerSet when a replica spans nodes), Service,
    PodDisruptionBudget, NetworkPolicy, and with spec.serving.autoscaling / routing the KEDA ScaledObject (or HPA) and
    InferencePool; with spec.serving.pool, the build Job alone (the pool's pods serve it). An LLMEnginePool: its
    engine-list ConfigMap (empty here: the operator lists the engines that join), Deployment and Service. A file of
    several (a pool and its members) prints each one's, in order. From the operator's own renderers and settings
    ($KILN_*).
    Exit status 2 (one line per problem on stderr) when the operator would refuse the manifest.
    """
    where = "stdin" if manifest == "-" else manifest
    if manifest == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(manifest).read_text()
        except OSError as exc:
            _refuse([f"{manifest}: cannot read the file ({exc.strerror}); check the path"], f"cannot read {where}")
    try:
        config = OperatorConfig.from_env()
    except ConfigError as exc:
        raise click.ClickException(f"operator settings: {exc}") from None
    config = dataclasses.replace(config, store_uri=store or config.store_uri or PLACEHOLDER_STORE)
    click.echo(_render_text(text, where, config, namespace), nl=False)
