"""Grammar compiles run in the compiler's own bounded pool and stop at the time limit (issue 31): a schema
whose JSON Schema lowering multiplies out (allOf over anyOf: no llguidance limit stops that phase) answers
an error at the limit and leaves nothing running; past the pool's bound a compile is refused as busy."""

from __future__ import annotations

import os
import time
from concurrent.futures import wait
from pathlib import Path

import pytest
from kiln.engine.errors import RequestError
from kiln.engine.structured.params import StructuredOutputsParams as Constraint

LIMIT_S = 0.5


def slow_schema(n: int = 0) -> dict:
    """~10 s to lower on a shared 2-core machine (8**5 allOf branches, each a string pattern intersection);
    ``n`` makes distinct cache keys."""
    return {"allOf": [{"anyOf": [{"type": "string", "pattern": f"^[a-z]*{chr(97 + i)}[a-z]*$", "maxLength": 50 + j + n}
                                 for i in range(8)]} for j in range(5)]}


@pytest.fixture(scope="module")
def tokenizer(toy_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model("llama-tiny"))


@pytest.fixture
def make_compiler(tokenizer, monkeypatch):
    """``make_compiler(threads, queue)``: a compiler with a LIMIT_S time limit, closed at the end."""
    from kiln.engine.structured.compiler import GrammarCompiler

    made = []

    def make(threads: int = 1, queue: int = 4) -> GrammarCompiler:
        monkeypatch.setenv("KILN_GRAMMAR_COMPILE_TIMEOUT_S", str(LIMIT_S))
        monkeypatch.setenv("KILN_GRAMMAR_COMPILE_THREADS", str(threads))
        monkeypatch.setenv("KILN_GRAMMAR_COMPILE_QUEUE", str(queue))
        compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id or 2])
        compiler.warm_up()
        made.append(compiler)
        return compiler

    yield make
    for compiler in made:
        getattr(compiler, "close", lambda: None)()


def cpu_seconds() -> float:
    """CPU time of this process and of its child processes still alive (Linux /proc)."""
    total = time.process_time()
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def assert_nothing_compiles(window: float = 1.0) -> None:
    before = cpu_seconds()
    time.sleep(window)
    assert cpu_seconds() - before < 0.3 * window, "a compile is still running after its answer"


def test_a_slow_compile_stops_at_the_limit_and_leaves_nothing_running(make_compiler):
    compiler = make_compiler()
    started = time.monotonic()
    with pytest.raises(RequestError, match=r"did not compile within 0\.5s") as info:
        compiler.compile(Constraint(json=slow_schema(), param="tools"))
    assert time.monotonic() - started < LIMIT_S + 1.5
    assert info.value.param == "tools"
    assert_nothing_compiles()
    # The pool goes on: a cheap constraint compiles, once (the cache answers the same key again).
    first = compiler.compile(Constraint(regex="[0-9]+"))
    assert compiler.compile(Constraint(regex="[0-9]+")) is first
    assert first.new_state().validate([]) == 0


def test_past_the_pools_bound_a_compile_is_refused_as_busy(make_compiler):
    from kiln.engine.structured.compiler import GrammarBusy

    compiler = make_compiler(threads=1, queue=1)
    cheap = compiler.compile(Constraint(regex="[a-z]+"))
    running = [compiler.submit(Constraint(json=slow_schema(n))) for n in range(2)]  # one compiles, one waits
    with pytest.raises(GrammarBusy, match="busy") as info:
        compiler.submit(Constraint(json=slow_schema(2), param="response_format.json_schema"))
    assert info.value.param == "response_format.json_schema"
    assert compiler.compile(Constraint(regex="[a-z]+")) is cheap  # a cached grammar needs no slot
    compiler.close()
    wait(running, timeout=LIMIT_S * 4)
    assert all(f.done() for f in running)
    assert_nothing_compiles()


def test_the_checker_runs_under_a_memory_limit(make_compiler):
    """A grammar checker's address space is capped (issue 38, low): a lowering that multiplies out fails its
    allocations in the checker, not the host's memory."""
    from kiln.engine.structured.pool import CHECKER_MEMORY_BYTES

    compiler = make_compiler()
    assert compiler.compile(Constraint(regex="[0-9]+")).new_state().validate([]) == 0
    me, limits = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me and "grammar_check" in \
                    (stat.parent / "cmdline").read_text():
                limits.append((stat.parent / "limits").read_text())
        except OSError:
            continue
    assert limits and all(f"Max address space         {CHECKER_MEMORY_BYTES}" in text for text in limits), limits
