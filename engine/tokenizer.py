"""The model's tokenizer, loaded without importing transformers' modeling stack where it can."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.engine.light_tokenizer import enabled as light_enabled
from kiln.engine.light_tokenizer import load_light, record_key, save_record

# Tokenizers of engines that were shut down, kept for the next engine of the same model directory (a pool's
# reload): parsing tokenizer.json is Python that holds the GIL beside the weights' load and the other engines'
# steps, 0.35 s of SmolLM2's 0.7 s reload measured. Each is handed to one engine at a time (taken off the shelf,
# put back at shutdown), so no two engines share one. At most SHELF_SIZE, the oldest dropped first: about 11 MiB
# each for SmolLM2's 49k-token vocabulary, within the server's margin (memory_budget.SERVER_MARGIN_BYTES).
SHELF_SIZE = 4
_SHELF: OrderedDict[tuple, Any] = OrderedDict()
_SHELF_LOCK = threading.Lock()


def tokenizer_config_hint(model_dir: str) -> Any | None:
    """What ``AutoTokenizer`` reads of the model's config, from config.json as plain data, or None to let
    it load the config class itself.

    ``AutoTokenizer.from_pretrained`` loads the model's config class to pick a tokenizer class, and for
    Llama-family models that imports transformers' modeling stack (model loading, accelerate, torch's
    compiler, sympy): measured on the bench model, 167 MiB of resident memory and about 1.4 s of load
    time that serving never uses. When tokenizer_config.json names its class (and has no remote code),
    AutoTokenizer decides from the config's ``model_type``, ``_name_or_path``, ``model_name`` and
    ``tokenizer_class`` only: handing it those as data picks the same class without the import.
    """
    import json
    import types
    from pathlib import Path

    root = Path(model_dir)
    try:
        cfg = json.loads((root / "config.json").read_text())
        tok_cfg = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or not isinstance(tok_cfg, dict) or not isinstance(cfg.get("model_type"), str):
        return None
    if not tok_cfg.get("tokenizer_class") or "auto_map" in tok_cfg or "auto_map" in cfg:
        return None
    fields = {"model_type": cfg["model_type"], "_name_or_path": str(model_dir),
              "tokenizer_class": cfg.get("tokenizer_class")}
    if "model_name" in cfg:
        fields["model_name"] = cfg["model_name"]
    return types.SimpleNamespace(**fields)


# transformers' lazy top-level module is not safe to import from two threads at once: the second import of a pool's
# two concurrent engine loads failed with "cannot import name 'AutoTokenizer' from 'transformers'". One at a time.
_IMPORT_LOCK = threading.Lock()


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer: from its record when this host has one for these files (no transformers import,
    :mod:`kiln.engine.light_tokenizer`), else through transformers, then recorded for the next load."""
    key = record_key(model_dir) if light_enabled() else None
    light = load_light(model_dir, key)
    if light is not None:
        return light
    tokenizer = load_hf_tokenizer(model_dir)
    if key is not None:
        save_record(key, tokenizer)
    return tokenizer


def load_hf_tokenizer(model_dir: str) -> Any:
    """transformers' ``AutoTokenizer`` for the directory (its config given as data where it can be)."""
    with _IMPORT_LOCK:
        from transformers import AutoTokenizer

    hint = tokenizer_config_hint(model_dir)
    extra = {} if hint is None else {"config": hint}
    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False, **extra)


def _shelf_key(model_dir: str) -> tuple | None:
    """The directory and every file in it by name, size and modification time: a file changed, added or removed
    since the tokenizer was shelved is a different key (None: the directory cannot be read)."""
    try:
        root = Path(model_dir).resolve()
        stats = [(e.name, e.stat()) for e in os.scandir(root) if e.is_file()]
        files = sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats)
    except OSError:
        return None
    return (str(root), tuple(files))


def shelve(model_dir: str, tokenizer: Any) -> None:
    """Keep the tokenizer of an engine that was shut down for the next engine of ``model_dir``."""
    key = _shelf_key(model_dir)
    if key is None or tokenizer is None:
        return
    with _SHELF_LOCK:
        _SHELF[key] = tokenizer
        _SHELF.move_to_end(key)
        while len(_SHELF) > SHELF_SIZE:
            _SHELF.popitem(last=False)


def _take_shelved(model_dir: str) -> Any | None:
    key = _shelf_key(model_dir)
    with _SHELF_LOCK:
        return _SHELF.pop(key, None) if key is not None else None


def load_tokenizer_beside(model_dir: str) -> Future:
    """:func:`load_tokenizer` on a thread of its own: 0.1-0.2 s from a record, else 1-1.5 s, mostly transformers'
    import, Python that runs beside a model load spending its time in C without the GIL (the engine takes the
    result after). A tokenizer put by :func:`shelve` on the shelf for this directory is taken instead, loaded
    already."""
    shelved = _take_shelved(model_dir)
    if shelved is not None:
        done: Future = Future()
        done.set_result(shelved)
        return done
    pool = ThreadPoolExecutor(1, "kiln-tokenizer")
    try:
        return pool.submit(load_tokenizer, model_dir)
    finally:
        pool.shutdown(wait=False)  # the load runs on; the thread ends with it
