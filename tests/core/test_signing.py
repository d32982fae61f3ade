"""Signed manifests (kiln.signing): keys as `openssl genpkey` writes them, and every way a manifest
can fail to be the one its builder signed."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from kiln.signing import Signer, SigningError, Verifier, generate_key_pair, signer_from, verifier_from

DOCUMENT = {"engine_version": "tiny-0123", "files": [{"path": "a", "sha256": "0" * 64, "size": 1}],
            "envelope": {"dtype": "float32", "kv": {"memory_fraction": 0.9}}, "built_by": None}


def _openssl_pair(tmp_path, name, *algorithm):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, pub = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub"
    subprocess.run(["openssl", "genpkey", *algorithm, "-out", str(key)], check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True,
                   capture_output=True)
    return key, pub


@pytest.mark.parametrize("algorithm", [("-algorithm", "ed25519"),
                                       ("-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256")])
def test_openssl_keys_sign_and_verify(tmp_path, algorithm):
    key, pub = _openssl_pair(tmp_path, "k", *algorithm)
    signed = {**DOCUMENT, "signature": Signer.from_pem(key).sign(DOCUMENT)}
    stored = json.loads(json.dumps(signed, indent=2))  # as the store holds it
    assert Verifier.from_pem(pub).problem(stored) is None


def test_every_tampering_is_refused(tmp_path):
    private, public = generate_key_pair(tmp_path / "keys")
    other_private, _ = generate_key_pair(tmp_path / "other")
    verifier = Verifier.from_pem(public)
    signed = {**DOCUMENT, "signature": Signer.from_pem(private).sign(DOCUMENT)}
    assert verifier.problem(signed) is None
    assert "not signed" in verifier.problem(DOCUMENT)
    by_other = {**DOCUMENT, "signature": Signer.from_pem(other_private).sign(DOCUMENT)}
    assert "signed by key" in verifier.problem(by_other)
    for changed in ({"files": [{"path": "a", "sha256": "1" * 64, "size": 1}]},
                    {"built_by": {"builder_image": "evil", "operator": "x"}},
                    {"added_by_a_newer_kiln": 1}):
        assert "does not match its content" in verifier.problem({**signed, **changed})
    forged = {**signed, "signature": {**signed["signature"], "value": "AAAA"}}
    assert "does not match" in verifier.problem(forged)


def test_key_files_and_errors_name_the_flag(tmp_path, monkeypatch):
    private, public = generate_key_pair(tmp_path)
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    assert generate_key_pair(tmp_path) == (private, public)  # kept on the next use
    assert private.read_bytes() == generate_key_pair(tmp_path)[0].read_bytes()
    with pytest.raises(SigningError, match="--signing-key .*missing.pem: cannot read"):
        Signer.from_pem(tmp_path / "missing.pem")
    with pytest.raises(SigningError, match="--verify-key .*: not a PEM public key"):
        Verifier.from_pem(private)
    monkeypatch.delenv("KILN_SIGNING_KEY", raising=False)
    monkeypatch.delenv("KILN_VERIFY_KEY", raising=False)
    assert signer_from(None) is None and verifier_from(None) is None
    monkeypatch.setenv("KILN_VERIFY_KEY", str(public))
    assert verifier_from(None).key_id == Signer.from_pem(private).key_id


def test_a_missing_verify_key_says_to_derive_it_not_to_make_a_new_pair(tmp_path):
    """A fresh `openssl genpkey` key verifies nothing already signed: a verify key is the signing key's public half."""
    with pytest.raises(SigningError) as err:
        Verifier.from_pem(tmp_path / "verify-key.pem")
    assert "cannot read the public key" in str(err.value) and "genpkey" not in str(err.value)
    assert "openssl pkey -in key.pem -pubout -out key.pub" in str(err.value)
    with pytest.raises(SigningError, match="openssl genpkey -algorithm ed25519"):  # a signing key may be new
        Signer.from_pem(tmp_path / "signing-key.pem")
