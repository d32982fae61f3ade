"""A model's tokenizer as transformers resolved it once, loaded again without importing transformers.

Importing transformers and building its tokenizer is 1.0-1.2 s of an engine's load, on the path to ``/ready``
(the tokenizer thread finished last in every measured start of the bench model: docs/performance.md). What
serving uses of that tokenizer is the Rust ``tokenizers.Tokenizer`` behind it (as transformers left it: added
tokens and post-processor included), its special tokens and its chat template. The first load of a model on a
host goes through transformers and writes that down (:func:`save_record`, a *record*, under
``$XDG_CACHE_HOME/kiln/tokenizers/``, keyed by the digest of every small file in the model directory and the
versions of transformers, tokenizers and jinja2); a later load of the same files builds a
:class:`LightTokenizer` from the record in about 0.12 s. A built artifact carries its own record
(:data:`ARTIFACT_RECORD`, written by the builder), used where this host's versions are the builder's, so a
serving pod's first load of it needs no transformers either.

Only a tokenizer whose behaviour *is* its backend gets a record: transformers' ``TokenizersBackend`` with none of
the methods serving calls overridden by its class, special tokens not split, and no decode clean-up (see
:func:`why_not_recordable`); any other keeps transformers at every load. ``$KILN_LIGHT_TOKENIZER=0`` keeps
transformers for all. ``tests/engine/test_light_tokenizer.py`` holds the two equal on encode, decode, the
vocabulary and chat templates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kiln.engine.chat_template import pick_template, render
from kiln.engine.host_cache import host_cache_dir

log = logging.getLogger(__name__)

RECORD_FORMAT = 1
ENV = "KILN_LIGHT_TOKENIZER"
# The methods of transformers' tokenizer serving reaches; a class overriding one is not described by its record.
SERVED_METHODS = ("_encode_plus", "_decode", "encode", "decode", "__call__", "__len__", "get_vocab",
                  "convert_ids_to_tokens", "apply_chat_template", "get_chat_template")
# Files a tokenizer never reads (weights), skipped by the record's key; so is anything over _MAX_KEYED_BYTES.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npz")
_MAX_KEYED_BYTES = 64 << 20
_KEYED_SUBDIRS = ("additional_chat_templates",)  # transformers 5 reads named templates from here
# The record an artifact carries (written by the builder, save_artifact_record): valid where the versions it names
# are this host's and the files it names still have the digests it names.
ARTIFACT_RECORD = "tokenizer.kiln.json"
# transformers' apply_chat_template arguments the light tokenizer does not implement (refused, not rendered).
_NOT_OFFERED = ("continue_final_message", "sanitize_control_tokens", "return_dict", "return_assistant_tokens_mask",
                "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")


@functools.cache
def _versions() -> dict[str, str]:
    """The libraries that resolve a tokenizer, by version (once per process: every load keys on them)."""
    out = {}
    for dist in ("transformers", "tokenizers", "jinja2"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "none"
    return out


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _keyed_files(root: Path) -> list[Path]:
    files = [p for p in root.iterdir() if p.is_file()]
    for sub in _KEYED_SUBDIRS:
        if (root / sub).is_dir():
            files += [p for p in (root / sub).iterdir() if p.is_file()]
    return sorted(p for p in files if not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != ARTIFACT_RECORD
                  and p.stat().st_size <= _MAX_KEYED_BYTES)


def record_key(model_dir: str | os.PathLike) -> str | None:
    """The digest a record is filed under: the model directory's small files by name and content, and the
    libraries that read them; None when the directory cannot be read."""
    digest = hashlib.sha256(f"kiln-tokenizer-record/{RECORD_FORMAT}\n".encode())
    for dist, ver in _versions().items():
        digest.update(f"{dist}={ver}\n".encode())
    try:
        root = Path(model_dir)
        for path in _keyed_files(root):
            data = path.read_bytes()
            digest.update(f"{path.relative_to(root)}\0{len(data)}\0".encode())
            digest.update(data)
    except OSError:
        return None
    return digest.hexdigest()


def _record_path(key: str) -> Path:
    return host_cache_dir("tokenizers") / f"{key}.json"


def why_not_recordable(tokenizer: Any) -> str | None:
    """None when the backend, special tokens and chat template say all the tokenizer does; else why not."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return "this transformers has no TokenizersBackend"
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend):
        return f"{cls.__name__} is not a fast (Rust) tokenizer"
    overridden = [m for m in SERVED_METHODS if getattr(cls, m, None) is not getattr(TokenizersBackend, m, None)]
    if overridden:
        return f"{cls.__name__} overrides {', '.join(overridden)}"
    if getattr(tokenizer, "split_special_tokens", False):
        return "split_special_tokens is set"
    if _decode_cleans(tokenizer):
        return "its decode cleans up tokenization spaces"
    return None


def _decode_cleans(tokenizer: Any) -> bool:
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    return not bpe or bool(getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                                   False))


def make_record(tokenizer: Any) -> dict[str, Any] | None:
    """What a :class:`LightTokenizer` is built from, of ``tokenizer`` (loaded by transformers); None, logged,
    when it cannot have one."""
    why = why_not_recordable(tokenizer)
    if why is not None:
        log.info("tokenizer loaded through transformers at every start: %s", why)
        return None
    special = dict(tokenizer.special_tokens_map)
    return {"format": RECORD_FORMAT, "class": type(tokenizer).__name__,
            "backend": tokenizer.backend_tokenizer.to_str(), "special_tokens_map": special,
            "special_ids": {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in special.items()
                            if isinstance(tok, str)},
            "all_special_ids": list(tokenizer.all_special_ids), "chat_template": tokenizer.chat_template}


def _write(path: Path, record: dict[str, Any]) -> Path | None:
    try:
        text = json.dumps(record)  # everything in it is plain data, or there is no record
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        log.warning("tokenizer record not written (%s): the next load goes through transformers again", exc)
        return None
    return path


def save_record(key: str, tokenizer: Any) -> Path | None:
    """Write the record of ``tokenizer`` on this host's cache under ``key``, atomically (None: not written)."""
    record = make_record(tokenizer)
    return None if record is None else _write(_record_path(key), record)


def save_artifact_record(model_dir: str | os.PathLike, tokenizer: Any, names: Sequence[str]) -> Path | None:
    """The builder's record, in the artifact itself (:data:`ARTIFACT_RECORD`): a pod's first load of it then
    needs no transformers either. It names the files it was made from (``names`` present in ``model_dir``) by
    digest, and the versions that made it."""
    record = make_record(tokenizer)
    if record is None:
        return None
    root = Path(model_dir)
    record["files"] = {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names if (root / n).is_file()}
    record["versions"] = _versions()
    return _write(root / ARTIFACT_RECORD, record)


def _artifact_record(model_dir: str) -> dict[str, Any] | None:
    path = Path(model_dir) / ARTIFACT_RECORD
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("versions") != _versions():
        return None  # made by other versions of the libraries: this host resolves it again
    root = Path(model_dir)
    for name, digest in dict(record.get("files") or {}).items():
        if not (root / name).is_file() or hashlib.sha256((root / name).read_bytes()).hexdigest() != digest:
            return None
    return record


def load_light(model_dir: str, key: str | None) -> LightTokenizer | None:
    """The tokenizer from its record, or None (no record, another format, unreadable: transformers loads it)."""
    if key is None or not enabled():
        return None
    try:
        path = _record_path(key)
        record = json.loads(path.read_text()) if path.is_file() else _artifact_record(model_dir)
        if record is None or record.get("format") != RECORD_FORMAT:
            return None
        return LightTokenizer(record, model_dir)
    except Exception as exc:  # noqa: BLE001 (a record that does not load: transformers loads the tokenizer)
        log.warning("tokenizer record %s unreadable (%s): loading through transformers", key[:12], exc)
        return None


class LightTokenizer:
    """The part of transformers' tokenizer API serving uses, over the recorded backend (see the module doc)."""

    def __init__(self, record: Mapping[str, Any], model_dir: str) -> None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(record["backend"])
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False
        self._tokenizer = backend
        self.name_or_path = str(model_dir)
        self.special_tokens_map: dict[str, Any] = dict(record["special_tokens_map"])
        self._special_ids: dict[str, int] = dict(record["special_ids"])
        self.all_special_ids: list[int] = list(record["all_special_ids"])
        self.chat_template: str | dict[str, str] | None = record["chat_template"]

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    def _token(self, name: str) -> Any:
        return self.special_tokens_map.get(name)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    bos_token_id = property(lambda self: self._special_ids.get("bos_token"))
    eos_token_id = property(lambda self: self._special_ids.get("eos_token"))
    unk_token_id = property(lambda self: self._special_ids.get("unk_token"))
    pad_token_id = property(lambda self: self._special_ids.get("pad_token"))

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._tokenizer.id_to_token(i) for i in self.all_special_ids]

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not offered by kiln's light tokenizer")
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        return pick_template(self.chat_template, chat_template, tools)

    def apply_chat_template(self, conversation: Any, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """``tokenize=False``: the text; else its ids (no special tokens added: the template writes them)."""
        asked = sorted(k for k in _NOT_OFFERED if kwargs.get(k))
        if asked:
            raise NotImplementedError(f"kiln's light tokenizer does not offer {', '.join(asked)}")
        source = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        text = render(source, conversation, self.special_tokens_map, tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text
