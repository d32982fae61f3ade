"""The publish claim's heartbeat (``kiln.artifact_claim``), against file:// and s3:// (moto's server): a live
publisher's claim never ages past ``claim_ttl`` however slow its move-in, a publisher that lost its claim
anyway stops before its next file and publishes nothing, one paused past the TTL between its check and its
move does not replace the new holder's file, and a holder's clock does not decide when its claim expires.
A 1-second TTL keeps these to seconds."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kiln.artifact_claim import ClaimLost
from kiln.artifact_manifest import ArtifactConflict, StoreError
from kiln.artifacts import ArtifactStore

VERSION = "llama-tiny-0123456789ab"
ENVELOPE = {"format_version": 1}
CLAIM = f"engines/{VERSION}/.publish-claim.json"
TTL = timedelta(seconds=1)


def engine_dir(root: Path, seed: int) -> Path:
    rng = __import__("random").Random(seed)
    (root / "weights").mkdir(parents=True, exist_ok=True)
    (root / "engine.json").write_text(json.dumps({"seed": seed}))
    (root / "config.json").write_text("{}")
    (root / "weights" / "rank-0-of-1.safetensors").write_bytes(rng.randbytes(32 * 1024))
    return root


@pytest.fixture(params=["file", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return (tmp_path / "store").as_uri()
    return f"s3://{request.getfixturevalue('s3_bucket')}/kiln"


def store_at(uri: str) -> ArtifactStore:
    return ArtifactStore(ArtifactStore.from_uri(uri).backend, claim_ttl=TTL)


def heartbeat_of(store: ArtifactStore) -> bytes | None:
    """The claim holder's heartbeat object (next to its staging upload), None while there is none."""
    claim = store.backend.read(CLAIM)
    upload_id = json.loads(claim)["upload_id"] if claim else "none"
    return store.backend.read(f"staging/{VERSION}/{upload_id}.heartbeat.json")


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kiln-claim-heartbeat")]


def slow_promotes(store: ArtifactStore, seconds: float, each=None) -> list[str]:
    """Make ``store``'s moves into ``engines/`` take ``seconds`` each; returns the keys moved, in order."""
    real, moved = store.backend.promote, []

    def promote(src: str, dst: str, expected: str | None) -> bool:
        time.sleep(seconds)
        done = real(src, dst, expected)
        moved.append(dst)
        if each is not None:
            each(dst)
        return done

    store.backend.promote = promote
    return moved


def test_a_slow_move_in_keeps_its_claim_past_the_ttl(uri: str, tmp_path: Path):
    slow, other = store_at(uri), store_at(uri)
    beats: list[bytes | None] = []
    slow_promotes(slow, 0.8, each=lambda _: beats.append(heartbeat_of(slow)))
    result: dict = {}
    publisher = threading.Thread(target=lambda: result.update(m=slow.publish(
        VERSION, engine_dir(tmp_path / "a", seed=1), ENVELOPE)))
    publisher.start()
    deadline = time.monotonic() + 10
    while slow.backend.read(CLAIM) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    # 3 files x 0.8 s is more than twice the TTL: without a heartbeat this publisher would take over.
    with pytest.raises(ArtifactConflict, match="already published with different content"):
        other.publish(VERSION, engine_dir(tmp_path / "b", seed=2), ENVELOPE)
    assert time.monotonic() - started > 1.5  # it waited for the slow publisher's manifest
    publisher.join(10)
    assert result["m"] == slow.read_manifest(VERSION)
    out = slow.fetch(VERSION, tmp_path / "out")  # verifies every file against the manifest
    assert (out / "weights" / "rank-0-of-1.safetensors").read_bytes() == \
        (tmp_path / "a" / "weights" / "rank-0-of-1.safetensors").read_bytes()
    stamps = [json.loads(b)["refreshed_at"] for b in beats if b is not None]
    assert len(stamps) == 3 and stamps == sorted(stamps) and len(set(stamps)) == 3  # refreshed while moving
    assert heartbeat_threads() == []  # released with the claim
    assert slow.backend.read(CLAIM) is None and slow.backend.list("staging/") == []


def test_a_publisher_that_lost_its_claim_stops_before_its_next_file(uri: str, tmp_path: Path):
    store = store_at(uri)
    taker = {"upload_id": "taker", "content_digest": "1" * 64, "created_at": datetime.now(UTC).isoformat()}

    def taken_over(_dst: str) -> None:  # what a second publisher does once it finds the claim stale
        if len(moved) == 1:
            store.backend.delete([CLAIM])
            assert store.backend.create_exclusive(CLAIM, json.dumps(taker).encode())

    moved = slow_promotes(store, 0, each=taken_over)
    with pytest.raises(ClaimLost, match="lost the publish claim") as err:
        store.publish(VERSION, engine_dir(tmp_path / "a", seed=1), ENVELOPE)
    assert isinstance(err.value, StoreError) and "publish again" in str(err.value)
    assert len(moved) == 1  # nothing more was moved in once the claim was gone
    assert not store.exists(VERSION)  # and nothing is visible
    assert json.loads(store.backend.read(CLAIM)) == taker  # the new holder's claim is left alone
    assert heartbeat_threads() == []
    assert store.backend.list("staging/") == []


def differing_dir(root: Path, seed: int) -> Path:
    """An engine directory whose every file differs from another seed's."""
    (root / "weights").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "engine.json", "weights/rank-0-of-1.safetensors"):
        (root / name).write_text(json.dumps({"seed": seed, "file": name}))
    return root


def test_a_holder_paused_between_its_check_and_its_move_does_not_replace_the_takers_file(
        uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 38 (low): the holder checks its claim, is paused (no heartbeat) past the TTL, the taker publishes,
    and the holder resumes. Its move must fail, not overwrite the published file, and it publishes nothing."""
    import kiln.artifact_claim as artifact_claim

    paused, taker = store_at(uri), store_at(uri)
    resumed, real_check, first = threading.Event(), artifact_claim.Claim.check, []

    def check(self) -> None:
        real_check(self)
        if self.store is paused and not first:  # the holder's first check passed: it "stops" right here
            first.append(True)
            self.heartbeat._stop.set()  # a paused process beats no more
            resumed.wait(30)

    monkeypatch.setattr(artifact_claim.Claim, "check", check)
    result: dict = {}
    holder = threading.Thread(target=lambda: result.update(outcome=_outcome(
        lambda: paused.publish(VERSION, differing_dir(tmp_path / "a", seed=1), ENVELOPE))))
    holder.start()
    deadline = time.monotonic() + 10
    while not first and time.monotonic() < deadline:
        time.sleep(0.02)
    published = taker.publish(VERSION, differing_dir(tmp_path / "b", seed=2), ENVELOPE)  # takes over after the TTL
    resumed.set()
    holder.join(30)
    assert isinstance(result["outcome"], ClaimLost), result
    assert taker.read_manifest(VERSION) == published
    out = taker.fetch(VERSION, tmp_path / "out")  # every file checked against the taker's manifest
    assert json.loads((out / "config.json").read_text())["seed"] == 2


def _outcome(publish):
    try:
        return publish()
    except StoreError as exc:
        return exc


def test_expiry_follows_the_waiters_clock_not_the_holders(uri: str, tmp_path: Path):
    """A live holder whose clock is an hour behind (its claim and heartbeat stamped then) is not taken over; once
    it falls silent, it is, claim_ttl later by the waiter's own clock, whatever its stamps say."""
    store = store_at(uri)
    skewed = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    claim = {"upload_id": "skewed", "content_digest": "2" * 64, "created_at": skewed}
    assert store.backend.create_exclusive(CLAIM, json.dumps(claim).encode())
    alive = threading.Event()
    alive.set()
    last_beat: list[float] = []

    def beat() -> None:  # the holder renews every quarter TTL, stamping its own (skewed) time
        beats = 0
        while alive.is_set():
            beats += 1
            store.backend.write(f"staging/{VERSION}/skewed.heartbeat.json",
                                json.dumps({"upload_id": "skewed", "beats": beats, "refreshed_at": skewed}).encode())
            last_beat[:] = [time.monotonic()]
            time.sleep(0.25)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(m=_outcome(
        lambda: store.publish(VERSION, engine_dir(tmp_path / "a", seed=1), ENVELOPE))))
    waiter.start()
    time.sleep(3 * TTL.total_seconds())
    assert json.loads(store.backend.read(CLAIM))["upload_id"] == "skewed" and not store.exists(VERSION)
    alive.clear()
    beater.join(5)
    silent_since = last_beat[0]  # the holder fell silent at its last write, up to one beat before clear()
    waiter.join(30)
    assert time.monotonic() - silent_since >= 0.9 * TTL.total_seconds()
    assert result["m"] == store.read_manifest(VERSION)
