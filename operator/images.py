"""Container image references and the operator's image allowlist: parsing and matching only.

A reference is normalized the way container runtimes resolve it (``nginx`` is
``docker.io/library/nginx:latest``), so an allowlist entry and an image match on
what would actually be pulled. Allowlist entries (chart value ``allowedImages``,
``KILN_ALLOWED_IMAGES``) take four forms:

- ``registry.example.com/team/builder:1.2`` — that tag; also any digest-pinned form
  of that repository (``...builder@sha256:…``, ``...builder:1.2@sha256:…``). A tag is
  mutable, so trusting it already trusts whatever the repository's owners push;
  a digest of the same repository is no wider.
- ``registry.example.com/team/builder@sha256:<64 hex>`` — exactly that digest.
- ``registry.example.com/team/builder`` — any tag or digest of that repository.
- ``registry.example.com/team/*`` — any image in any repository under that path.

The chart's own images are always allowed, as repositories (any tag or digest), so
artifacts built before a chart upgrade stay trusted after it. See docs/operator-trust.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_DOMAIN = "docker.io"
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_DOMAIN = re.compile(r"^(?:localhost|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                     r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)(?::[0-9]+)?$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImageRef:
    repository: str  # normalized: "<domain>/<path>", e.g. "docker.io/library/nginx"
    tag: str | None  # None when absent (pulled as "latest" unless a digest is given)
    digest: str | None  # "sha256:..."

    @property
    def effective_tag(self) -> str | None:
        return self.tag or (None if self.digest else "latest")


def _split_repository(name: str) -> str:
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        domain, path = parts[0], parts[1:]
    else:
        domain, path = DEFAULT_DOMAIN, (parts if len(parts) > 1 else ["library", *parts])
    if domain == "index.docker.io":
        domain = DEFAULT_DOMAIN
    if not _DOMAIN.match(domain):
        raise ValueError(f"registry {domain!r} is not a host name")
    for part in path:
        if not _COMPONENT.match(part):
            raise ValueError(f"path component {part!r} must be lowercase letters and digits, "
                             "separated by '.', '_', '__' or '-'")
    return f"{domain}/{'/'.join(path)}"


def parse_image(ref: str) -> ImageRef:
    """Parse ``[registry/]path[:tag][@sha256:digest]``; ValueError (saying what is wrong) otherwise."""
    if not ref or ref != ref.strip():
        raise ValueError("empty, or surrounded by whitespace")
    name, at, digest = ref.partition("@")
    if at and not _DIGEST.match(digest):
        raise ValueError(f"digest {digest!r} is not sha256:<64 lowercase hex>")
    head, slash, last = name.rpartition("/")
    tag = None
    if ":" in last:
        last, tag = last.split(":", 1)
        if not _TAG.match(tag):
            raise ValueError(f"tag {tag!r} is not a valid tag")
    return ImageRef(_split_repository(head + slash + last), tag, digest or None)


@dataclass(frozen=True)
class AllowEntry:
    text: str
    prefix: str | None = None  # "<domain>/<path>/" for "<path>/*"
    ref: ImageRef | None = None

    def matches(self, image: ImageRef) -> bool:
        if self.prefix is not None:
            return image.repository.startswith(self.prefix)
        assert self.ref is not None
        if image.repository != self.ref.repository:
            return False
        if self.ref.digest:
            return image.digest == self.ref.digest
        if self.ref.tag:
            return image.digest is not None or image.effective_tag == self.ref.tag
        return True


def parse_allow_entry(text: str) -> AllowEntry:
    """One allowlist entry (forms in the module docstring); ValueError saying what is wrong."""
    if text.endswith("/*"):
        head = text[:-2]
        if "/" not in head:  # "registry.example.com/*" (a whole registry) or "team/*" (a Docker Hub namespace)
            looks_like_host = "." in head or ":" in head or head == "localhost"
            if not (_DOMAIN if looks_like_host else _COMPONENT).match(head):
                raise ValueError(f"{head!r} is neither a registry host nor a repository path")
            return AllowEntry(text, prefix=f"{head if looks_like_host else DEFAULT_DOMAIN + '/' + head}/")
        return AllowEntry(text, prefix=_split_repository(head) + "/")
    if "*" in text:
        raise ValueError("'*' is only allowed as a whole last path segment, as in registry.example.com/team/*")
    return AllowEntry(text, ref=parse_image(text))


def repository_entry(image: str) -> AllowEntry:
    """Any tag or digest of ``image``'s repository (how the chart's own images are allowed)."""
    ref = parse_image(image)
    return AllowEntry(ref.repository, ref=ImageRef(ref.repository, None, None))


def image_allowed(image: str, entries: list[AllowEntry]) -> bool:
    """Whether ``image`` parses and some entry matches it."""
    try:
        ref = parse_image(image)
    except ValueError:
        return False
    return any(entry.matches(ref) for entry in entries)
