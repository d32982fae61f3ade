"""LLM: offline batch generation, vLLM-shaped (``LLM(model).generate(prompts, params)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.engine.config import EngineConfig
from kiln.engine.errors import RequestError
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.lora.request import LoRARequest
from kiln.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Request

Prompt = str | list[int]


def normalize_prompts(prompts: Any) -> list[Prompt]:
    """One prompt (str or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, list | tuple):
        return list(prompts)
    raise RequestError("prompts", "prompts must be a string, a list of token ids, or a list of those")


def to_output(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
        token_ids=req.output_token_ids, text=req.detokenizer.text, finish_reason=req.finish_reason,
        logprobs=req.logprobs, num_cached_tokens=req.num_cached_tokens,
        metrics=RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time, req.queue_time),
        error=req.error, prompt_logprobs=req.prompt_logprobs, prompt_ranks=req.prompt_ranks,
    )


class LLM:
    """Generate for a batch of prompts; outputs come back in input order."""

    def __init__(self, model: str | Path | None = None, *, engine_config: EngineConfig | None = None,
                 **kwargs: Any) -> None:
        if engine_config is None:
            if model is None:
                raise TypeError("LLM() needs a model directory")
            engine_config = EngineConfig(model=str(model), **kwargs)
        self.engine_config = engine_config
        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, **overrides: Any) -> LLM:
        """Load a built engine artifact (engine.json + per-rank weights), see ``artifact.py``."""
        from kiln.engine.artifact import artifact_engine_config

        return cls(engine_config=artifact_engine_config(artifact_dir, **overrides))

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None: the base) per prompt."""
        prompts = normalize_prompts(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise RequestError("lora_request", f"got {len(loras)} lora_request for {len(prompts)} prompts; give "
                                               "one or one per prompt")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise RequestError("sampling_params", f"got {len(sampling_params)} sampling_params for "
                                                      f"{len(prompts)} prompts; give one or one per prompt")
            params_list = sampling_params
        else:
            params_list = [sampling_params] * len(prompts)
        # Validate every prompt before queueing any, so a bad one leaves the engine untouched.
        reqs = [self.engine.make_request(p, sp, lora_request=lr)
                for p, sp, lr in zip(prompts, params_list, loras, strict=True)]
        for req in reqs:
            self.engine.add(req)
        try:
            while any(not r.is_finished for r in reqs):
                self.engine.step()
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [to_output(r) for r in reqs]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
