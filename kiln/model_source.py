"""``spec.model``: where the checkpoint comes from (hf://, s3://, file://, pvc://) and how it is pinned.

The CRD carries one pattern for every scheme (:data:`SOURCE_PATTERN`); the Python check
takes the scheme first and matches its own pattern, so ``kiln plan`` names the scheme and an
example of a well-formed source.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from kiln.api_base import DNS1123_SUBDOMAIN
from kiln.api_base import APIModel as _Model

# Where the builder finds a pvc:// source's claim mounted: $KILN_PVC_ROOT/<claim> (the operator's build Job sets it).
PVC_ROOT_ENV = "KILN_PVC_ROOT"
# One pattern for the CRD; Python checks each scheme separately for a precise message.
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"
    r"|file://(/|\./|\.\./)[^\s]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?)$"
)
# A GGUF file inside an hf:// repo: a relative path ending in .gguf (no '..' segment: ModelSource checks).
GGUF_FILE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._/-]*\.[gG][gG][uU][fF]$"
_SOURCE_RULES = {
    "hf": (r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", "hf://org/name"),
    "s3": (r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$", "s3://bucket/prefix"),
    "file": (r"^file://(/|\./|\.\./)[^\s]*$", "file:///absolute/path or file://./relative/path"),
    "pvc": (r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?$", "pvc://claim-name/sub/path"),
}


class ModelSource(_Model):
    source: str = Field(
        max_length=1024, json_schema_extra={"pattern": SOURCE_PATTERN},
        description="Where the checkpoint lives: hf://org/name (Hugging Face hub), s3://bucket/prefix, "
        "file:///absolute/path or file://./relative/path (relative to the working directory), or "
        "pvc://claim-name/sub/path (a PersistentVolumeClaim in the engine's namespace). A checkpoint "
        "directory (config.json, tokenizer, *.safetensors) or, except for hf://, one .gguf file.",
    )
    revision: str | None = Field(
        default=None, max_length=255, pattern=r"^[A-Za-z0-9._/-]+$",
        description="hf://: branch, tag or commit sha (pin a 40-hex commit sha; unset means main). "
        "Other sources: a label you bump when the files change, since the engine version cannot see them; "
        "for a .gguf file, 64 hex digits are its sha256, checked when the build fetches it.",
    )
    file: str | None = Field(
        default=None, max_length=512, pattern=GGUF_FILE_PATTERN,
        description="hf:// only: the .gguf file in the repo to build from (e.g. model.Q4_K_M.gguf); unset means "
        "the repo's safetensors checkpoint.",
    )
    credentials_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret in the engine's namespace with HF_TOKEN (hf://) or AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY (s3://) keys; only valid for hf:// and s3:// sources.",
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if scheme not in _SOURCE_RULES:
            raise ValueError(
                f"unsupported model source {value!r}; use hf://org/name, s3://bucket/prefix, "
                "file:///path or pvc://claim/path"
            )
        pattern, example = _SOURCE_RULES[scheme]
        if not re.fullmatch(pattern, value):  # as the CRD (RE2) reads $: the end, no newline after
            space = "; it holds whitespace, which a source may not: move or link the checkpoint to a path without " \
                "it" if re.search(r"\s", value) and scheme != "hf" else ""
            raise ValueError(f"malformed {scheme}:// source {value!r}; expected {example}{space}")
        return value

    @field_validator("file")
    @classmethod
    def _check_file(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError(f"{value!r} has a '..' segment; name the .gguf file by its path inside the repo")
        return value

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]


def scheme_problems(source: ModelSource, path: str) -> list[str]:
    """The fields ``source`` (at ``path`` in the spec: ``model``, ``speculative.draftModel``) sets that its
    scheme does not use, one ``<field path>: <what + fix>`` line each (the CRD's CEL rules' Python twins)."""
    problems = []
    if source.credentials_secret is not None and source.scheme not in ("hf", "s3"):
        problems.append(f"{path}.credentialsSecret: only used by hf:// and s3:// sources; remove it")
    if source.file is not None and source.scheme != "hf":
        problems.append(f"{path}.file: only used by hf:// sources; name the .gguf file in {path}.source instead")
    return problems
