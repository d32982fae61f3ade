"""The file:// backend: a directory tree, made crash-safe with fsync, rename and hard links.

Exclusive creates write a complete temporary file, fsync it and ``os.link`` it
to the final name: ``link`` fails if the name exists, so a manifest is either
absent or whole, and two publishers cannot both create it. On filesystems
without hard links it falls back to ``O_CREAT | O_EXCL`` (whole-or-absent then
relies on readers treating a partial manifest as invalid, which they do).
"""

from __future__ import annotations

import errno
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kiln.artifact_manifest import HASH_CHUNK, ArtifactCorrupt, StoreError, file_sha256
from kiln.storage import ByteCallback, ObjectInfo


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

    def promote(self, src_key: str, dst_key: str) -> None:
        dst = self._path(dst_key)
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._path(src_key), dst)
            _fsync_dir(dst.parent)
            self._prune([self._path(src_key).parent])
        except OSError as exc:
            raise self._err(exc, f"move {src_key} to {dst_key}") from None

    def download(self, key: str, local: Path, progress: ByteCallback | None) -> None:
        try:
            with open(self._path(key), "rb") as src, open(local, "wb") as out:
                while chunk := src.read(HASH_CHUNK):
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
        except FileNotFoundError:
            raise ArtifactCorrupt(f"{self.uri}/{key}: listed in the manifest but missing from the store") from None
        except OSError as exc:
            raise self._err(exc, f"read {key}") from None

    def read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._err(exc, f"read {key}") from None

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
                os.link(tmp, dst)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                return self._create_excl_no_links(dst, data)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(dst.parent)
            return True
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
