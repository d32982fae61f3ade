"""Reading ``LLMEngine`` manifests, and pydantic errors as one line per problem.

``load_manifest`` takes a path, YAML/JSON text or a dict and returns the typed
:class:`kiln.api.LLMEngine` (``load_pool``: a :class:`kiln.pool_api.LLMEnginePool`); every problem
becomes one ``<field path>: <what + fix>`` line of a :class:`ManifestError`, with paths in the YAML's
camelCase terms, so
``kiln plan``, ``kiln build``, ``kiln up`` and the operator report bad input the
same way and never as a traceback.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from kiln.api import GROUP, KIND, LLMEngine, LLMEngineSpec
from kiln.api_base import DNS1035_LABEL, DNS1123_LABEL, DNS1123_SUBDOMAIN
from kiln.memory_budget import QUANTITY_PATTERN
from kiln.pool_api import POOL_KIND, LLMEnginePool


class ManifestError(ValueError):
    """A manifest a user wrote is invalid. ``str()`` is one line per problem: ``<field path>: <what + fix>``."""

    def __init__(self, problems: list[str] | str, origin: str = "manifest") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.origin = origin
        super().__init__("\n".join(self.problems))


def load_manifest(source: Any) -> LLMEngine:
    """An ``LLMEngine`` from a path, YAML/JSON text or a dict; :class:`ManifestError` on any problem."""
    data, origin = _load_data(source)
    try:
        return LLMEngine.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(validation_error_lines(exc, LLMEngine), origin) from None


def load_pool(source: Any) -> LLMEnginePool:
    """An ``LLMEnginePool`` from a path, YAML/JSON text or a dict; :class:`ManifestError` on any problem."""
    data, origin = _load_data(source, POOL_KIND)
    try:
        return LLMEnginePool.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(validation_error_lines(exc, LLMEnginePool), origin) from None


def load_spec(raw: Any) -> LLMEngineSpec:
    """A spec from the camelCase dict the API server stores; ManifestError lines start with ``spec.``."""
    try:
        return LLMEngineSpec.model_validate(raw)
    except ValidationError as exc:
        lines = validation_error_lines(exc, LLMEngineSpec)
        raise ManifestError([_join_spec(line) for line in lines], "spec") from None


def _join_spec(line: str) -> str:
    return line.replace("manifest: ", "spec: ", 1) if line.startswith("manifest: ") else f"spec.{line}"


def load_documents(source: Any) -> list[LLMEngine | LLMEnginePool]:
    """Every ``LLMEngine`` and ``LLMEnginePool`` of a manifest's documents, in order (a GitOps file holds a pool and
    its members; documents of other kinds are left out, as ``kiln render`` renders none); one document of neither
    kind is read as an LLMEngine, so its problems are said. :class:`ManifestError` names each document's problems."""
    if isinstance(source, dict):
        return [load_pool(source) if source.get("kind") == POOL_KIND else load_manifest(source)]
    docs, origin = read_documents(source)
    # Ours: kiln's kinds, and a document kubectl would refuse that names no kind or kiln's group (its problem said).
    ours = [d for d in docs if isinstance(d, dict) and (d.get("kind") in (KIND, POOL_KIND) or d.get("kind") is None
                                                         or str(d.get("apiVersion", "")).startswith(f"{GROUP}/"))]
    if not ours:
        return [load_manifest(_load_data(source)[0])]
    objects, problems = [], []
    for doc in ours:
        try:
            objects.append(load_pool(doc) if doc.get("kind") == POOL_KIND else load_manifest(doc))
        except ManifestError as exc:
            name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
            what = f"{doc.get('kind') or 'document'} {name}: " if len(ours) > 1 else ""
            problems += [what + line for line in exc.problems]
    if problems:
        raise ManifestError(problems, origin)
    return objects


def _load_data(source: Any, kind: str = KIND) -> tuple[Any, str]:
    if isinstance(source, dict):
        _check_kind(source, kind, "manifest")
        return source, "manifest"
    docs, origin = read_documents(source)
    if len(docs) > 1:
        docs = [d for d in docs if isinstance(d, dict) and d.get("kind") == kind] or docs
    if len(docs) != 1:
        raise ManifestError(f"expected exactly one {kind} document, found {len(docs)}; "
                            f"put one {kind} per file", origin)
    _check_kind(docs[0], kind, origin)
    return docs[0], origin


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # a name too long for a path: a one-line manifest's text
        return False


def read_documents(source: Any) -> tuple[list[Any], str]:
    """The YAML documents of a path or a text (read as kubectl reads them), and where they came from."""
    text, origin = source, "manifest"
    is_path = isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source
        and (source.endswith((".yaml", ".yml", ".json")) or _is_file(source))
    )
    if is_path:
        origin = str(source)
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ManifestError(f"{origin}: cannot read the file ({exc.strerror}); check the path", origin) from None
    try:
        docs = [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d is not None]
    except RecursionError:
        raise ManifestError("invalid YAML (nested too deeply to read); a manifest nests a few levels: fix the "
                            "brackets", origin) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ManifestError(f"{where}invalid YAML ({problem}); fix the syntax there", origin) from None
    return docs, origin


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping, as kubectl does, instead of keeping the
    last one silently (a second ``gpu:`` further down would decide what is built)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': merged keys may be overridden, as YAML means
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):  # SafeLoader refuses it below, with its own message
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: remove one of them", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    # Plain scalars as kubectl reads them (sigs.k8s.io/yaml: go-yaml v2), where PyYAML's YAML 1.1 reads text:
    # 1e9 and 1.5e3 are numbers (PyYAML wants a dot and a signed exponent), y and n booleans. So the API server's
    # refusal of `memoryBudget: 1e9` (a number where text is wanted) is kiln's too.
    bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"))
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def _check_kind(data: Any, kind: str, origin: str) -> None:
    """kiln's other kind where this one is expected: that one line, not a line per field the kinds do not share."""
    got = data.get("kind") if isinstance(data, dict) else None
    if isinstance(data, dict) and got is None:  # not known to be an engine: its spec's lines would say nothing
        what = f"add kind: {kind}" + (f" (a pool's manifest: kind: {POOL_KIND})" if kind == KIND else "")
        raise ManifestError(f"kind: required field is missing; {what}", origin)
    if got in (KIND, POOL_KIND) and got != kind:
        fix = (f"give an {KIND} manifest: a pool's engines are planned and built one by one (its members' "
               f"manifests); kiln up and kiln render take the pool manifest itself") if kind == KIND else \
            f"give an {POOL_KIND} manifest (docs/pools.md)"
        raise ManifestError(f"kind: {got} where an {kind} is expected; {fix}", origin)


_PATTERN_NAMES = {
    DNS1123_LABEL: "a DNS-1123 label (lowercase letters, digits and '-', at most 63 characters)",
    DNS1123_SUBDOMAIN: "a DNS-1123 name (lowercase letters, digits, '-' and '.')",
    QUANTITY_PATTERN: "a Kubernetes quantity such as 6Gi, 512Mi or 8G",
    DNS1035_LABEL: "a DNS-1035 label, as a Service's name is (lowercase letters, digits and '-', starting with a "
    "letter)",
}
_TYPE_NAMES = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "dict_type": "a mapping",
    "model_type": "a mapping", "model_attributes_type": "a mapping", "list_type": "a list",
    "datetime_type": "an RFC 3339 timestamp", "datetime_parsing": "an RFC 3339 timestamp",
    "datetime_from_date_parsing": "an RFC 3339 timestamp",
}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"),
           "greater_than": (">", "gt"), "less_than": ("<", "lt")}


def validation_error_lines(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One ``path: problem; fix`` line per pydantic error, paths in YAML (camelCase) terms."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = err["loc"]
        path = _render_path(loc)
        kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
        if kind == "value_error":
            for line in str(ctx.get("error", err["msg"])).splitlines():
                sub = re.match(r"^([A-Za-z][A-Za-z.]*): (.*)$", line)
                if sub:  # a cross-field check naming its field relative to this model
                    lines.append(f"{_join(path, sub.group(1))}: {sub.group(2)}")
                else:
                    lines.append(f"{path}: {line}")
        elif kind == "missing":
            lines.append(f"{path}: required field is missing; {_add_missing(root, loc)}")
        elif kind == "extra_forbidden":
            allowed = _allowed_fields(root, loc[:-1])
            near = difflib.get_close_matches(str(loc[-1]).lower(), [a.lower() for a in allowed], n=1)
            hint = next((a for a in allowed if near and a.lower() == near[0]), None)
            fix = f"did you mean {hint}?" if hint else f"remove it (allowed: {', '.join(allowed)})"
            lines.append(f"{path}: unknown field; {fix}")
        elif kind in ("literal_error", "enum"):
            expected = re.sub(r"'([^']*)'", r"\1", str(ctx.get("expected", ""))).replace(" or ", ", ")
            hint = _bool_word_hint(got, expected) or _unquote_hint(got, expected.split(", "))
            lines.append(f"{path}: must be one of {expected} (got {_show(got)}){hint}")
        elif kind in _TYPE_NAMES:
            lines.append(f"{path}: must be {_TYPE_NAMES[kind]} (got {_show(got)}){_quote_hint(kind, got)}")
        elif kind in _BOUNDS:
            op, key = _BOUNDS[kind]
            lines.append(f"{path}: must be {op} {ctx.get(key)} (got {_show(got)})")
        elif kind == "string_pattern_mismatch":
            pattern = ctx.get("pattern", "")
            what = f"be {_PATTERN_NAMES[pattern]}" if pattern in _PATTERN_NAMES else f"match {pattern}"
            lines.append(f"{path}: must {what} (got {_show(got)})")
        elif kind in ("string_too_long", "too_long"):
            unit = "characters" if kind == "string_too_long" else "items"
            lines.append(f"{path}: must have at most {ctx.get('max_length')} {unit}")
        else:
            lines.append(f"{path}: {err['msg']}")
    return lines


# Words YAML 1.1 (PyYAML, and kubectl's parser alike) reads as a boolean when they are not quoted.
_BOOL_WORDS = {True: ("on", "yes", "y", "true"), False: ("off", "no", "n", "false")}


_WRITTEN_AS = {"int_type": (int,), "float_type": (int, float), "bool_type": (bool,)}


def _quote_hint(kind: str, got: Any) -> str:
    """How to write a value YAML read as the wrong type: a number where text is wanted, text where a number or a
    boolean is (the API server takes the CRD's types as they are, with no conversion)."""
    if kind == "string_type" and isinstance(got, int | float) and not isinstance(got, bool):
        # YAML reads an unquoted 20240101 or 1.10 as a number (1.1): text must be quoted to stay as written
        return "; quote it in YAML so it stays text as written"
    if kind == "bool_type" and isinstance(got, int | float) and not isinstance(got, bool):
        return "; write true or false"
    if kind in _WRITTEN_AS and isinstance(got, str):
        value = _yaml_scalar(got)
        if isinstance(value, _WRITTEN_AS[kind]) and (kind == "bool_type") == isinstance(value, bool):
            return f"; write it without quotes ({got}): in quotes YAML reads it as text"
    return ""


def _unquote_hint(got: Any, choices: list[str]) -> str:
    """Where a choice of numbers (``tensorParallel: "2"``) arrived as text: write it without quotes."""
    value = _yaml_scalar(got) if isinstance(got, str) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and str(value) in choices:
        return f"; write it without quotes ({got}): in quotes YAML reads it as text"
    return ""


def _yaml_scalar(text: str) -> Any:
    """What YAML reads ``text`` as, unquoted (None where it is no scalar: a long or nested text is none)."""
    if len(text) > 40 or any(c in text for c in "[]{}&*!|>"):
        return None
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return None
    return value if isinstance(value, int | float | bool) else None


def _bool_word_hint(got: Any, expected: str) -> str:
    """Where a choice such as ``off`` arrived as a boolean (written unquoted): how to write it."""
    if not isinstance(got, bool):
        return ""
    words = [w for w in expected.split(", ") if w.lower() in _BOOL_WORDS[got]]
    if not words:
        return ""
    return f"; YAML reads an unquoted {words[0]} as {str(got).lower()}: quote it ('{words[0]}')"


def _render_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "manifest"


def _join(path: str, rel: str) -> str:
    return rel if path == "manifest" else f"{path}.{rel}"


def _show(value: Any) -> str:
    if isinstance(value, dict | list):
        return type(value).__name__
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _allowed_fields(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The YAML field names of the model at ``loc`` (for did-you-mean hints)."""
    cls = _model_at(root, loc)
    return [f.alias or n for n, f in cls.model_fields.items()] if cls is not None else []


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    cls: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        cls = _model_in(field.annotation) if field else None
        if cls is None:
            return None
    return cls


def _add_missing(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The fix for a missing field: ``add it``, or what to write where it takes one value (``kind: LLMEngine``)."""
    cls = _model_at(root, loc[:-1])
    field = next((f for n, f in cls.model_fields.items() if loc[-1] in (n, f.alias)), None) if cls else None
    values = get_args(field.annotation) if field is not None and typing.get_origin(field.annotation) is \
        typing.Literal else ()
    return f"add {loc[-1]}: {values[0]}" if len(values) == 1 else "add it"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return next((m for a in get_args(annotation) if (m := _model_in(a)) is not None), None)
    return None


