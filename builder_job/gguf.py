"""GGUF files (llama.cpp, Ollama) as a model source: inspect, verify, turn into a checkpoint directory.

A GGUF file holds the config, the tokenizer (with its chat template) and the
weights, usually block-quantized (Q4_0, Q4_1, Q8_0, K-quants, ...). The builder's
fetch stage turns it into the working checkpoint everything downstream reads:
``config.json``, tokenizer files with the chat template, ``generation_config.json``
and ``model.safetensors`` with the weights dequantized to float32 (transformers'
GGUF loader, backed by the ``gguf`` package), plus the file's Q8_0/Q4_0/Q4_1 tensors as they are
(``gguf-blocks/``, :mod:`kiln.builder.gguf_artifact`), which ``quantization: gguf`` ships. The convert stage then casts them to
the envelope's dtype as for any checkpoint, and the quality gate's reference is the
dequantized GGUF in float32: the build is measured against the file the user gave.

Before anything is dequantized, the file's header is read (no tensor data) and a
file whose architecture the runtime does not implement, or whose tensor types the
dequantizer does not know, is refused with one line naming them. The file's
sha256 is recorded, and checked when ``spec.model.revision`` is a 64-hex sha256
(file://, s3://, pvc:// sources, whose revision is otherwise only a label).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kiln.builder.errors import FetchError
from kiln.builder.model_facts import supported_architectures as runtime_architectures

from kiln.artifact_manifest import file_sha256

log = logging.getLogger("kiln.build.gguf")

GGUF_SUFFIX = ".gguf"
# GGUF general.architecture -> the runtime's architecture (config.json "architectures").
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
# Unquantized tensor types; the quantized ones are whatever gguf.quants can dequantize.
PLAIN_TYPES = ("F32", "F16", "BF16")
MARKER = ".kiln-gguf.json"  # in a converted directory: which file (sha256) it was made from


def is_gguf(name: str | None) -> bool:
    return bool(name) and name.lower().endswith(GGUF_SUFFIX)


def is_sha256(value: str | None) -> bool:
    """A 64-hex revision of a file:// / s3:// / pvc:// GGUF source is the file's sha256 (checked at fetch)."""
    return bool(value) and len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value)


@dataclass
class GGUFInfo:
    file: str
    sha256: str
    num_bytes: int
    architecture: str  # the GGUF's general.architecture
    tensor_types: dict[str, int]  # type name -> tensors
    name: str | None = None  # general.name
    reader: object = field(default=None, repr=False, compare=False)  # the parsed header, reused by convert

    def to_dict(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "bytes": self.num_bytes,
                "architecture": self.architecture, "tensor_types": dict(sorted(self.tensor_types.items())),
                "name": self.name}


def supported_tensor_types() -> tuple[str, ...]:
    """Tensor types the dequantizer handles (plain floats + every quant type gguf.quants implements)."""
    import gguf.quants  # deferred: the optional `gguf` package (kiln[build]) only for GGUF sources

    return tuple(sorted({*PLAIN_TYPES, *(t.name for t in getattr(gguf.quants, "_type_traits", {}))}))


def supported_architectures() -> dict[str, str]:
    """GGUF architectures both transformers' GGUF loader and the kiln runtime implement."""
    try:  # deferred: it imports torch, and the fetch path (kiln.builder.prefetch) is torch-free
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - an older transformers
        GGUF_SUPPORTED_ARCHITECTURES = list(GGUF_ARCHITECTURES)
    runtime = set(runtime_architectures())
    return {k: v for k, v in GGUF_ARCHITECTURES.items() if k in GGUF_SUPPORTED_ARCHITECTURES and v in runtime}


def _field_str(reader, key: str) -> str | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
    except (IndexError, TypeError):
        return None


def _field_int(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return int(f.parts[f.data[0]][0])
    except (IndexError, TypeError, ValueError):
        return None


def _head_dim_config(folder: str, name: str, info: GGUFInfo) -> dict:
    """``from_pretrained``'s config where transformers' GGUF mapping misses the file's head size: it reads no
    ``attention.key_length`` for some architectures (qwen3 in 5.24), so ``head_dim`` would be the config class's
    default (Qwen3's 128) whatever the file's heads are. Empty where the mapping got it right."""
    from transformers import AutoConfig  # deferred: as convert_gguf's

    key_length = _field_int(info.reader, f"{info.architecture}.attention.key_length")
    if key_length is None:
        return {}
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if getattr(config, "head_dim", key_length) == key_length:
        return {}
    config.head_dim = key_length
    return {"config": config}


def inspect_gguf(path: Path, source: str, expected_sha256: str | None = None) -> GGUFInfo:
    """Header facts of a GGUF file; :class:`FetchError` for a file kiln cannot build from."""
    try:  # deferred: the optional `gguf` package (kiln[build]); without it, a FetchError naming the fix
        from gguf import GGUFReader
    except ImportError:
        raise FetchError(f"spec.model.source: {source} is a GGUF file, which needs the `gguf` package; "
                         "install kiln[build]") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - a malformed file can fail in many ways inside the reader
        raise FetchError(f"spec.model.source: {source} is not a readable GGUF file ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'bad header'})") from None
    arch = _field_str(reader, "general.architecture") or "?"
    types = Counter(t.tensor_type.name for t in reader.tensors)
    archs = supported_architectures()
    if arch not in archs:
        raise FetchError(f"spec.model.source: {source} is a GGUF of architecture {arch!r}, which kiln cannot "
                         f"build; supported GGUF architectures: {', '.join(sorted(archs))}")
    known = set(supported_tensor_types())
    unknown = sorted(set(types) - known)
    if unknown:
        raise FetchError(f"spec.model.source: {source} has GGUF tensor types kiln cannot dequantize: "
                         f"{', '.join(unknown)}; re-export it with one of {', '.join(sorted(known))}")
    digest = file_sha256(path)
    if expected_sha256 and digest != expected_sha256.lower():
        raise FetchError(f"spec.model.revision: {source} has sha256 {digest}, not {expected_sha256}; point "
                         "spec.model.source at the intended file, or set spec.model.revision to its sha256")
    return GGUFInfo(file=path.name, sha256=digest, num_bytes=path.stat().st_size, architecture=arch,
                    tensor_types=dict(types), name=_field_str(reader, "general.name"), reader=reader)


@contextlib.contextmanager
def _memoized_gguf_parsing(path: Path, parsed=None):
    """transformers' GGUF loader parses the file's header three times (config, tokenizer, weights) and
    rebuilds gguf's tensor-name map once per tensor; both are pure, so memoize them while converting
    (SmolLM2-135M: ~33 s -> ~10 s on one core). Restored afterwards."""
    import gguf as gguf_pkg  # deferred: the optional `gguf` package (kiln[build]) only for GGUF sources

    real_reader, real_map = gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map
    readers: dict = {(str(path), "r"): parsed} if parsed is not None else {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map = reader, functools.lru_cache(maxsize=16)(real_map)
    try:
        yield
    finally:
        gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map = real_reader, real_map
        readers.clear()


def convert_gguf(path: Path, info: GGUFInfo, dest: Path) -> Path:
    """Write the checkpoint directory for ``path`` into ``dest`` (reused when already made from this file)."""
    from kiln.builder import gguf_artifact  # deferred: torch; the cache-hit path imports this module

    marker = dest / MARKER
    if marker.is_file() and (dest / gguf_artifact.BLOCKS_DIR / gguf_artifact.BLOCKS_FILE).is_file():
        try:
            if json.loads(marker.read_text()).get("sha256") == info.sha256:
                log.info("reusing %s, converted from %s (sha256 %s)", dest, info.file, info.sha256[:12])
                return dest
        except (OSError, json.JSONDecodeError):
            pass
    # Deferred: torch and transformers, where the fetch path (kiln.builder.prefetch) is otherwise torch-free.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    log.info("dequantizing %s (%s, %s) to float32", info.file, info.architecture,
             ", ".join(f"{n} {k}" for k, n in sorted(info.tensor_types.items())))
    folder, name = str(path.parent), path.name
    with _memoized_gguf_parsing(path, info.reader):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:  # noqa: BLE001 - transformers fails in many ways on missing/odd metadata
            shutil.rmtree(dest, ignore_errors=True)
            raise FetchError(f"spec.model.source: {info.file} carries no tokenizer kiln can read "
                             f"(tokenizer.ggml.* metadata; {type(exc).__name__}: {str(exc)[:200]}); export the "
                             "GGUF with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it)") from None
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     **_head_dim_config(folder, name, info))
    # transformers will not save_pretrained a GGUF-loaded model (it counts as quantized): write the
    # dequantized tensors, the config without its GGUF quantization note, and the generation config.
    from safetensors.torch import save_file  # deferred: torch (as above)

    config = model.config
    config.architectures = [GGUF_ARCHITECTURES[info.architecture]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()
             if not (n == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt", "kiln_gguf_sha256": info.sha256})
    config.save_pretrained(str(dest))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    # the runnable block tensors as they are, for quantization gguf (kiln.builder.gguf_artifact)
    gguf_artifact.write_blocks(info.reader, info.architecture, config.to_dict(), dest)
    del model, state
    marker.write_text(json.dumps(info.to_dict(), indent=1))
    return dest
