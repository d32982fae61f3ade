"""Where grammars compile: a dedicated, bounded pool, each compile stopped at the time limit (issue 31).

llguidance bounds most of a compile itself (``LLParserLimits``: lexer fuel, lexer states, grammar symbols;
an over-limit grammar is reported as an error, not run on), but not the lowering of a JSON Schema into a
grammar: ``allOf`` over ``anyOf`` multiplies out (5 ``allOf`` of 8 string patterns take ~10 s on a shared
core, whatever the limits), and a compile cannot be cancelled in-process. So each compile runs in two steps:

1. a checker process (``grammar_check.py``, one per pool thread, started once) lowers and checks the
   grammar under the same limits; past the time limit it is killed (and restarted for the next compile);
2. only a grammar that passed within the limit is compiled in this process (about as long again, plus
   the tokenizer-dependent work llguidance's fuel bounds).

The pool has ``threads`` threads and room for ``queue`` compiles waiting: past that, or for a compile
that waited the whole time limit for a thread, :class:`GrammarBusy` (the server's 429). Nothing else runs
on it, and it runs nothing else: constraints already compiled (the cache) never reach it.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.engine.errors import RequestError

_SCRIPT = Path(__file__).with_name("grammar_check.py")
_PROBE = 'start: "a"'
_START_TIMEOUT_S = 60.0  # a checker's first answer: Python and llguidance imported, on a busy machine
CHECKER_MEMORY_BYTES = 2 << 30  # a checker's address space: Python and llguidance need ~0.3 GiB of it


class GrammarBusy(RequestError):
    """Every compile thread is busy and the queue is full (or was, for the whole time limit)."""

    def __init__(self, param: str, message: str, retry_after_s: int) -> None:
        super().__init__(param, message, code="grammar_compiler_busy")
        self.retry_after_s = retry_after_s


class _Checker:
    """One checker process, serving one compile at a time."""

    def __init__(self, limits: dict[str, Any]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-P", str(_SCRIPT), json.dumps(limits), str(CHECKER_MEMORY_BYTES)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def check(self, grammar: str, timeout: float) -> str:
        """llguidance's error for ``grammar`` ('' when valid); TimeoutError past ``timeout``, OSError if the
        process is gone."""
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(grammar).encode() + b"\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], timeout)  # one answer outstanding: nothing is buffered
        if not ready:
            raise TimeoutError
        line = stdout.readline()
        if not line:
            raise OSError("the grammar checker exited")
        return json.loads(line)["error"]

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:
                pass


class CompilePool:
    def __init__(self, threads: int, queue_size: int, timeout_s: float, limits: dict[str, Any]) -> None:
        self.threads, self.queue_size, self.timeout_s = threads, queue_size, timeout_s
        self._limits = limits
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kiln-grammar")
        self._slots = threading.Semaphore(threads + queue_size)
        self._idle: queue.SimpleQueue[_Checker | None] = queue.SimpleQueue()  # one per thread: never waits
        for _ in range(threads):
            self._idle.put(None)
        self._lock = threading.Lock()
        self._checkers: set[_Checker] = set()
        self._closed = False

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.timeout_s))

    def warm_up(self) -> None:
        """Start every checker process now, not on the first compiles."""
        taken = [self._idle.get() for _ in range(self.threads)]
        for checker in taken:
            if checker is None:
                with contextlib.suppress(OSError):  # started again by the first compile that needs it
                    checker = self._start()
            self._idle.put(checker)

    def submit(self, param: str, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on a pool thread; GrammarBusy (naming ``param``) when the pool is full."""
        if self._closed:
            raise self._busy(param, "shutting down")
        if not self._slots.acquire(blocking=False):
            raise self._busy(param, f"{self.threads} compiling and {self.queue_size} waiting")
        submitted = time.monotonic()
        try:
            future = self._executor.submit(self._run, param, submitted, fn, *args)
        except RuntimeError:  # shut down meanwhile
            self._slots.release()
            raise self._busy(param, "shutting down") from None
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def _run(self, param: str, submitted: float, fn: Callable[..., Any], *args: Any) -> Any:
        if time.monotonic() - submitted > self.timeout_s:
            raise self._busy(param, f"waited {self.timeout_s:g}s for a compile thread")
        return fn(*args)

    def _busy(self, param: str, why: str) -> GrammarBusy:
        return GrammarBusy(param, f"The grammar compiler is busy ({why}): {param} was not compiled; retry after "
                                  f"{self.retry_after_s}s", self.retry_after_s)

    def check(self, param: str, grammar: str) -> str:
        """Lower and check ``grammar`` in a checker process, stopped at the time limit: llguidance's error or
        ''. A RequestError naming ``param`` when it takes longer or the checker dies. Pool threads only."""
        checker = self._idle.get()
        try:
            try:
                if checker is None:
                    checker = self._start()
                return checker.check(grammar, self.timeout_s)
            except (TimeoutError, OSError, ValueError) as exc:
                if checker is not None:
                    self._discard(checker)
                checker = None
                if isinstance(exc, TimeoutError):
                    raise RequestError(param, f"{param} did not compile within {self.timeout_s:g}s "
                                              f"(this server's limit): simplify it") from None
                raise RequestError(param, f"{param} could not be compiled: the grammar engine failed on it"
                                   + (" (the server is shutting down)" if self._closed else "")) from None
        finally:
            self._idle.put(checker)

    def _start(self) -> _Checker:
        with self._lock:
            if self._closed:
                raise OSError("the grammar compiler is closed")
            checker = _Checker(self._limits)
            self._checkers.add(checker)
        try:
            checker.check(_PROBE, _START_TIMEOUT_S)
        except Exception as exc:
            self._discard(checker)
            raise OSError(f"the grammar checker did not start: {exc!r}") from None
        return checker

    def _discard(self, checker: _Checker) -> None:
        with self._lock:
            self._checkers.discard(checker)
        checker.kill()

    def close(self) -> None:
        """Refuse new compiles, drop the waiting ones, stop the running ones (their checkers are killed)."""
        with self._lock:
            self._closed = True
            checkers, self._checkers = list(self._checkers), set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for checker in checkers:
            checker.kill()
