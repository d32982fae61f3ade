"""The s3:// backend (boto3): AWS S3, MinIO and other S3-compatible stores.

``s3://bucket/prefix[?endpoint_url=URL&profile=NAME&region=REGION]``. Without
``endpoint_url`` boto3 itself reads ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``;
credentials come from the standard AWS variables, ``AWS_PROFILE`` or ``?profile=``.

Uploads send ``ChecksumAlgorithm=SHA256``, so the server checks every request
body against a SHA-256 the client computed while sending it, and stores it.
Verification then asks the server for that checksum (``HeadObject`` with
checksum mode) and compares it with the digest computed locally from the
file: for a single-part object it is the file's sha256; for a multipart object
it is the sha256 of the parts' sha256 digests ("-N" composite), recomputed
locally with the same part size the transfer manager used. Servers that keep
no checksum get the object read back and hashed instead.

Conditional writes (``If-None-Match: *``) need a store that supports them:
AWS S3 since 2024, recent MinIO, moto 5.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import boto3
import botocore.exceptions as bex
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from s3transfer.utils import ChunksizeAdjuster

from kiln.artifact_manifest import HASH_CHUNK, ArtifactCorrupt, StoreError, rm_hint
from kiln.storage import MAX_READ_BYTES, ByteCallback, ObjectInfo

MiB = 1024 * 1024
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden", "403",
                 "InvalidToken", "ExpiredToken", "AllAccessDisabled", "AccountProblem"}


class S3Backend:
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 profile: str | None = None, region: str | None = None,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 64 * MiB,
                 max_concurrency: int = 8, connect_timeout: float = 3, max_attempts: int = 3):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                       multipart_chunksize=multipart_chunksize, max_concurrency=max_concurrency)
        self.profile = profile
        try:
            session = boto3.session.Session(profile_name=profile)
        except bex.ProfileNotFound:
            raise StoreError(f"{self.uri}: AWS profile {profile!r} not found (check ~/.aws/config, "
                             f"AWS_PROFILE or ?profile=)") from None
        config = Config(connect_timeout=connect_timeout, read_timeout=60,
                        retries={"max_attempts": max_attempts, "mode": "standard"})
        self.client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    @classmethod
    def from_uri(cls, uri: str, **options) -> S3Backend:
        parts = urlsplit(uri)
        if not parts.netloc:
            raise StoreError(f"{uri}: an s3:// store needs a bucket, e.g. s3://my-bucket/kiln")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"endpoint_url", "profile", "region"}
        if unknown:
            raise StoreError(f"{uri}: unknown store URI option(s) {sorted(unknown)} "
                             f"(supported: endpoint_url, profile, region)")
        return cls(parts.netloc, parts.path, endpoint_url=query.get("endpoint_url"),
                   profile=query.get("profile"), region=query.get("region"), **options)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    # ---- error translation ---------------------------------------------------------------
    def _error(self, exc: Exception, what: str) -> StoreError:
        """One line a user can act on, for any boto3/botocore failure."""
        endpoint = self.client.meta.endpoint_url
        if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
            return StoreError(f"{self.uri}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                              f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or add ?profile=NAME to the store URI)")
        if isinstance(exc, bex.ProfileNotFound):
            return StoreError(f"{self.uri}: AWS profile {self.profile!r} not found (check ~/.aws/config)")
        if isinstance(exc, bex.EndpointConnectionError | bex.ConnectTimeoutError | bex.ReadTimeoutError
                      | bex.ConnectionClosedError | bex.HTTPClientError):
            return StoreError(f"{self.uri}: cannot reach the S3 endpoint {endpoint} "
                              f"({type(exc).__name__}); check ?endpoint_url=, AWS_ENDPOINT_URL_S3 and the network")
        code, message = "", str(exc)
        if isinstance(exc, bex.ClientError):
            err = exc.response.get("Error", {})
            code, message = str(err.get("Code", "")), str(err.get("Message", "")) or str(exc)
        elif (m := re.search(r"An error occurred \(([\w.]+)\)[^:]*: (.*)", str(exc))) is not None:
            code, message = m.group(1), m.group(2)  # S3UploadFailedError keeps only the text
        if code == "NoSuchBucket":
            return StoreError(f"{self.uri}: bucket {self.bucket!r} does not exist (create it or fix --store)")
        if code in _ACCESS_CODES:
            return StoreError(f"{self.uri}: access denied while trying to {what} ({code}); check the "
                              f"credentials and the bucket policy")
        return StoreError(f"{self.uri}: S3 error while trying to {what}: {code or type(exc).__name__}: {message}")

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (bex.BotoCoreError, bex.ClientError, boto3.exceptions.Boto3Error) as exc:
            raise self._error(exc, what) from None

    # ---- primitives ----------------------------------------------------------------------
    def upload(self, local: Path, key: str, progress: ByteCallback | None) -> None:
        self._call(f"upload {key}", self.client.upload_file, str(local), self.bucket, self._key(key),
                   ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=self.transfer, Callback=progress)

    def verify_upload(self, local: Path, key: str, sha256: str, size: int) -> None:
        head = self._call(f"check {key}", self.client.head_object, Bucket=self.bucket, Key=self._key(key),
                          ChecksumMode="ENABLED")
        stored = head.get("ChecksumSHA256")
        if head["ContentLength"] != size:
            got = f"{head['ContentLength']} bytes"
        elif stored is None:  # the server keeps no checksum: read the object back
            digest = self._hash_object(key)
            got = None if digest == sha256 else f"sha256 {digest}"
        elif stored.split("-")[0] == _b64(sha256):
            got = None  # one part: the server hashed exactly the bytes we hashed
        else:
            full, composite = _local_checksums(local, self._part_size(size))
            ok = full == sha256 and stored.split("-")[0] in (_b64(sha256), composite)
            got = None if ok else f"checksum {stored} (local file now sha256 {full})"
        if got is not None:
            raise ArtifactCorrupt(f"{self.uri}/{key}: upload of {local} did not land intact: expected sha256 "
                                  f"{sha256} ({size} bytes), store holds {got}")

    def _part_size(self, size: int) -> int | None:
        if size < self.transfer.multipart_threshold:
            return None
        return ChunksizeAdjuster().adjust_chunksize(self.transfer.multipart_chunksize, size)

    def _hash_object(self, key: str) -> str:
        body = self._call(f"read {key}", self.client.get_object, Bucket=self.bucket, Key=self._key(key))["Body"]
        h = hashlib.sha256()
        while chunk := body.read(HASH_CHUNK):
            h.update(chunk)
        return h.hexdigest()

    def token(self, key: str) -> str | None:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ETag"]
        except bex.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(exc, f"head {key}") from None
        except bex.BotoCoreError as exc:
            raise self._error(exc, f"head {key}") from None

    def promote(self, src_key: str, dst_key: str, expected: str | None) -> bool:
        """A copy after reading the destination's token back. S3 has no conditional *copy* moto honours (its
        CopyObject ignores If-Match / If-None-Match, and a single CopyObject would lose a multipart object's
        checksum), so the window is the time between that read and the copy's start."""
        if self.token(dst_key) != expected:
            return False
        self._call(f"copy {src_key} to {dst_key}", self.client.copy,
                   {"Bucket": self.bucket, "Key": self._key(src_key)}, self.bucket, self._key(dst_key),
                   Config=self.transfer)
        return True

    def download(self, key: str, local: Path, progress: ByteCallback | None, size: int | None = None) -> None:
        """With ``size``: the object's size from a HEAD first (another size: refused before any byte is
        written), and a transfer that stops as soon as it has moved more than ``size`` bytes (the object was
        replaced meanwhile), so no more than ``size`` and one part reach the disk."""
        try:
            if size is not None:
                have = self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
                if have != size:
                    raise ArtifactCorrupt(f"{self.uri}/{key}: {have} bytes in the store, the manifest says {size}: "
                                          f"not downloaded; re-publish it ({rm_hint(self.uri, key)} and a rebuild)")
                progress = _bounded(progress, size, f"{self.uri}/{key}")
            self.client.download_file(self.bucket, self._key(key), str(local), Config=self.transfer,
                                      Callback=progress)
        except bex.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise ArtifactCorrupt(f"{self.uri}/{key}: listed in the manifest but missing from the store") \
                    from None
            raise self._error(exc, f"download {key}") from None
        except (bex.BotoCoreError, boto3.exceptions.Boto3Error) as exc:
            raise self._error(exc, f"download {key}") from None

    def read(self, key: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            if obj["ContentLength"] > limit:
                obj["Body"].close()
                raise ArtifactCorrupt(f"{self.uri}/{key}: {obj['ContentLength']} bytes, more than the {limit} a "
                                      "store object read whole may hold; not read "
                                      f"(remove it: {rm_hint(self.uri, key)})")
            return obj["Body"].read(limit)
        except bex.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchKey":
                return None
            raise self._error(exc, f"read {key}") from None
        except bex.BotoCoreError as exc:
            raise self._error(exc, f"read {key}") from None

    def create_exclusive(self, key: str, data: bytes) -> bool:
        for attempt in range(5):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*",
                                       ContentType="application/json")
                return True
            except bex.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code == "PreconditionFailed":
                    return False
                if code == "ConditionalRequestConflict" and attempt < 4:
                    time.sleep(0.2 * (attempt + 1))  # a concurrent conditional write is in flight
                    continue
                raise self._error(exc, f"write {key}") from None
            except bex.BotoCoreError as exc:
                raise self._error(exc, f"write {key}") from None
        return False

    def write(self, key: str, data: bytes) -> None:
        self._call(f"write {key}", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   ContentType="application/json")

    def list(self, prefix: str) -> list[ObjectInfo]:
        found = []
        for page in self._pages(f"list {prefix}", Prefix=self._key(prefix)):
            for o in page.get("Contents", []):
                found.append(ObjectInfo(self._rel(o["Key"]), o["Size"], o["LastModified"]))
        return found

    def list_dirs(self, prefix: str) -> list[str]:
        names = []
        for page in self._pages(f"list {prefix}", Prefix=self._key(prefix), Delimiter="/"):
            for p in page.get("CommonPrefixes", []):
                names.append(self._rel(p["Prefix"])[len(prefix):].rstrip("/"))
        return sorted(names)

    def _pages(self, what: str, **kwargs):
        try:
            yield from self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)
        except (bex.BotoCoreError, bex.ClientError) as exc:
            raise self._error(exc, what) from None

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            resp = self._call("delete objects", self.client.delete_objects, Bucket=self.bucket,
                              Delete={"Objects": batch, "Quiet": True})
            if errors := resp.get("Errors"):
                e = errors[0]
                raise StoreError(f"{self.uri}: could not delete {e.get('Key')}: {e.get('Code')} "
                                 f"({len(errors)} object(s) failed)")

    def abort_uploads(self, prefix: str, older_than: datetime) -> list[str]:
        aborted = []
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                for u in page.get("Uploads", []):
                    if _upload_started(self._rel(u["Key"]), u["Initiated"]) < older_than:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                        aborted.append(f"{self._rel(u['Key'])} (incomplete multipart upload)")
        except (bex.BotoCoreError, bex.ClientError) as exc:
            raise self._error(exc, "abort stale multipart uploads") from None
        return aborted


def _upload_started(key: str, initiated: datetime) -> datetime:
    """When an upload began: the later of S3's ``Initiated`` and the publish's upload-id timestamp.

    The upload id (``staging/<v>/<YYYYmmddTHHMMSSZ>-<hex>/``) is a lower bound that
    holds even where a server reports no real ``Initiated`` time (moto reports 2010).
    """
    m = re.match(r"staging/[^/]+/(\d{8}T\d{6}Z)-", key)
    if m is None:
        return initiated
    return max(initiated, datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC))


def _bounded(progress: ByteCallback | None, size: int, where: str) -> ByteCallback:
    """``progress``, raising ArtifactCorrupt once more than ``size`` bytes have moved (the transfer stops)."""
    moved = [0]
    lock = threading.Lock()

    def step(n: int) -> None:
        with lock:
            moved[0] += n
            over = moved[0] > size
        if over:
            raise ArtifactCorrupt(f"{where}: more than the manifest's {size} bytes arrived (the object was replaced "
                                  "during the download); not kept")
        if progress:
            progress(n)
    return step


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def _local_checksums(path: Path, part_size: int | None) -> tuple[str, str]:
    """(sha256 hex of the file, base64 S3 checksum: full for one part, composite for multipart)."""
    full = hashlib.sha256()
    part_digests = []
    with open(path, "rb") as f:
        while True:
            part = hashlib.sha256()
            remaining = part_size or -1
            read_any = False
            while remaining != 0:
                chunk = f.read(HASH_CHUNK if remaining < 0 else min(HASH_CHUNK, remaining))
                if not chunk:
                    break
                read_any = True
                full.update(chunk)
                part.update(chunk)
                remaining -= len(chunk) if remaining > 0 else 0
            if not read_any:
                break
            part_digests.append(part.digest())
            if part_size is None:
                break
    if part_size is None:
        return full.hexdigest(), base64.b64encode(full.digest()).decode()
    composite = hashlib.sha256(b"".join(part_digests)).digest()
    return full.hexdigest(), base64.b64encode(composite).decode()
