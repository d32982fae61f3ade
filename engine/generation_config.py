"""What a model's ``generation_config.json`` gives the engine: its EOS ids, and the sampling defaults a request
that does not say its own takes (vLLM's ``--generation-config``).

``EngineConfig.generation_config`` says where the defaults come from: ``auto`` (the model's own file, vLLM's
default), ``vllm`` (none: OpenAI's neutral values), or a folder holding a ``generation_config.json``. The keys read
are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (a
request's default ``max_tokens``); a value the engine cannot take is left out, with a warning naming it.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("kiln.engine")

FILE = "generation_config.json"
SOURCES = ("auto", "vllm")  # besides a folder with a generation_config.json
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _read(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): no sampling defaults or EOS ids from it", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_ids(config: Any, tokenizer: Any = None) -> list[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, deduplicated."""
    ids: list[int] = []
    for value in (config.hf_config.get("eos_token_id"), _read(config.model).get("eos_token_id"),
                  getattr(tokenizer, "eos_token_id", None)):
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, int) and not isinstance(x, bool) and x not in ids:
                ids.append(x)
    return ids


def sampling_defaults(config: Any) -> dict[str, Any]:
    """The defaults a request without its own takes, by ``SamplingParams`` name (``max_tokens`` included)."""
    source = config.generation_config
    if source == "vllm":
        return {}
    return dict(_defaults(config.model if source == "auto" else source))


@functools.lru_cache(maxsize=64)
def _defaults(folder: str) -> tuple[tuple[str, Any], ...]:
    from kiln.engine.sampling_params import SamplingParams  # deferred: torch-free until asked

    path = Path(folder) / FILE
    data = _read(folder)
    found = {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
    if isinstance(data.get("max_new_tokens"), int) and data["max_new_tokens"] > 0:
        found["max_tokens"] = data["max_new_tokens"]
    kept = {}
    for key, value in found.items():
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as exc:
            log.warning("%s: %s %r is not a value kiln samples with (%s); requests keep their own default",
                        path, key, value, exc)
            continue
        kept[key] = value
    if kept:
        log.info("default sampling parameters from %s, for requests that do not set them: %s "
                 "(--generation-config vllm for none)", path, ", ".join(f"{k}={v}" for k, v in kept.items()))
    return tuple(kept.items())
