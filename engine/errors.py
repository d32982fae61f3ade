"""Errors a caller of the engine can cause, each naming the input to fix."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses before queueing it.

    ``param`` names the offending input (``"prompt"``, ``"max_tokens"``, a
    SamplingParams field...) so a server can map it to a 400 with a field name.
    """

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI-style error code where one applies ("context_length_exceeded")


class RequestFailedError(RuntimeError):
    """One request failed on its own after it was admitted (its sampling or its text); the engine
    and the other requests go on. AsyncLLM raises it in that request's stream."""


class ConfigError(ValueError):
    """An engine setting (an ``LLM(...)`` keyword argument or artifact) that cannot work."""


class UnsupportedModelError(ConfigError):
    """The checkpoint's architecture is not one the runtime implements."""
