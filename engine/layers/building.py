"""The float dtype a model's parameters are built in, for the thread building it (``create_model``).

A pool builds several engines at once, each on a thread of its own, while the loaded ones step: torch's default
dtype is the process's, so setting it for a build would hand every tensor another thread makes without a dtype
(a step's LoRA mask, a sampler's temperatures) the building engine's dtype for that while. The layers ask this
instead; outside a build it is torch's default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("kiln_build_dtype", default=None)


def build_dtype() -> torch.dtype:
    """The dtype of the model this thread is building (torch's default outside a build)."""
    return _DTYPE.get() or torch.get_default_dtype()


@contextlib.contextmanager
def building_in(dtype: torch.dtype) -> Iterator[None]:
    """Layers constructed inside (in this thread) hold ``dtype`` parameters where they are float."""
    token = _DTYPE.set(dtype)
    try:
        yield
    finally:
        _DTYPE.reset(token)
