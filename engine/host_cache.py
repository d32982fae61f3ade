"""Where the engine keeps what it works out on a host for the next load: ``$XDG_CACHE_HOME/kiln/<name>``."""

from __future__ import annotations

import os
from pathlib import Path


def host_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/kiln/<name>`` (``~/.cache`` without it); not created here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / name
