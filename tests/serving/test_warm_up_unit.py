"""The server is ready before the grammar compiler's warm-up: only structured requests need it, and it was 0.5-0.9 s
of a 3.5 s start; and the warm-up waits for the server to be idle, since it holds the GIL for 0.3 s and so stalls
whatever request it overlaps (loader.warm_up_grammar). Without a model: the engine is a stand-in."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from kiln.serving import app as app_module
from kiln.serving import loader
from kiln.serving.config import ServeConfig
from kiln.serving.server_state import READY

from kiln.adapter_list import ADAPTERS_FILE_ENV


class Compiler:
    def __init__(self, fail: Exception | None = None) -> None:
        self.release, self.started, self.done, self.fail = threading.Event(), threading.Event(), False, fail

    def warm_up(self) -> None:
        self.started.set()
        assert self.release.wait(10)
        if self.fail is not None:
            raise self.fail
        self.done = True


class Engine:
    def __init__(self, compiler: Compiler) -> None:
        self.engine = SimpleNamespace(grammar_compiler=compiler)
        self.engine_config = SimpleNamespace(max_batch_size=4)

    async def start(self) -> None:
        pass


def load(monkeypatch, compiler: Compiler) -> app_module.ServingContext:
    engine = Engine(compiler)
    monkeypatch.setattr(app_module, "build_engine", lambda config: (engine, {"engine_version": None}))

    async def generation(engine) -> None:  # the warm-up generation: a real engine's first token
        pass

    monkeypatch.setattr(app_module, "warm_up", generation)
    monkeypatch.delenv(ADAPTERS_FILE_ENV, raising=False)  # no adapter list to follow
    return app_module.ServingContext(ServeConfig(model=Path("/nonexistent"), served_model_name="m"))


@pytest.mark.parametrize("fail", [None, RuntimeError("checker would not start")])
def test_ready_comes_before_the_grammar_warm_up_which_then_runs(monkeypatch, caplog, fail):
    monkeypatch.setattr(loader, "GRAMMAR_WARM_UP_IDLE_S", 0.05)
    compiler = Compiler(fail)
    ctx = load(monkeypatch, compiler)

    async def run() -> None:
        await ctx.load()
        assert ctx.state.phase == READY  # ready while the warm-up has not finished (it is held)
        task = ctx.grammar_warm_up
        assert task is not None and not task.done()
        await asyncio.to_thread(compiler.started.wait, 10)
        compiler.release.set()
        await task  # a failed warm-up is logged, never raised: the engine serves on
        assert ctx.state.phase == READY

    with caplog.at_level(logging.INFO, logger="kiln.serving"):
        asyncio.run(run())
    assert compiler.done == (fail is None)
    text = caplog.text
    if fail is None:
        assert text.index("ready in") < text.index("grammar compiler warmed up")
    else:
        assert "the grammar compiler's warm-up failed (checker would not start)" in text


def test_the_grammar_warm_up_waits_until_no_request_has_been_in_flight_for_a_while():
    compiler, busy = Compiler(), [1]

    async def run() -> float:
        task = asyncio.create_task(loader.warm_up_grammar(Engine(compiler), lambda: busy[0], idle_s=0.3))
        await asyncio.sleep(0.8)
        assert not compiler.started.is_set(), "the warm-up started while a request was in flight"
        busy[0] = 0
        idle_at = asyncio.get_running_loop().time()
        await asyncio.to_thread(compiler.started.wait, 10)
        waited = asyncio.get_running_loop().time() - idle_at
        compiler.release.set()
        await task
        return waited

    waited = asyncio.run(run())
    assert compiler.done and 0.25 <= waited < 5, waited
