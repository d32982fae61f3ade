"""The file:// backend: a directory tree, made crash-safe with fsync, rename and hard links.

Exclusive creates write a complete temporary file, fsync it and ``os.link`` it
to the final name: ``link`` fails if the name exists, so a manifest is either
absent or whole, and two publishers cannot both create it. On filesystems
without hard links it falls back to ``O_CREAT | O_EXCL`` (whole-or-absent then
relies on readers treating a partial manifest as invalid, which they do).

Reads open regular files only, never through a symlink (``O_NOFOLLOW``, and the resolved path must
stay under the root): a store writer's link to ``/dev/zero`` or another tree is refused, not read.
They take the size from ``fstat`` before copying, and copy no more than the size they expect.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kiln.artifact_manifest import HASH_CHUNK, ArtifactCorrupt, StoreError, file_sha256, rm_hint
from kiln.storage import MAX_READ_BYTES, ByteCallback, ObjectInfo


class FileBackend:
    def __init__(self, root: Path):
        self.root = root.absolute()
        self.uri = f"file://{self.root.as_posix()}"

    @classmethod
    def from_uri(cls, uri: str) -> FileBackend:
        if uri.startswith("file://"):
            parts = urlsplit(uri)
            if parts.netloc not in ("", "localhost"):
                raise StoreError(f"{uri}: file:// store URIs take an absolute path, e.g. file:///var/cache/kiln "
                                 f"(got host {parts.netloc!r})")
            path = unquote(parts.path)
        else:
            path = uri
        if not path:
            raise StoreError(f"{uri!r}: empty store path (use file:///abs/path)")
        return cls(Path(path).expanduser())

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def _err(self, exc: OSError, what: str) -> StoreError:
        reason = exc.strerror or str(exc)
        return StoreError(f"{self.uri}: cannot {what}: {reason} ({exc.filename or self.root})")

    def upload(self, local: Path, key: str, progress: ByteCallback | None) -> None:
        dst = self._path(key)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(local, "rb") as src, open(dst, "wb") as out:
                while chunk := src.read(HASH_CHUNK):
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            raise self._err(exc, f"write {key}") from None

    def verify_upload(self, local: Path, key: str, sha256: str, size: int) -> None:
        path = self._path(key)
        try:
            got_size, got = path.stat().st_size, file_sha256(path)
        except FileNotFoundError:
            got_size, got = 0, "nothing (the file is missing)"
        if got_size != size or got != sha256:
            raise ArtifactCorrupt(f"{self.uri}/{key}: upload of {local} did not land intact: expected sha256 "
                                  f"{sha256} ({size} bytes), store holds {got} ({got_size} bytes)")

    def token(self, key: str) -> str | None:
        try:
            st = os.lstat(self._path(key))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._err(exc, f"stat {key}") from None
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def promote(self, src_key: str, dst_key: str, expected: str | None) -> bool:
        """Into an empty place: a hard link, which fails if anything got there first; over ``expected``: a rename
        right after reading the token back (a local filesystem has no conditional rename)."""
        src, dst = self._path(src_key), self._path(dst_key)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            linked = self._link(src, dst) if expected is None else None
            if linked is False:
                return False
            if linked is None:  # over an expected object, or where there are no hard links
                if self.token(dst_key) != expected:
                    return False
                os.replace(src, dst)
            src.unlink(missing_ok=True)  # linked: the staging name goes
            _fsync_dir(dst.parent)
            self._prune([src.parent])
        except OSError as exc:
            raise self._err(exc, f"move {src_key} to {dst_key}") from None
        return True

    @staticmethod
    def _link(src: Path, dst: Path) -> bool | None:
        """True: linked; False: something is at ``dst``; None: this filesystem has no hard links (rename instead)."""
        try:
            os.link(src, dst)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            return None
        return True

    def download(self, key: str, local: Path, progress: ByteCallback | None, size: int | None = None) -> None:
        try:
            with self._open(key) as src, open(local, "wb") as out:
                have = os.fstat(src.fileno()).st_size
                if size is not None and have != size:
                    raise ArtifactCorrupt(f"{self.uri}/{key}: {have} bytes in the store, the manifest says {size}: "
                                          f"not downloaded; re-publish it ({rm_hint(self.uri, key)} and a rebuild)")
                left = have
                while left > 0 and (chunk := src.read(min(HASH_CHUNK, left))):
                    out.write(chunk)
                    left -= len(chunk)
                    if progress:
                        progress(len(chunk))
        except FileNotFoundError:
            raise ArtifactCorrupt(f"{self.uri}/{key}: listed in the manifest but missing from the store") from None
        except OSError as exc:
            raise self._err(exc, f"read {key}") from None

    def read(self, key: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        try:
            with self._open(key) as src:
                have = os.fstat(src.fileno()).st_size
                if have > limit:
                    raise ArtifactCorrupt(f"{self.uri}/{key}: {have} bytes, more than the {limit} a store object "
                                          f"read whole may hold; not read (remove it: {rm_hint(self.uri, key)})")
                return src.read(limit)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._err(exc, f"read {key}") from None

    def _open(self, key: str):
        """``key`` opened for reading: a regular file under the root, reached without following a symlink."""
        path = self._path(key)
        real = Path(os.path.realpath(path))
        if real != Path(os.path.realpath(self.root)).joinpath(*key.split("/")):
            raise ArtifactCorrupt(f"{self.uri}/{key}: reached through a symlink ({real}); the store holds only "
                                  f"regular files: not read (remove it: {rm_hint(self.uri, key)})")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ArtifactCorrupt(f"{self.uri}/{key}: not a regular file (a device, pipe or directory); not read "
                                  f"(remove it: {rm_hint(self.uri, key)})")
        return os.fdopen(fd, "rb")

    def create_exclusive(self, key: str, data: bytes) -> bool:
        dst = self._path(key)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            try:
                linked = self._link(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)
            if linked is None:  # no hard links here: an exclusive open instead
                return self._create_excl_no_links(dst, data)
            if linked:
                _fsync_dir(dst.parent)
            return linked
        except OSError as exc:
            raise self._err(exc, f"create {key}") from None

    def write(self, key: str, data: bytes) -> None:
        dst = self._path(key)
        tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dst)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._err(exc, f"write {key}") from None

    @staticmethod
    def _create_excl_no_links(dst: Path, data: bytes) -> bool:
        try:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        return True

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        if not base.is_dir():
            return []
        found = []
        for dirpath, _, names in os.walk(base):
            for name in names:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue  # removed while we walked
                key = p.relative_to(self.root).as_posix()
                found.append(ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC)))
        return sorted(found)

    def list_dirs(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/"))
        try:
            return sorted(e.name for e in os.scandir(base) if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._err(exc, f"list {prefix}") from None

    def delete(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            p = self._path(key)
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._err(exc, f"delete {key}") from None
            parents.add(p.parent)
        self._prune(parents)

    def _prune(self, dirs) -> None:
        """Remove directories left empty, deepest first, never the store root itself."""
        for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            while d != self.root and self.root in d.parents:
                try:
                    d.rmdir()
                except OSError:
                    break
                d = d.parent

    def abort_uploads(self, prefix: str, older_than: datetime) -> list[str]:
        return []  # a local write has no server-side upload state to abort


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)
