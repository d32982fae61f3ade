"""An LLMEngine of an engine pool (``spec.serving.pool``, docs/pools.md), as pure functions: how its pool lists it.

An engine of a pool is built as any other; at the serve step it renders no workload, Service, PDB or
NetworkPolicy of its own: the pool's reconcile lists it in the pool's engine list once it is built, and the
pool's pods load it on demand. The engine's reconcile reads the LLMEnginePool object once (``reconcile.observe``);
:func:`pool_view` turns it into a :class:`PoolView`, from which its status follows
(``kiln.operator.status``: Ready once the pool lists its version and the pool is Ready; Failed when the pool
refuses it; Deploying while there is no such pool or the pool has not listed it yet).

An engine that served alone before it joined keeps serving from its own Deployment until its pool serves it
(:attr:`PoolView.serves`): then that Deployment is scaled to zero (the chart grants Deployments no delete; leaving
the pool renders it again) and a LeaderWorkerSet deleted (``kiln.operator.decide.retirements``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kiln.operator.kube import parse_time
from kiln.operator.settings import OperatorConfig

from kiln.api import LLMEngineSpec

ENGINE_TOO_BIG, POOL_MISMATCH = "EngineTooBigForPool", "PoolMismatch"  # the Ready condition's reason when Refused
SCALED_TO_ZERO = "ScaledToZero"  # Ready False at zero pods: an engine's (status), a pool's (pool_decide), its members'
# How long after its entry is first listed the pool's pods have surely loaded the engine list, unless the operator
# is told otherwise (OperatorConfig.pool_list_sync_seconds): the kubelet syncs a mounted ConfigMap within about a
# minute, the pods read the file every 2 s.
LIST_SYNC = timedelta(seconds=OperatorConfig.pool_list_sync_seconds)


@dataclass(frozen=True)
class PoolView:
    """The LLMEnginePool of ``spec.serving.pool`` as this engine sees it."""

    name: str  # spec.serving.pool
    namespace: str  # the engine's, where the pool must be
    found: bool = False  # an LLMEnginePool of that name exists there
    state: str | None = None  # its status.engines entry for this engine: Building | Listed | Refused; None: no entry
    version: str | None = None  # the engine version that entry is for
    message: str | None = None  # the entry's message: why it is refused
    refusal: str | None = None  # Refused: ENGINE_TOO_BIG (its memory) or POOL_MISMATCH (anything else: refusal)
    ready: bool = False  # the pool's phase is Ready: its pods serve
    failed: bool = False  # the pool's phase is Failed (its spec, its budget): it lists nothing new until fixed
    pool_message: str = ""  # the pool's Ready condition message (why it does not serve yet)
    pool_reason: str = ""  # its reason (ScaledToZero: KEDA took the pool to zero; a request wakes it)
    endpoint: str | None = None  # the pool's status.endpoint (its Service)
    listed_since: datetime | None = None  # the entry's listedSince: when its version was first listed
    now: datetime | None = None  # when the engine's reconcile read it (None: the list counts as synced)
    left_out: tuple[tuple[str, str], ...] = ()  # the entry's adaptersLeftOut: (adapter, why) the pods are not given
    list_sync: timedelta = LIST_SYNC  # how long after listedSince the pods have surely loaded the list

    @property
    def synced(self) -> bool:
        """The pods have had the time to load the engine list that lists the entry (:attr:`list_sync`)."""
        return self.listed_since is None or self.now is None or self.now >= self.listed_since + self.list_sync

    @property
    def serves(self) -> bool:
        """The pool's pods serve this engine (the version of its entry): Listed, by a Ready pool, for long enough
        that the kubelet has synced the list into its pods (until then its own pods, if any, keep serving)."""
        return self.state == "Listed" and self.ready and self.version is not None and self.synced

    def serving(self, version: str) -> tuple[bool, str, str]:
        """(Ready, reason, message) of a member the pool serves (:attr:`serves`): Serving, or, while the pool is
        scaled to zero, not Ready with the pool's reason and how a request wakes it (as an engine's at zero)."""
        if self.pool_reason == SCALED_TO_ZERO:
            return False, SCALED_TO_ZERO, f"LLMEnginePool {self.name} serves {version}; it is {self.pool_message}"
        return True, "Serving", f"LLMEnginePool {self.name} serves {version} at {self.endpoint}"

    def lists(self, version: str | None) -> str | None:
        """The entry's state when it is for ``version`` (or names none); None when it is another version's."""
        return self.state if self.version in (None, version) else None

    def status(self) -> dict[str, Any]:
        """``status.pool`` (kiln.engine_status.PoolMembership)."""
        return {"name": self.name, "state": self.state, "message": self.message}

    def adapter_statuses(self, adapters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``status.adapters`` with what the pool says of each: an adapter it leaves out keeps its phase (it is
        built) and gets the pool's reason as its message."""
        why = dict(self.left_out)
        return [{**a, "message": f"built, but the pool {self.name!r} does not serve it: {why[a['name']]}"[:4096]}
                if a.get("name") in why and a.get("phase") == "Ready" else a for a in adapters]


def pool_view(spec: LLMEngineSpec, name: str, namespace: str, pool: dict[str, Any] | None,
              now: datetime | None = None, list_sync: timedelta = LIST_SYNC) -> PoolView | None:
    """How the LLMEnginePool ``pool`` (as read at ``now``; None: there is none) lists the engine ``name``, its pods
    having loaded a list ``list_sync`` after it first listed the engine; None when the engine is not in a pool."""
    wanted = spec.serving.pool
    if wanted is None:
        return None
    if pool is None:
        return PoolView(wanted, namespace)
    status = pool.get("status") or {}
    entry = next((e for e in status.get("engines") or [] if e.get("name") == name), {})
    ready = ready_condition(status)
    state = entry.get("state")
    return PoolView(wanted, namespace, found=True, state=state, version=entry.get("engineVersion"),
                    message=entry.get("message"), refusal=refusal(entry) if state == "Refused" else None,
                    ready=status.get("phase") == "Ready", failed=status.get("phase") == "Failed",
                    pool_message=ready.get("message") or "", pool_reason=ready.get("reason") or "",
                    endpoint=status.get("endpoint"),
                    listed_since=_time(entry.get("listedSince")), now=now, list_sync=list_sync,
                    left_out=tuple((str(a.get("name")), str(a.get("message") or "")) for a in
                                   entry.get("adaptersLeftOut") or [] if isinstance(a, dict)))


def ready_condition(status: dict[str, Any]) -> dict[str, Any]:
    """A pool's Ready condition as its status holds it ({} when it has none yet)."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})


def _time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp as written (``...Z``); None when absent or not one."""
    try:
        return parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def refusal(entry: dict[str, Any]) -> str:
    """Why a pool refuses an engine, as a reason: what it counts (the entry's memoryBytes, measured once it is
    built) exceeds the pool's budget (ENGINE_TOO_BIG); else it does not match the pool's pods (its spec.gpu, its
    shape) or its artifact cannot be listed (POOL_MISMATCH); the pool's message says which."""
    return ENGINE_TOO_BIG if entry.get("memoryBytes") is not None else POOL_MISMATCH


def not_found_message(view: PoolView) -> str:
    return (f"spec.serving.pool: there is no LLMEnginePool {view.name} in namespace {view.namespace}; create it "
            f"(docs/pools.md), or remove spec.serving.pool to serve this engine from its own pods")


def listing_message(view: PoolView, version: str | None) -> str:
    """Why a found pool does not serve ``version`` of the engine yet: a Failed pool's own reason (no waiting fixes
    it), else what it lists."""
    if view.failed:
        return f"LLMEnginePool {view.name} is Failed: {view.pool_message or 'see its Ready condition'}"
    if view.lists(version) == "Listed" and view.ready and not view.synced:
        return (f"LLMEnginePool {view.name} lists {version} since {view.listed_since:%H:%M:%S}; its pods load the "
                f"engine list within {view.list_sync.total_seconds():g} s (the kubelet syncs its ConfigMap)")
    if view.lists(version) == "Listed":
        why = f": {view.pool_message}" if view.pool_message else ""
        return f"LLMEnginePool {view.name} lists {version}, but its pods do not serve yet{why}"
    now = f" (it lists {view.version}, {view.state})" if view.version not in (None, version) else ""
    if view.lists(version) == "Building" and not now:
        now = " (it waits for the build to be pinned)"
    return f"waiting for LLMEnginePool {view.name} to list {version}{now}"
