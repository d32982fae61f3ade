"""A chat request's messages (and tools) through the tokenizer's chat template, as token ids.

A template that renders tools (it uses the ``tools`` variable: Llama 3.1+, Qwen, Hermes,
Mistral) gets them as its ``tools`` argument, and assistant messages keep their ``tool_calls``
with the arguments as objects (what those templates index), ``tool`` messages their
``tool_call_id``. A template that does not (SmolLM2, ChatML) gets kiln's ``json`` tool format:
the tools described in the system message, and earlier calls written into the assistant's
content as the JSON the model is asked to answer with (:mod:`tool_calls`).

``chat_template_kwargs`` (vLLM's field: ``{"enable_thinking": false}`` for Qwen3, ``{"thinking": true}`` for
Granite) are more variables for the template, over the server's ``--default-chat-template-kwargs``; the
names kiln sets itself (the conversation, tools, the generation prompt) are refused, naming the variable.
OpenAI's ``reasoning_effort`` (and what the Responses and Messages APIs call effort) is the template's
``reasoning_effort`` variable, as gpt-oss's template reads it, unless ``chat_template_kwargs`` sets it.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.serving.constraints import ToolPlan, continued_text, output_constraint
from kiln.serving.errors import APIError
from kiln.serving.protocol import ChatCompletionRequest, ChatMessage, check_supported, message_text

from kiln.chat_options import RESERVED_TEMPLATE_VARIABLES, reserved_message

TOOLS_PROMPT = (
    "You can call these functions. Each one's arguments follow its JSON Schema:\n{tools}\n"
    'To call functions, answer with only a JSON array: [{{"name": "<function name>", '
    '"arguments": {{<the arguments>}}}}]. Otherwise answer normally.'
)


# What render_chat passes itself, and the tokenizer's own arguments: a request may not set them.
def with_template_defaults(req: Any, defaults: dict[str, Any] | None) -> None:
    """Give chat request ``req`` the server's ``--default-chat-template-kwargs`` under its own."""
    if defaults:
        req.chat_template_kwargs = {**defaults, **(req.chat_template_kwargs or {})}


def check_template_kwargs(kwargs: dict[str, Any], field: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` for the chat template, or a 400 naming the first variable kiln sets itself."""
    for name in kwargs:
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise APIError(400, reserved_message(field, name), param=f"{field}.{name}")
    return dict(kwargs)


def tool_arguments(text: str, param: str) -> dict[str, Any]:
    """A tool call's arguments as the template reads them (a mapping), or a 400 naming ``param``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON object in a string (as the tool call was returned), "
                       f"such as '{{\"city\": \"Paris\"}}'", param=param)
    return value


def _message(i: int, m: ChatMessage, native: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": message_text(m)}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    thought = m.reasoning if m.reasoning is not None else m.reasoning_content
    if thought is not None and m.role == "assistant":  # under both names, as vLLM gives templates
        out["reasoning"] = out["reasoning_content"] = thought
    if m.tool_calls:
        where = f"messages[{i}].tool_calls"
        calls = [{"name": c.function.name,
                  "arguments": tool_arguments(c.function.arguments, f"{where}[{j}].function.arguments")}
                 for j, c in enumerate(m.tool_calls)]
        if native:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                 for c, call in zip(m.tool_calls, calls, strict=True)]
        else:
            written = json.dumps(calls, ensure_ascii=False)
            out["content"] = f"{out['content']}\n{written}" if out["content"] else written
    return out


def _with_tools_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    described = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                             "parameters": t.function.parameters or {}} for t in plan.tools], ensure_ascii=False)
    prompt = TOOLS_PROMPT.format(tools=described)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_chat(req: ChatCompletionRequest, tokenizer: Any, plan: ToolPlan | None = None) -> list[int]:
    """The conversation through the tokenizer's chat template, as token ids."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, "This model's tokenizer has no chat template, so /v1/chat/completions cannot "
                       "format messages; use /v1/completions with a plain prompt", param="messages",
                       code="no_chat_template")
    native = isinstance(template, str) and "tools" in template
    messages = [_message(i, m, native) for i, m in enumerate(req.messages)]
    kwargs = check_template_kwargs(getattr(req, "chat_template_kwargs", None) or {})
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if plan is not None and native:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in plan.tools]
    elif plan is not None:
        messages = _with_tools_prompt(messages, plan)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             tokenize=False, **kwargs)
    except Exception as exc:  # jinja's raise_exception() in templates ("roles must alternate" ...)
        asked = getattr(req, "chat_template_kwargs", None)
        what = "these messages" + (f" with chat_template_kwargs {sorted(asked)}" if asked else "")
        raise APIError(400, f"The chat template rejected {what}: {exc}", param="messages") from None
    final = continued_text(req)
    if final is not None:
        text = _continued(text, final, len(req.messages) - 1)
    # The template writes any BOS itself; encoding must not add a second one.
    return tokenizer.encode(text, add_special_tokens=False)


def _continued(text: str, final: str, index: int) -> str:
    """The rendered conversation cut right after the final message's text (``continued_text``: stripped), so the
    reply continues it (as transformers' ``continue_final_message`` cuts it: at the last place that text appears)."""
    at = text.rfind(final)
    if at < 0:
        raise APIError(400, f"continue_final_message: the chat template does not show messages[{index}]'s text as "
                       "written, so the reply cannot continue it; send it as a new turn instead "
                       "(continue_final_message: false)", param="continue_final_message")
    return text[: at + len(final)]


def chat_prompt_ids(chat: ChatCompletionRequest, tokenizer: Any, engine_info: dict[str, Any] | None,
                    defaults: dict[str, Any] | None) -> list[int]:
    """``chat``'s prompt ids as ``/v1/chat/completions`` renders it, for the endpoints that only count or key a
    prompt (Messages' count_tokens, the prefix-cache keys of a dialect's body, /tokenize): its fields checked as
    chat checks them, the server's template variables (``defaults``) under its own, its tools written in the
    engine's tool-call format (``engine_info``'s)."""
    check_supported(chat)
    with_template_defaults(chat, defaults)
    _, plan = output_constraint(chat, (engine_info or {}).get("tool_call_format", "json"))
    return render_chat(chat, tokenizer, plan)
