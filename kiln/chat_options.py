"""What the server and the operator share of chat serving: the reasoning parsers' names and the rules for chat
template variables, wherever they are given (a request's ``chat_template_kwargs``, ``kiln serve
--default-chat-template-kwargs``, an LLMEngine's ``spec.serving.defaultChatTemplateKwargs`` or a pool's
``spec.defaultChatTemplateKwargs``). Each parser's behaviour is the server's (``kiln.serving.reasoning``)."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

# kiln serve --reasoning-parser (vLLM's names); kiln.serving.reasoning.PARSERS has one parser for each.
ReasoningParserName = Literal["deepseek_r1", "qwen3"]
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)

MAX_TEMPLATE_KWARGS = 64  # variables in one chat_template_kwargs (or the server's defaults)
TEMPLATE_VARIABLE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"  # a chat template variable's name, as Jinja reads one
# The variables kiln itself gives every chat template render (transformers' apply_chat_template arguments).
RESERVED_TEMPLATE_VARIABLES = frozenset((
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "return_tensors", "tokenizer_kwargs", "sanitize_control_tokens"))


def reserved_message(field: str, name: str) -> str:
    """Why ``field.name`` is refused: the server sets that variable itself."""
    return (f"{field}.{name} is set by the server itself (from messages, tools and add_generation_prompt); remove it "
            f"from {field}")


def template_kwargs_problem(kwargs: dict[str, Any], field: str) -> str | None:
    """``<what + fix>`` naming ``field`` for chat template variables no template can be given, else None."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        return f"{field} holds {len(kwargs)} variables; at most {MAX_TEMPLATE_KWARGS} are allowed"
    for name in kwargs:
        if not isinstance(name, str) or not re.fullmatch(TEMPLATE_VARIABLE_PATTERN, name):
            return (f"{field}.{name} is not a name a chat template can read; use letters, digits and _, not "
                    "starting with a digit, at most 64 characters")
        if name in RESERVED_TEMPLATE_VARIABLES:
            return reserved_message(field, name)
    return None
