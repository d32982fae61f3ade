"""Compile a request's constraint into a grammar, once per distinct constraint (llguidance).

Why llguidance (and not xgrammar): one abi3 wheel with no dependencies (xgrammar pulls triton,
apache-tvm-ffi and pins on torch/transformers), grammars built lazily (~1-2 ms for the
schemas clients send, where xgrammar's ahead-of-time compile took 140 ms for a schema with
``format: email`` on SmolLM2's vocabulary), the broadest JSON Schema coverage, errors reported
as state rather than raised mid-generation, and rollback plus draft-token validation for
speculative decoding. Its per-token mask costs a few microseconds on CPU.

``GrammarCompiler.submit`` compiles in the compiler's own bounded pool (:mod:`.pool`: a few threads, a
bounded queue, each compile stopped at ``GRAMMAR_COMPILE_TIMEOUT_S``; the server awaits it, the engine loop
never compiles; ``compile`` waits for it) and caches a pristine matcher per constraint (LRU): a cached
constraint never reaches the pool. Each request gets a copy (``CompiledGrammar.new_state``, ~7 us). A
constraint the grammar engine cannot compile, or not within the limit, raises :class:`RequestError` naming
the request field it came from; a full pool raises :class:`GrammarBusy`.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from kiln.engine.errors import RequestError
from kiln.engine.structured.params import GRAMMAR_MAX_SYMBOLS, StructuredOutputsParams, compile_settings
from kiln.engine.structured.pool import CompilePool, GrammarBusy
from kiln.engine.structured.state import GrammarState

__all__ = ["CompiledGrammar", "GrammarBusy", "GrammarCompiler", "closed_objects", "grammar_text"]

CACHE_SIZE = 256  # distinct constraints kept compiled
# JSON as clients read it: compact, with an optional space after ',' and ':' (small models like it),
# never unbounded whitespace (a model that loops on newlines would otherwise run to max_tokens).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}
_MAX_ERROR_CHARS = 400
# llguidance's own limits, the same in the checker process and here: over them a grammar is an error, at once.
# Its defaults (lexer fuel, lexer states...) otherwise; 500k symbols took seconds and overflowed its u16 ids.
LIMITS = {"verbose_errors": False, "max_grammar_size": GRAMMAR_MAX_SYMBOLS}


class CompiledGrammar:
    """A compiled constraint; ``new_state()`` gives one request its own matcher."""

    def __init__(self, matcher: Any, executor: Any) -> None:
        self._matcher = matcher
        self.executor = executor

    def new_state(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self.executor)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a fast tokenizer, built from its Rust backend as ``llguidance.hf.from_tokenizer``
    builds it (a copy without padding or truncation, serialized), without that module's transformers import:
    transformers' tokenizer and kiln's light one both have ``backend_tokenizer``."""
    import copy

    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    data = plain_added_tokens(json.loads(backend.to_str()))
    return llguidance.LLTokenizer(json.dumps(data), n_vocab=vocab_size, eos_token=eos_token_ids)


def plain_added_tokens(data: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer.json`` with its non-special added tokens (Qwen3's ``<think>``, ``<tool_call>``) as entries of the
    model's vocabulary. llguidance takes every added token for a special one, whose bytes no grammar text matches,
    while the tokenizer makes that token of the same text: a constraint whose text holds ``<think>`` would force
    the token, then refuse it. As vocabulary entries they are text like any other token's. A spelling the
    vocabulary gives another token stays an added token."""
    vocab = (data.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):  # a Unigram model's list: unchanged
        return data
    byte_level = "ByteLevel" in json.dumps([data.get("pre_tokenizer"), data.get("decoder")])
    kept = []
    for token in data.get("added_tokens") or []:
        content = token.get("content")
        if token.get("special", True) or not isinstance(content, str) or not content:
            kept.append(token)
            continue
        spelled = "".join(_BYTE_CHARS[b] for b in content.encode()) if byte_level else content.replace(" ", "\u2581")
        if vocab.setdefault(spelled, token["id"]) != token["id"]:
            kept.append(token)
    data["added_tokens"] = kept
    return data


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character a ByteLevel vocabulary spells each byte with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()


class GrammarCompiler:
    """Per engine: the tokenizer as llguidance sees it (built on first use), and the compile cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], num_threads: int = 1) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._num_threads = max(1, num_threads)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        settings = compile_settings()
        self.timeout_s = settings.timeout_s
        self._pool = CompilePool(settings.threads, settings.queue, settings.timeout_s, LIMITS)
        weakref.finalize(self, self._pool.close)  # the offline LLM never calls close()

    def _tokenizer(self, param: str) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                try:
                    self._ll_tokenizer = ll_tokenizer(self._hf_tokenizer, self._vocab_size, self._eos_token_ids)
                except Exception as exc:  # a slow (non-Rust) tokenizer, or one llguidance cannot read
                    raise RequestError(param, f"structured outputs need a fast (Rust) tokenizer, and this "
                                              f"model's cannot be used for them: {exc}") from None
                self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
            return self._ll_tokenizer

    def warm_up(self) -> None:
        """Build the tokenizer view (~0.3 s for a 49k vocabulary) and start the checker processes now, not
        on the first requests."""
        self._tokenizer("structured_outputs")
        self._pool.warm_up()

    def close(self) -> None:
        """Stop the pool: waiting compiles are dropped, running ones stopped. Cached grammars still serve."""
        self._pool.close()

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """``spec`` compiled (or cached), waiting for the pool; RequestError / GrammarBusy as ``submit``."""
        return self.submit(spec).result()

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of ``spec`` compiled, done already when cached; GrammarBusy now if the pool is full."""
        hit = spec.compiled or self._cached(spec.key())
        if hit is not None:
            spec.compiled = hit
            done: Future[CompiledGrammar] = Future()
            done.set_result(hit)
            return done
        return self._pool.submit(spec.param, self._compile_and_cache, spec)

    def _cached(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _compile_and_cache(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = spec.key()
        hit = self._cached(key)  # the same constraint may have compiled while this one waited
        if hit is None:
            hit = self._build(spec)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        spec.compiled = hit
        return hit

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        tokenizer = self._tokenizer(spec.param)
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise RequestError(spec.param, _cannot_compile(spec, str(exc))) from None
        error = self._pool.check(spec.param, grammar)  # in a process killed at the time limit
        if error:
            raise RequestError(spec.param, _cannot_compile(spec, error))
        try:  # checked within the limit: this takes about as long again, and ends (llguidance's limits)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        except (ValueError, TypeError) as exc:
            raise RequestError(spec.param, _cannot_compile(spec, str(exc))) from None
        if matcher.is_error():
            raise RequestError(spec.param, _cannot_compile(spec, matcher.get_error()))
        return CompiledGrammar(matcher, self._executor)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (JSON Schema, regex and choices via their own builders)."""
    from llguidance import LLMatcher

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = closed_objects(spec.json) if kind == "json" else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_FORMAT, "lenient": not spec.strict})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return LLMatcher.grammar_from_lark(spec.grammar)


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")
_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object schema that declares ``properties`` and says nothing of other keys
    closed (``additionalProperties: false``), as vLLM's default grammar backend (xgrammar's strict mode)
    reads it: a model is never invited to invent keys (small ones then never stop). ``allOf`` members,
    schemas combined with ``anyOf``/``oneOf``/``$ref`` and the members combined with a node's own
    ``properties`` are left as they are (closing them would change what their combination accepts). Iterative: the depth is bounded, but not by recursion."""
    import copy

    root = copy.deepcopy(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if "properties" in node and not any(k in node for k in _OPEN_KEYS):
            node["additionalProperties"] = False
        for key in _SUBSCHEMAS:
            stack.append(node.get(key))
        for key in _SCHEMA_LISTS:  # union members alone, not when they combine with the node's own properties
            if isinstance(node.get(key), list) and (key == "prefixItems" or "properties" not in node):
                stack.extend(node[key])
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return root


def _cannot_compile(spec: StructuredOutputsParams, why: str) -> str:
    why = " ".join(why.split())
    if len(why) > _MAX_ERROR_CHARS:
        why = why[:_MAX_ERROR_CHARS - 3] + "..."
    hint = " (set strict to false to ignore keywords kiln cannot enforce)" if spec.strict else ""
    return f"{spec.param} cannot be used to constrain the output: {why}{hint}"
