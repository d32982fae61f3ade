"""The rendezvous of a rank group: every rank proves it holds the group's token before any tensor moves.

The rendezvous store (torch's TCPStore) is unauthenticated: anyone who reaches its port can write any
key. So nothing written there counts by itself: rank 0 admits a rank only for an HMAC, keyed by the
group token (``$KILN_GROUP_TOKEN``), over a nonce rank 0 chose, and answers with an HMAC of its own that
the rank checks in turn (docs/multi-node.md). A stray ``add`` or a forged proof never completes a group.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time

import torch.distributed as dist

log = logging.getLogger("kiln.engine")
TOKEN_ENV = "KILN_GROUP_TOKEN"


class JoinRefusedError(RuntimeError):
    """The group token of this rank and of the leader differ (or something else answered as the leader)."""


_NONCE, _PROOF, _VERDICT = "kiln/auth/nonce", "kiln/auth/proof/{}", "kiln/auth/verdict/{}"


def _mac(token: str, *fields: object) -> str:
    message = "|".join(("kiln-join-v1", *map(str, fields))).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())  # constant time, any text (a forged proof may be anything)


def _json_or_empty(raw: bytes) -> dict:
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        value = json.loads(raw.decode())
        if isinstance(value, dict):
            return {k: str(v) for k, v in value.items()}
    return {}


def rendezvous(store: dist.Store, rank_: int, world: int, token: str, deadline: float) -> None:
    """Return once every rank of ``world`` proved it holds ``token``, by ``deadline`` (``time.monotonic``).

    The store is unauthenticated, so nothing in it counts by itself: rank 0 writes a fresh nonce ``N`` with
    ``HMAC(token, "nonce", N, world)`` (and writes it again if another process replaces it); rank ``r`` writes
    ``{nonce: n_r, proof: HMAC(token, "join", N, world, r, n_r)}`` (``n_r`` its own fresh nonce) at
    ``kiln/auth/proof/r``; rank 0 admits ``r`` only for a proof it verifies, and answers each with a verdict
    MAC'd over ``n_r``: ``admit`` once all ``world - 1`` are admitted, or ``refuse`` (logged). A rank whose
    token differs cannot verify the nonce (for ``NONCE_GRACE_S``: a replaced one is written back) and exits
    at once, naming the token; one that verified it acts only on a verdict whose MAC verifies: a refusal (its
    proof was overwritten, or made over a replaced nonce) makes it prove again, and a verdict it cannot verify
    is a forgery and is ignored. So no process without the token can admit a rank, nor turn a real one away.
    """
    if rank_ == 0:
        _admit(store, world, token, deadline)
    else:
        _prove(store, rank_, world, token, deadline)


def _admit(store: dist.Store, world: int, token: str, deadline: float) -> None:
    nonce = secrets.token_hex(16)
    signed = json.dumps({"nonce": nonce, "mac": _mac(token, "nonce", nonce, world)}).encode()
    store.set(_NONCE, signed)
    admitted: dict[int, str] = {}
    seen: dict[int, bytes] = {}
    refused = 0
    while len(admitted) < world - 1:
        if store.get(_NONCE) != signed:  # another process replaced it: ranks would prove over the wrong one
            store.set(_NONCE, signed)
        for r in range(1, world):
            key = _PROOF.format(r)
            if r in admitted or not store.check([key]) or (raw := store.get(key)) == seen.get(r):
                continue
            seen[r] = raw
            claim = _json_or_empty(raw)
            theirs = claim.get("nonce", "")
            if theirs and _same(claim.get("proof", ""), _mac(token, "join", nonce, world, r, theirs)):
                admitted[r] = theirs
                continue
            refused += 1
            log.warning("refused a process joining as rank %d of %d: its proof of $%s does not match this "
                        "leader's (a rank with another token, or not a rank of this group)", r, world, TOKEN_ENV)
            mac = _mac(token, "refuse", nonce, world, r, theirs)
            store.set(_VERDICT.format(r), json.dumps({"nonce": theirs, "refused": "1", "mac": mac}))
        if len(admitted) < world - 1 and time.monotonic() > deadline:
            missing = [r for r in range(1, world) if r not in admitted]
            raise TimeoutError(f"{len(admitted) + 1} of {world} ranks joined (missing: ranks {missing})"
                               + (f"; refused {refused} join(s) whose ${TOKEN_ENV} differs" if refused else ""))
        time.sleep(0.05)
    for r, theirs in admitted.items():
        mac = _mac(token, "admit", nonce, world, r, theirs)
        store.set(_VERDICT.format(r), json.dumps({"nonce": theirs, "mac": mac}))


NONCE_GRACE_S = 3.0  # how long a rank waits for a nonce it can verify (the leader restores a replaced one)
_REFUSED = (f"the leader refused this rank: its ${TOKEN_ENV} differs from the leader's (the leader's nonce is not "
            f"signed with it; every rank of a group needs the same ${TOKEN_ENV})")


def _leader_nonce(store: dist.Store, world: int, token: str, deadline: float) -> tuple[str, bool]:
    """The leader's nonce, and whether its MAC verified within NONCE_GRACE_S of the first read (another process
    may replace it; the leader writes it back)."""
    while not store.check([_NONCE]):
        if time.monotonic() > deadline:
            raise TimeoutError("the leader's store is up but it has not started the rendezvous")
        time.sleep(0.05)
    grace = min(deadline, time.monotonic() + NONCE_GRACE_S)
    while True:
        signed = _json_or_empty(store.get(_NONCE))
        nonce = signed.get("nonce", "")
        if nonce and _same(signed.get("mac", ""), _mac(token, "nonce", nonce, world)):
            return nonce, True
        if time.monotonic() > grace:
            return nonce, False
        time.sleep(0.05)


def _prove(store: dist.Store, rank_: int, world: int, token: str, deadline: float) -> None:
    while True:
        nonce, verified = _leader_nonce(store, world, token, deadline)
        mine = secrets.token_hex(16)
        proof = _mac(token, "join", nonce, world, rank_, mine)
        store.set(_PROOF.format(rank_), json.dumps({"nonce": mine, "proof": proof}))
        key = _VERDICT.format(rank_)
        if not verified:  # proved anyway, and its answer awaited a moment: the leader logs the refusal, naming it
            until = min(deadline, time.monotonic() + NONCE_GRACE_S)
            while time.monotonic() < until and _json_or_empty(store.get(key) if store.check([key]) else b"") \
                    .get("nonce") != mine:
                time.sleep(0.05)
            raise JoinRefusedError(_REFUSED)
        while True:
            verdict = _json_or_empty(store.get(key)) if store.check([key]) else {}
            if verdict.get("nonce") == mine:
                kind = "refuse" if verdict.get("refused") else "admit"
                # One whose MAC does not verify is not the leader's (that holds this token: its nonce verified).
                if _same(verdict.get("mac", ""), _mac(token, kind, nonce, world, rank_, mine)):
                    if kind == "admit":
                        return
                    break  # the leader refused that proof (overwritten, or over a replaced nonce): prove again
            if time.monotonic() > deadline:
                raise TimeoutError("the leader has not admitted every rank")
            time.sleep(0.05)
