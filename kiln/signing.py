"""Signed engines: the builder signs the manifest it publishes; a reader verifies it before using a file.

The manifest lists every file of an engine with its sha256, the envelope and ``built_by``, so one
signature over it covers the whole artifact: a reader that verifies the manifest, then checks each file
it downloads against the manifest's digests (``ArtifactStore.fetch`` does), has checked every byte.

What is signed is the manifest as stored, less its ``signature`` field, as canonical JSON (keys sorted,
no spaces, UTF-8), so a field a newer kiln adds is covered too and a reader needs no schema to verify.
Keys are PEM files as ``openssl genpkey`` writes them: ECDSA P-256 (signed over SHA-256) or Ed25519;
the signature names the key by ``key_id``, the sha256 of its public key (SubjectPublicKeyInfo DER).

kiln signs with ``cryptography`` directly rather than the OpenSSF ``model-signing`` library: that
library signs a directory by hashing every file where it lies, so a serving pod would have to download
and read the whole engine before it could refuse it, and it brings sigstore's client stack with it;
kiln's manifest already holds the digests, and its signature is checked before a single file is fetched.
See docs/operator-trust.md (keys, rotation, the threat table).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

SIGNING_KEY_ENV = "KILN_SIGNING_KEY"
VERIFY_KEY_ENV = "KILN_VERIFY_KEY"
SIGNATURE_FIELD = "signature"


class SigningError(Exception):
    """A key or signature problem; ``str(e)`` is one line naming the key or artifact and the fix."""


def canonical_payload(document: dict[str, Any]) -> bytes:
    """The bytes a manifest's signature covers: the document less its signature, as canonical JSON."""
    body = {k: v for k, v in document.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _key_id(public_key: Any) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:32]


def _algorithm(key: Any) -> str:
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return "ed25519"
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) and key.curve.name == "secp256r1":
        return "ecdsa-p256-sha256"
    return ""


def _read_pem(path: str | Path, what: str, flag: str, env: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        # A verify key is the signing key's public half: a new key pair would verify nothing already signed.
        make = ("openssl genpkey -algorithm ed25519 -out key.pem" if what == "private key"
                else "the signing key's public half: openssl pkey -in key.pem -pubout -out key.pub")
        raise SigningError(f"{flag} {path}: cannot read the {what} ({exc.strerror}); give a PEM file "
                           f"({make}) or set ${env}") from None


@dataclass(frozen=True)
class Signer:
    """A private key that signs manifests (``kiln build --signing-key``)."""

    key: Any
    key_id: str
    algorithm: str

    @classmethod
    def from_pem(cls, path: str | Path, flag: str = "--signing-key") -> Signer:
        data = _read_pem(path, "private key", flag, SIGNING_KEY_ENV)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise SigningError(f"{flag} {path}: not an unencrypted PEM private key ({exc}); write one with "
                               "`openssl genpkey -algorithm ed25519 -out key.pem`") from None
        algorithm = _algorithm(key)
        if not algorithm:
            raise SigningError(f"{flag} {path}: kiln signs with Ed25519 or ECDSA P-256 keys; write one with "
                               "`openssl genpkey -algorithm ed25519 -out key.pem`")
        return cls(key, _key_id(key.public_key()), algorithm)

    def sign(self, document: dict[str, Any]) -> dict[str, str]:
        """The ``signature`` field for ``document`` (a manifest as JSON-ready data)."""
        payload = canonical_payload(document)
        if self.algorithm == "ed25519":
            raw = self.key.sign(payload)
        else:
            raw = self.key.sign(payload, ec.ECDSA(hashes.SHA256()))
        return {"algorithm": self.algorithm, "key_id": self.key_id, "value": base64.b64encode(raw).decode()}

    def public_pem(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class Verifier:
    """A public key that manifests must be signed by (``kiln serve --verify-key``)."""

    key: Any
    key_id: str
    algorithm: str

    @classmethod
    def from_pem(cls, path: str | Path, flag: str = "--verify-key") -> Verifier:
        return cls.from_pem_data(_read_pem(path, "public key", flag, VERIFY_KEY_ENV), f"{flag} {path}")

    @classmethod
    def from_pem_data(cls, data: bytes, source: str) -> Verifier:
        """The key in PEM ``data``; ``source`` names where it came from in an error (a flag and path, a Secret)."""
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as exc:
            raise SigningError(f"{source}: not a PEM public key ({exc}); derive it from the signing key "
                               "with `openssl pkey -in key.pem -pubout -out key.pub`") from None
        algorithm = _algorithm(key)
        if not algorithm:
            raise SigningError(f"{source}: kiln verifies Ed25519 or ECDSA P-256 keys")
        return cls(key, _key_id(key), algorithm)

    def problem(self, document: dict[str, Any]) -> str | None:
        """Why ``document`` (a manifest as stored) is not signed by this key; None when it is."""
        sig = document.get(SIGNATURE_FIELD)
        if not isinstance(sig, dict) or not sig.get("value"):
            return "it is not signed (build it with a signing key: kiln build --signing-key)"
        if sig.get("key_id") != self.key_id or sig.get("algorithm") != self.algorithm:
            return (f"it is signed by key {str(sig.get('key_id'))[:16]}... ({sig.get('algorithm')}), not by the "
                    f"verify key {self.key_id[:16]}... ({self.algorithm})")
        try:
            raw = base64.b64decode(str(sig["value"]), validate=True)
            if self.algorithm == "ed25519":
                self.key.verify(raw, canonical_payload(document))
            else:
                self.key.verify(raw, canonical_payload(document), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            return "its signature does not match its content (the manifest was changed after it was signed)"
        return None


def signer_from(path: str | Path | None, env: Mapping[str, str] = os.environ) -> Signer | None:
    """The flag's key, else ``$KILN_SIGNING_KEY``'s, else None (publish unsigned)."""
    path = path or env.get(SIGNING_KEY_ENV, "").strip() or None
    return Signer.from_pem(path) if path else None


def verifier_from(path: str | Path | None, env: Mapping[str, str] = os.environ) -> Verifier | None:
    """The flag's key, else ``$KILN_VERIFY_KEY``'s, else None (no signature check)."""
    path = path or env.get(VERIFY_KEY_ENV, "").strip() or None
    return Verifier.from_pem(path) if path else None


def generate_key_pair(directory: str | Path) -> tuple[Path, Path]:
    """A new Ed25519 pair as ``signing-key.pem`` (mode 0600) and ``verify-key.pem`` in ``directory``;
    kept when both exist already (``kiln up``'s local pair, made on first use)."""
    directory = Path(directory)
    private, public = directory / "signing-key.pem", directory / "verify-key.pem"
    if private.is_file() and public.is_file():
        return private, public
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    private_pem, public_pem = new_key_pair_pem()
    tmp = directory / f".signing-key.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public.write_bytes(public_pem)
    os.replace(tmp, private)
    return private, public


def new_key_pair_pem() -> tuple[bytes, bytes]:
    """A fresh Ed25519 key pair as (private PKCS#8 PEM, public SubjectPublicKeyInfo PEM)."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public
