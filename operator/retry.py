"""Build attempts as pure functions: which failures are retried, when, and what ``status.build`` records.

A build Job that fails because the artifact store could not be read or written (the builder's exit code 3,
``kiln.builder.errors.EXIT_STORAGE``) is retried: the operator deletes the failed Job and creates the
version's Job again after ``build_retry_delay_seconds``, doubling the delay each time, at most
``build_retries`` times. Any other failure, and a storage error with no attempts left, is permanent: the
engine stays ``Failed`` and no build starts until the spec changes (``metadata.generation`` moves, which
any spec edit does; a new version is a new record altogether). A failed Job that expires (its
``ttlSecondsAfterFinished``) changes nothing: the record, not the Job, says the version failed.

``status.build`` (:class:`kiln.engine_status.BuildStatus`) is the record: the attempts of the wanted
version, the current attempt's Job uid, and either ``retryAt`` or ``failedGeneration`` once it failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kiln.operator.kube import iso, parse_time
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import JobState, failure_message, job_state

STORAGE_EXIT_CODE = 3  # kiln.builder.errors.EXIT_STORAGE (read only: the builder owns its exit codes)
STORAGE_ERROR = "StorageError"
BUILD, RETRY, WAIT = "build", "retry", "wait"  # build_step()


@dataclass(frozen=True)
class Failure:
    """What a failed build Job's pods said: the newest terminated container's message and exit code."""

    detail: str = ""
    exit_code: int | None = None


def record_of(status: dict[str, Any], version: str | None) -> dict[str, Any] | None:
    """``status.build`` when it is about ``version``."""
    record = status.get("build") or None
    return record if record and record.get("engineVersion") == version else None


def job_uid(job: dict[str, Any] | None) -> str | None:
    return ((job or {}).get("metadata") or {}).get("uid")


def due(record: dict[str, Any], now: datetime | None) -> bool:
    return bool(record.get("retryAt")) and now is not None and now >= parse_time(record["retryAt"])


def build_step(record: dict[str, Any] | None, job: dict[str, Any] | None, generation: int,
               now: datetime | None) -> str:
    """While the wanted version is not in the store: BUILD (get or create its Job), RETRY (delete the failed
    Job, create the next), or WAIT (nothing to do: a failure is recorded, permanent or not due yet)."""
    failed = job is not None and job_state(job).state == "failed"
    if record is not None and record.get("failedGeneration") is not None:
        if record["failedGeneration"] == generation:
            return WAIT  # permanent: never rebuilt unasked
        return RETRY if failed else BUILD  # the spec changed since: asked again
    if failed:
        mine = record is not None and record.get("jobUID") == job_uid(job)
        return RETRY if mine and due(record, now) else WAIT  # first sight: WAIT records it
    if job is None and record is not None and record.get("retryAt") and not due(record, now):
        return WAIT  # the failed Job expired before its retry was due
    return BUILD


def transient(state: JobState, failure: Failure) -> bool:
    """A storage error is worth another attempt; a deadline, a bad spec, a quality gate are not."""
    return failure.exit_code == STORAGE_EXIT_CODE and state.reason != "DeadlineExceeded"


def next_record(old: dict[str, Any] | None, version: str, job: dict[str, Any] | None, failure: Failure,
                generation: int, now: datetime, job_name: str, config: OperatorConfig) -> dict[str, Any] | None:
    """``status.build`` after this reconcile: ``job`` is the version's Job as the step left it."""
    record = old
    if record is not None and record.get("failedGeneration") not in (None, generation):
        record = None  # asked again: the attempts start over
    if job is None:
        return record
    if record is None or record.get("jobUID") != job_uid(job):
        record = {"engineVersion": version, "attempts": (record or {}).get("attempts", 0) + 1,
                  "jobUID": job_uid(job), "failure": None, "message": None, "retryAt": None,
                  "failedGeneration": None}
    state = job_state(job)
    if state.state != "failed" or record.get("failure"):
        return record
    message = failure_message(job_name, state, failure.detail)
    if transient(state, failure) and record["attempts"] <= config.build_retries:
        delay = config.build_retry_delay_seconds * 2 ** (record["attempts"] - 1)
        return {**record, "failure": STORAGE_ERROR, "message": message,
                "retryAt": iso(now + timedelta(seconds=delay))}
    reason = STORAGE_ERROR if transient(state, failure) else state.reason or "Failed"
    return {**record, "failure": reason, "message": message, "failedGeneration": generation}


def newly_failed(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    """Whether this reconcile recorded a failed attempt (counted once, in kiln_builds_failed_total)."""
    if not new or not new.get("failure"):
        return False
    return not old or old.get("jobUID") != new.get("jobUID") or not old.get("failure")
