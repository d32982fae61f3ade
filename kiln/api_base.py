"""The base of every ``LLMEngine`` API type: camelCase in YAML, snake_case in Python, the types the API server checks
(the CRD's schema), and the Kubernetes name patterns its fields share (:mod:`kiln.manifest` words its messages by
them)."""

from __future__ import annotations

import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.alias_generators import to_camel

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # Service names: a letter first
MAX_NAME = 63  # a DNS label: a Service's or a Deployment's name, a label value
MAX_POOL_NAME = MAX_NAME - len("-pool")  # an LLMEnginePool's name: <pool>-pool names its Deployment and Service
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label's value, and the name part of a label's or an annotation's key (after an optional DNS-1123 prefix and '/').
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
MAX_PREFIX = 253  # a key's prefix: a DNS-1123 subdomain
# A field naming a Service (an endpoint picker's): what the API server takes as a Service's name.
ServiceName = Annotated[str, Field(max_length=MAX_NAME, pattern=DNS1035_LABEL)]


class APIModel(BaseModel):
    """camelCase in YAML, snake_case in Python, unknown fields rejected, and the JSON types of the CRD's schema, as
    the API server checks them: strict, so ``"8"`` is no integer and ``1`` or ``"true"`` no boolean (pydantic's lax
    mode would convert them, and ``kiln plan`` accept what ``kubectl apply`` refuses). What JSON writes as a number
    or as text is read as JSON is (:func:`_as_json_reads`): ``8.0`` is the integer 8, a timestamp or an enum's value
    is text."""

    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=True, validate_by_alias=True, extra="forbid", strict=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _as_json(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not (read := _as_json_reads(cls)):
            return data
        out, problems = {}, []
        for key, value in data.items():
            try:
                out[key] = read[key](value) if key in read else value
            except ValueError as exc:  # what strict validation would let through: said here, naming the field
                problems.append(f"{key}: {exc}")
        if problems:
            raise ValueError("\n".join(problems))
        return out

    def to_k8s(self) -> dict[str, Any]:
        """The camelCase dict the API server stores (None fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


_TIMESTAMP = TypeAdapter(datetime)


def _whole(value: Any) -> Any:
    """An integer field's JSON number without a fraction (``8.0``): the API server takes it as the integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _timestamp(value: Any) -> Any:
    """A timestamp field's RFC 3339 text (a status the operator wrote), as JSON carries it."""
    try:
        return _TIMESTAMP.validate_python(value) if isinstance(value, str) else value
    except ValidationError:
        return value  # strict validation says what is wrong with it


def _number_choice(choices: tuple[int, ...], value: Any) -> Any:
    """A choice of numbers (``tensorParallel: 1, 2, 4, 8``): ``true`` is 1 to Python, even strictly, and no number
    to the API server."""
    if isinstance(value, bool):
        raise ValueError(f"must be one of {', '.join(map(str, choices))} (got {str(value).lower()}); a boolean is no "
                         "number: write one of them")
    return _whole(value)


def _enum_value(kind: type[enum.Enum], value: Any) -> Any:
    try:
        return kind(value) if isinstance(value, str) else value
    except ValueError:
        return value


@functools.cache
def _as_json_reads(cls: type[BaseModel]) -> dict[str, Callable[[Any], Any]]:
    """``cls``'s fields (YAML and Python names) whose type JSON has no word for, and how a JSON value becomes one:
    an ``int`` or a choice of them (JSON has numbers, and booleans apart), a ``datetime``, an enum (JSON has text)."""
    reads: dict[str, Callable[[Any], Any]] = {}
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        kinds = set(typing.get_args(annotation) if union else (annotation,)) - {type(None)}
        kind = kinds.pop() if len(kinds) == 1 else None
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else ()
        read = _whole if kind is int else _timestamp if kind is datetime else functools.partial(_enum_value, kind) \
            if isinstance(kind, type) and issubclass(kind, enum.Enum) else functools.partial(_number_choice, choices) \
            if choices and all(type(c) is int for c in choices) else None
        if read is not None:
            reads |= {name: read, field.alias or name: read}
    return reads


def label_problems(mapping: dict[str, str] | None, values: bool = True) -> list[str]:
    """What the API server refuses of labels (or a nodeSelector: ``values``, their values too) or of annotations'
    keys, one ``<what + fix>`` each (the caller's field names them)."""
    problems = []
    for key, text in (mapping or {}).items():
        prefix, _, name = key.rpartition("/")
        if not (name and _label_text(name) and (not prefix or (
                len(prefix) <= MAX_PREFIX and re.fullmatch(DNS1123_SUBDOMAIN, prefix)))):
            problems.append(f"key {key!r} is not a Kubernetes key: a name of at most {MAX_NAME} characters (letters, "
                            "digits, '-', '_', '.', a letter or digit at each end), optionally after a DNS-1123 prefix "
                            "and '/' (example.com/team); rename it")
        elif values and not _label_text(text):
            problems.append(f"value {text!r} of {key} is not a label value: at most {MAX_NAME} characters of letters, "
                            "digits, '-', '_' and '.', a letter or digit at each end (or empty); change it")
    return problems


def _label_text(text: str) -> bool:
    return len(text) <= MAX_NAME and re.fullmatch(LABEL_VALUE, text) is not None
