"""What a failed Job's pods said: the one read of a build Job's (engine or adapter) pods the reconcile makes."""

from __future__ import annotations

from typing import Any

from kiln.operator.kube import ApiError, KubeClient, api_path
from kiln.operator.retry import Failure
from kiln.operator.status import last_termination


async def job_failure(kube: KubeClient, namespace: str, job: dict[str, Any]) -> Failure:
    """The builder's termination message and exit code; empty when pods are gone or not readable (RBAC)."""
    selector = f"batch.kubernetes.io/job-name={job['metadata']['name']}"
    try:
        pods = await kube.list(api_path("v1", "pods", namespace), label_selector=selector)
    except ApiError:
        return Failure()
    return Failure(*last_termination(pods))
