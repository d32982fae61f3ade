"""The build envelope: exactly what changes a built engine, and the version derived from it.

Two manifests with the same envelope share one artifact, so a GitOps edit that
only touches replicas, labels, names, serving resources/image or build
image/timeout never triggers a rebuild. The envelope is a normalized, versioned
document; the engine version is ``<model-slug>-<sha256(canonical JSON), all 64 hex>``: the full digest names
the content in store keys, manifests, signatures and ``status.version``. :func:`short_version` (12 hex) is
for display only, and Kubernetes names and label values bound a version in ``kiln.operator.naming``.

What is in, and why:

- the model source (normalized: scheme kept, trailing and duplicate ``/`` and ``./``
  segments removed; relative ``file://`` paths stay relative so a version does not
  depend on where the repository is cloned) and its revision (``main`` for an
  unpinned ``hf://``). For ``file://``, ``s3://`` and ``pvc://`` the revision is the
  user's label: the version is computed before anything is fetched, so bump
  ``revision`` when the files change.
- for a GGUF source, the file's identity: its name is in the source (file://, s3://,
  pvc://) or in ``model.file`` (hf://, added to the document only when set, so the
  versions of safetensors sources are unchanged), and its revision is the repo commit
  (hf://) or, for the other sources, a label or the file's sha256 (64 hex digits,
  checked when the build fetches the file). The slug is the file's name without
  ``.gguf``, so ``SmolLM2-135M-Instruct.Q4_1.gguf`` reads ``smollm2-135m-instruct-q4-1``.
- dtype, quantization, the *resolved* KV-cache dtype (``auto`` becomes ``dtype``, so
  spelling it out does not rebuild), tensor-parallel degree, the pipeline-parallel degree
  (``pipeline_parallel``, in the document only when > 1, so every engine version from
  before pipeline parallelism is unchanged: its artifact has one file per (stage, TP rank)
  and each stage's KV plan covers only its layers), the four max shapes and
  the KV options: they decide the weights written, their sharding, the KV plan and
  the CUDA-graph buckets recorded in ``engine.json``. Prefix caching and the memory
  fraction are recorded there too, so they are in.
- ``spec.speculative`` when its method is not ``off`` (absent otherwise, so ``method: off``, an
  unset field and every version from before speculation are the same): the build measures where
  speculation pays and ships that table in ``engine.json``, so the method, k and the lookup
  lengths decide the artifact. With ``off`` the other three fields are ignored, so they are out.
  With ``draft_model`` the draft checkpoint's identity (normalized like the model's: its weights are
  converted into the artifact) takes the place of the lookup lengths, which it does not use.
- ``spec.lora``'s slot limits when it is set (absent otherwise, so every version from before LoRA is
  unchanged): ``max_loras`` and ``max_lora_rank`` size the device slots the runtime reserves beside the KV
  pool, and ``max_cpu_loras`` (resolved: unset is ``max_loras``) is recorded in ``engine.json`` like every
  setting there, so a pod runs what its artifact says. The adapter list is out: each adapter is an
  artifact of its own (:func:`adapter_version`), so adding or removing one never rebuilds the engine.
- the GPU's architecture *and* memory size, not its SKU name: kernels are specific to
  the architecture, and the builder sizes the KV pool for the target's memory, so
  L4 and L40S (both sm89) get different artifacts while a renamed SKU with the same
  arch and memory would share one.
- ``ARTIFACT_FORMAT_VERSION`` (bumped when the artifact layout or its meaning changes)
  and ``ENVELOPE_VERSION`` (bumped when this document's fields change).

What is out: ``gpusPerNode`` (how ranks are packed into pods; the per-rank files are the
same whether a replica is one pod or a LeaderWorkerSet group), the quality-gate thresholds and calibration prompts decide whether an
artifact is *published*, not its bytes (quantization scales are per-channel absmax
of the weights, not calibrated), so relaxing a threshold after a failed gate builds
the same version again rather than a new one. If a builder ever derives weights from
calibration data, those inputs must join the envelope and ENVELOPE_VERSION must bump.
The kiln version is out too: a kiln upgrade that changes artifacts bumps
ARTIFACT_FORMAT_VERSION instead of rebuilding every engine on every release.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

from kiln.api import LLMEngine, LLMEngineSpec
from kiln.model_source import ModelSource

ARTIFACT_FORMAT_VERSION = 1
ENVELOPE_VERSION = 1
HASH_CHARS = 64  # a version carries the envelope's whole SHA-256: a 48-bit prefix could be ground
SHORT_HASH_CHARS = 12  # short_version's, for logs and tables only; never an identity
# The slug keeps a short version within 45 characters (room for a prefix such as "kiln-build-" in a name of 63).
MAX_SLUG_LEN = 32
MAX_VERSION_LEN = MAX_SLUG_LEN + 1 + HASH_CHARS  # 97; a store version allows 255 (kiln.artifact_manifest)
_DIGEST = re.compile(rf"[0-9a-f]{{{HASH_CHARS}}}")


def build_envelope(spec: LLMEngineSpec | LLMEngine) -> dict[str, Any]:
    """The normalized document the engine version hashes (snake_case keys, JSON types only)."""
    spec = spec.spec if isinstance(spec, LLMEngine) else spec
    gpu = spec.gpu_spec
    envelope = {
        "envelope_version": ENVELOPE_VERSION,
        "artifact_format_version": ARTIFACT_FORMAT_VERSION,
        "model": _model(spec),
        "gpu": {"arch": gpu.arch, "memory_gib": gpu.memory_gib},
        "dtype": spec.dtype,
        "quantization": spec.quantization,
        "kv_cache_dtype": spec.resolved_kv_cache_dtype,
        "tensor_parallel": spec.tensor_parallel,
        "max_batch_size": spec.max_batch_size,
        "max_input_len": spec.max_input_len,
        "max_seq_len": spec.max_seq_len,
        "max_num_tokens": spec.max_num_tokens,
        "kv": {
            "block_size": spec.kv.block_size,
            "enable_prefix_caching": spec.kv.enable_prefix_caching,
            "memory_fraction": spec.kv.memory_fraction,
        },
    }
    if spec.pipeline_parallel > 1:  # absent at 1: versions from before pipeline parallelism stay the same
        envelope["pipeline_parallel"] = spec.pipeline_parallel
    if spec.speculative is not None and spec.speculative.is_on:  # absent when off: earlier versions stay
        envelope["speculative"] = {
            "method": spec.speculative.method,
            "num_speculative_tokens": spec.speculative.num_speculative_tokens,
        }
        if spec.speculative.method == "ngram":
            envelope["speculative"].update(prompt_lookup_max=spec.speculative.prompt_lookup_max,
                                           prompt_lookup_min=spec.speculative.prompt_lookup_min)
        else:  # a draft model's identity instead of the lookup lengths it does not use
            envelope["speculative"]["draft_model"] = _source(spec.speculative.draft_model)
    if spec.lora is not None:  # absent without LoRA: earlier versions stay; the adapter list is never in
        envelope["lora"] = {"max_loras": spec.lora.max_loras, "max_lora_rank": spec.lora.max_lora_rank,
                            "max_cpu_loras": spec.lora.resolved_max_cpu_loras}
    return envelope


ADAPTER_KIND = "lora-adapter"


def adapter_envelope(base_version: str, adapter: Any) -> dict[str, Any]:
    """What an adapter's artifact version hashes: the base engine version it is built for and checked against
    (its dtype, shapes, maxLoraRank), and the adapter's identity (normalized source, revision: like a model's,
    the revision is the identity of ``file://``/``s3://``/``pvc://`` files, since the version is computed before
    anything is fetched; the file digests are recorded and signed in the artifact's manifest). Its name is out
    of the hash (it is in the version's readable part): renaming an adapter rebuilds nothing."""
    return {"kind": ADAPTER_KIND, "envelope_version": ENVELOPE_VERSION, "base_engine_version": base_version,
            "adapter": _source(adapter.model_source)}


def adapter_version(base_version: str, adapter: Any) -> str:
    """``<base engine version>-<adapter name>-<64 hex>``: at most 97 + 1 + 63 + 1 + 64 = 226 characters (a store
    version allows 255; Kubernetes names and labels derived from it are bounded by ``kiln.operator.naming``)."""
    return f"{base_version}-{adapter.name}-{envelope_digest(adapter_envelope(base_version, adapter))[:HASH_CHARS]}"


def _model(spec: LLMEngineSpec) -> dict[str, Any]:
    return _source(spec.model)


def _source(source: ModelSource) -> dict[str, Any]:
    """A checkpoint's identity: normalized source, revision (``main`` for an unpinned hf://), GGUF file."""
    model = {"source": normalize_source(source.source), "revision": _revision(source)}
    if source.file is not None:
        model["file"] = posixpath.normpath(source.file)
    return model


def canonical_json(envelope: dict[str, Any]) -> str:
    """Sorted keys, no whitespace, ASCII: the exact bytes that are hashed."""
    return json.dumps(envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def envelope_digest(envelope: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(envelope).encode()).hexdigest()


def envelope_mismatch(stored: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why a published manifest's envelope is not the one a spec hashes, or None. A version names the
    envelope's whole digest, but a store writer can put any envelope under any version: a cache hit must
    compare the whole envelope, or one engine would be served as another."""
    if envelope_digest(stored) == envelope_digest(expected):
        return None
    keys = sorted(set(stored) | set(expected))
    key = next((k for k in keys if canonical_json(stored.get(k)) != canonical_json(expected.get(k))), "?")
    return (f"its envelope's {key} is {stored.get(key)!r} where this spec's is {expected.get(key)!r} (envelope "
            f"sha256 {envelope_digest(stored)}, expected {envelope_digest(expected)})")


def engine_version(spec: LLMEngineSpec | LLMEngine) -> str:
    """``<model-slug>-<64 hex>``: lowercase letters, digits and '-', at most 97 characters."""
    spec = spec.spec if isinstance(spec, LLMEngine) else spec
    envelope = build_envelope(spec)
    named = envelope["model"].get("file") or envelope["model"]["source"]
    return f"{model_slug(named)}-{envelope_digest(envelope)[:HASH_CHARS]}"


def short_version(version: str) -> str:
    """A version for display: each 64-hex digest in it cut to 12 (``llama-3a0f…`` of 97 characters -> 45). Two
    versions can share a short form; compare, key and sign by the full version only."""
    return _DIGEST.sub(lambda m: m[0][:SHORT_HASH_CHARS], version)


def normalize_source(source: str) -> str:
    """One spelling per location: ``file://./a//b/`` -> ``file://./a/b``, ``s3://b/p/`` -> ``s3://b/p``."""
    scheme, rest = source.split("://", 1)
    if scheme == "file":
        path = posixpath.normpath(rest)
        if path.startswith("/"):
            return f"file://{path}"
        if path.startswith(".."):
            return f"file://{path}"
        return "file://./" if path == "." else f"file://./{path}"
    head, _, tail = rest.partition("/")
    tail = posixpath.normpath(tail).lstrip("/") if tail else ""
    return f"{scheme}://{head}/{tail}" if tail and tail != "." else f"{scheme}://{head}"


def model_slug(source: str) -> str:
    """A short readable name from the last path segment of the source: ``Llama-3.1-8B`` -> ``llama-3-1-8b``."""
    rest = source.split("://", 1)[-1].rstrip("/")
    name = rest.rsplit("/", 1)[-1]
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:MAX_SLUG_LEN].strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"m-{slug}"[:MAX_SLUG_LEN].strip("-")
    return slug


def _revision(source: ModelSource) -> str | None:
    if source.scheme == "hf":
        return source.revision or "main"
    return source.revision


def is_pinned(spec: LLMEngineSpec) -> bool:
    """False for an ``hf://`` source whose revision is not a 40-hex commit sha (it can move)."""
    if spec.model.scheme != "hf":
        return True
    return bool(spec.model.revision and re.fullmatch(r"[0-9a-f]{40}", spec.model.revision))
