"""From a validated OpenAI request to engine inputs: token ids and SamplingParams.

The server tokenizes (and renders chat templates) itself so it can apply the
engine's own limit rules (``kiln.engine.limits``) before the engine sees the
request and answer a 400 naming the parameter (``prompt[1]``, ``messages``,
``max_completion_tokens``): an empty prompt, a prompt over ``max_input_len``,
or a prompt plus ``max_tokens`` over ``max_seq_len``. Each prompt times ``n`` becomes one
engine request; with a ``seed`` and ``n > 1`` choice ``j`` uses ``seed + j``
so the choices differ but stay reproducible. Every choice shares the request's output
constraint (compiled once; each engine request gets its own grammar state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.engine import SamplingParams
from kiln.engine.errors import RequestError
from kiln.engine.generation_config import sampling_defaults
from kiln.engine.limits import check_prompt, resolve_max_tokens
from kiln.engine.sampling_params import SEED_MAX
from kiln.engine.structured.params import StructuredOutputsParams
from kiln.serving.chat import render_chat
from kiln.serving.constraints import ToolPlan
from kiln.serving.errors import APIError
from kiln.serving.protocol import ChatCompletionRequest, CompletionRequest
from kiln.serving.truncation import middle_truncated

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class EngineInput:
    index: int  # the choice index in the response
    prompt_index: int  # which prompt of a batch (usage counts each prompt once, whatever n is)
    prompt_token_ids: list[int]
    prompt_text: str | None  # what `echo` prepends
    params: SamplingParams


def _from_engine_rule(check: Any, *args: Any, **kwargs: Any) -> Any:
    """Apply one of the engine's limit rules (kiln.engine.limits), its refusal as a 400."""
    try:
        return check(*args, **kwargs)
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None


def vocabulary_size(engine: Any) -> int:
    """The ids ``engine``'s model takes: its config's vocab_size, else its tokenizer's."""
    return int(engine.engine_config.hf_config.get("vocab_size") or len(engine.tokenizer))


def _check_prompt(ids: list[int], param: str, engine: Any) -> None:
    _from_engine_rule(check_prompt, ids, engine.engine_config.max_input_len, vocabulary_size(engine), param=param)


def _max_tokens(requested: int | None, param: str, num_prompt: int, engine: Any, default: int | None) -> int:
    return _from_engine_rule(resolve_max_tokens, requested, num_prompt, engine.engine_config.max_seq_len,
                             param=param, default=default)


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest, logprobs: int | None) -> int | None:
    """The k of the prompt's logprobs (engine/prompt_logprobs.py): vLLM's ``prompt_logprobs``, and for echo with
    ``logprobs`` the prompt's tokens get theirs too (the larger k serves both: each answer keeps its own top)."""
    asked = [req.prompt_logprobs, logprobs if isinstance(req, CompletionRequest) and req.echo else None]
    return max((k for k in asked if k is not None), default=None)


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                     choice: int, constraint: StructuredOutputsParams | None = None,
                     defaults: dict[str, Any] | None = None) -> SamplingParams:
    defaults = defaults or {}
    seed = req.seed
    if seed is not None and req.n > 1:
        seed += choice
        if seed > SEED_MAX:  # wrap: the generator takes no more, and the choices must still differ
            seed -= SEED_MAX + 1
    # Unset: the model's default (its generation_config.json, --generation-config), else OpenAI's neutral value.
    unset = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    chosen = {k: v if (v := getattr(req, k)) is not None else defaults.get(k, neutral) for k, neutral in unset.items()}
    kwargs = dict(
        **chosen, seed=seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        allowed_token_ids=req.allowed_token_ids, structured_outputs=constraint, cache_salt=req.cache_salt,
        prompt_logprobs=_prompt_logprobs(req, logprobs),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        # SamplingParams messages start with the field name ("top_k must be >= 0 ...").
        word = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=word if word in kwargs else None) from None


def completion_inputs(req: CompletionRequest, engine: Any, constraint: StructuredOutputsParams | None = None,
                      plan: None = None) -> list[EngineInput]:
    tokenizer, defaults = engine.tokenizer, sampling_defaults(engine.engine_config)
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        prompts: list[Any] = [prompt]
    else:
        prompts = list(prompt)
    inputs: list[EngineInput] = []
    for p_index, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p_index}]"
        if isinstance(p, str):
            ids = tokenizer.encode(p) if p else []
            text = p
        else:
            ids = list(p)
            text = None
        _check_prompt(ids, param, engine)
        if text is None and req.echo:
            text = tokenizer.decode(ids)
        max_tokens = _max_tokens(req.max_tokens, "max_tokens", len(ids), engine, DEFAULT_COMPLETION_MAX_TOKENS)
        for j in range(req.n):
            params = _sampling_params(req, max_tokens, req.logprobs, j, constraint, defaults)
            inputs.append(EngineInput(p_index * req.n + j, p_index, ids, text if req.echo else None, params))
    return inputs


def chat_inputs(req: ChatCompletionRequest, engine: Any, constraint: StructuredOutputsParams | None = None,
                plan: ToolPlan | None = None) -> list[EngineInput]:
    ids = render_chat(req, engine.tokenizer, plan)
    requested, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    if req._truncate_middle:  # the Responses API's truncation "auto": the oldest turns go until it fits
        req, ids = middle_truncated(req, ids, engine, plan, requested)
    _check_prompt(ids, "messages", engine)
    defaults = sampling_defaults(engine.engine_config)
    max_tokens = _max_tokens(requested, param, len(ids), engine, defaults.get("max_tokens"))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return [
        EngineInput(j, 0, ids, None, _sampling_params(req, max_tokens, logprobs, j, constraint, defaults))
        for j in range(req.n)
    ]
