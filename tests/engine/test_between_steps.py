"""The engine's one place for work between steps (engine/between_steps.py): its hooks run around every step
and when the loop idles, whoever drives the engine; the governor and background timing are settings."""

from __future__ import annotations

from kiln.engine import SamplingParams
from kiln.engine.between_steps import BetweenSteps, TacticSwap
from kiln.engine.config import EngineConfig, reported_settings
from kiln.engine.thread_governor import ThreadGovernor


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def before_step(self) -> None:
        self.calls.append(("before",))

    def after_step(self, generated_tokens: int, batch: int) -> None:
        self.calls.append(("after", generated_tokens, batch))

    def idle(self) -> None:
        self.calls.append(("idle",))


def test_every_step_of_any_loop_runs_the_hooks(toy_model, make_llm):
    llm = make_llm(toy_model("llama-tiny"), device="cpu", num_kv_blocks=32, tactics="aten")
    hooks = llm.engine.between_steps
    assert isinstance(hooks, BetweenSteps) and isinstance(hooks.hooks[0], TacticSwap)
    assert hooks.find(ThreadGovernor) is None  # LLM(...): the governor is off unless asked
    rec = Recorder()
    hooks.hooks.append(rec)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    afters = [c for c in rec.calls if c[0] == "after"]
    assert rec.calls[0] == ("before",) and len(afters) == rec.calls.count(("before",)) >= 3
    assert sum(c[1] for c in afters) == 6 and max(c[2] for c in afters) == 2
    hooks.idle()
    assert rec.calls[-1] == ("idle",)


def test_the_governor_and_background_timing_are_settings(toy_model, make_llm, monkeypatch):
    from kiln.engine import cpu_target

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cpu_target.THREADS_ENV, raising=False)
    monkeypatch.setattr(cpu_target, "usable_cores", lambda: 64)  # something to choose
    model = toy_model("llama-tiny")
    cfg = EngineConfig(model=str(model), device="cpu", thread_governor=True, tactics_background=True)
    assert {"thread_governor", "tactics_background"} <= set(reported_settings(cfg))
    llm = make_llm(model, device="cpu", num_kv_blocks=32, tactics="aten", thread_governor=True)
    governor = llm.engine.between_steps.find(ThreadGovernor)
    assert governor is not None and 64 in governor.choices


def test_the_server_reads_the_governor_and_cannot_attach_one():
    from kiln.engine.async_llm import AsyncLLM
    from kiln.serving.loader import SERVER_DEFAULTS

    assert SERVER_DEFAULTS == {"tactics_background": True, "thread_governor": True}
    assert isinstance(AsyncLLM.thread_governor, property) and AsyncLLM.thread_governor.fset is None  # read only
