"""A grammar checker process (``kiln.engine.structured.pool``): lowers and checks grammars with llguidance,
so that a compile past its time limit can be stopped by killing this process.

Run by path, ``python -P grammar_check.py LIMITS_JSON [MEMORY_BYTES]`` (it imports llguidance only, not kiln
nor torch): reads one JSON-encoded grammar a line on stdin and answers each with one line, ``{"error": "..."}``
(empty when the grammar is valid). With ``MEMORY_BYTES`` its address space is capped there (``RLIMIT_AS``): a
grammar that would take more fails its allocation, and the process with it, instead of the host's memory.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    if len(sys.argv) > 2:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    import llguidance

    limits = llguidance.LLParserLimits(**json.loads(sys.argv[1]))
    for line in sys.stdin:
        try:
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(json.loads(line), None,
                                                                                  limits=limits)
            error = messages[0] if failed else ""
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException; report it, go on
            error = f"{type(exc).__name__}: {exc}" or "the grammar engine failed"
        sys.stdout.write(json.dumps({"error": error}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
