"""How an engine setting is declared: a dataclass field with what the layers above read of it.

``EngineConfig``'s fields (kiln.engine.config) are the one list of engine settings; each is declared with
:func:`setting`, whose metadata says what the setting is (``help``), which values it takes (``choices``,
``min``/``max``), whether ``kiln serve`` offers it as a flag and whether ``/version`` reports it. The
values it takes are also its validation rule (:func:`field_rules`), so a range is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import MISSING, field, fields
from typing import Any


def setting(default: Any = MISSING, *, help: str, flag: bool | str = False, reported: bool = False,
            choices: tuple | None = None, min: float | None = None, max: float | None = None,
            min_open: bool = False, envvar: str | None = None, json: bool = False, repr: bool = True,
            default_factory: Any = MISSING) -> Any:
    """A field of EngineConfig with what the layers above read of it. ``flag``: offered by ``kiln serve``
    (True: ``--name-with-dashes``; a string: that flag); ``reported``: listed in ``/version``;
    ``choices``/``min``/``max``/``min_open``: the values it takes (validated here, and the serve flag's
    type); ``envvar``: the serve flag's environment variable; ``json``: the flag takes a JSON object."""
    meta = {"help": help, "flag": flag, "reported": reported, "choices": choices, "min": min, "max": max,
            "min_open": min_open, "envvar": envvar, "json": json}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, repr=repr, metadata=meta)
    return field(default=default, repr=repr, metadata=meta)


def _range_rule(meta: dict[str, Any]) -> str:
    low, high = meta["min"], meta["max"]
    if high is None:
        return f"must be {'>' if meta['min_open'] else '>='} {low:g}"
    return f"must be in {'(' if meta['min_open'] else '['}{low:g}, {high:g}]"


def field_rules(config: Any) -> Iterator[tuple[str, Callable[[], bool], str]]:
    """Each field's own rule, from its metadata: the values it takes (a dataclass of ``setting`` fields)."""
    for f in fields(config):
        meta, value = f.metadata, getattr(config, f.name)
        if meta.get("choices") is not None:
            names = ", ".join(str(c) for c in meta["choices"])
            yield f.name, (lambda v=value, c=meta["choices"]: v in c), f"must be one of {names}"
        elif meta.get("min") is not None and value is not None:
            low, high, is_open = meta["min"], meta["max"], meta["min_open"]
            yield f.name, (lambda v=value, lo=low, hi=high, op=is_open:
                           (v > lo if op else v >= lo) and (hi is None or v <= hi)), _range_rule(meta)
