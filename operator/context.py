"""What every step of a reconcile works with: the API client, the artifact store, the operator's settings and its
key pair (read, or made, on first need). One object per operator process (``handlers.configure``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.operator import keys
from kiln.operator.kube import KubeClient
from kiln.operator.settings import OperatorConfig

from kiln.artifacts import ArtifactStore


@dataclass
class Context:
    kube: KubeClient
    store: ArtifactStore
    config: OperatorConfig
    keys: keys.KeyPair | None = None  # read (or made) on first need: key_pair
    # Engine namespaces whose private-key copy (left by an older operator) this process already deleted.
    cleaned: set[str] = field(default_factory=set)


async def key_pair(ctx: Context) -> keys.KeyPair:
    """The operator's key pair: read once (keys.load_key_pair), then kept."""
    if ctx.keys is None:
        ctx.keys = await keys.load_key_pair(ctx.kube, ctx.config)
    return ctx.keys


async def remove_old_signing_copy(ctx: Context, namespace: str) -> None:
    """Delete a private-key copy an older operator left in the engine ``namespace``: once per namespace per process,
    before anything else of the reconcile (whatever step it plans: an invalid or building engine too)."""
    if namespace == ctx.config.jobs_namespace or namespace in ctx.cleaned:
        return
    await keys.remove_signing_copy(ctx.kube, namespace)
    ctx.cleaned.add(namespace)
