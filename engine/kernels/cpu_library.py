"""kiln's CPU kernels as a shared library: compiled for the host's ISA level, shipped in artifacts, loaded.

The C sources (``csrc/*.c``) have no torch headers, so compiling them takes a few seconds with the system C
compiler (``$CC``, else ``cc``). Where the compiled library comes from, first match wins:

1. an artifact's shipped copy (``kernels/cpu/<level>.so``, made by the build's ``kernels`` stage),
   for the best ISA level this host's CPU flags allow (``install_shipped``);
2. ``$KILN_CPU_KERNELS_DIR`` (default ``~/.cache/kiln/cpu-kernels``), keyed by a hash of the sources
   and the compile command, compiled there on first use (atomic rename: concurrent processes are safe);
3. none: no compiler, no ISA level the host supports, or ``KILN_CPU_KERNELS=0`` -- the engine runs its
   torch path (same results), and the reason is logged once.

Which levels a host may load, and the ``$KILN_CPU_ISA`` cap, are ``isa.py``'s.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kiln.engine.kernels.cache import RECORD_KEY
from kiln.engine.kernels.isa import ARCH_LEVELS, LEVEL_FLAGS, host_levels, log

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
ABI_VERSION = 14  # = KILN_ABI_VERSION in csrc/kiln_cpu.h
_EXTRA = {"x86-64-v4": ("-mprefer-vector-width=512",)}
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
CPU_DIR = "kernels/cpu"  # where an artifact holds its compiled libraries, one <level>.so per ISA level


def compile_command(level: str, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [os.environ.get("CC", "cc"), f"-march={level}", *_EXTRA.get(level, ()), *CFLAGS, *extra, "-o", str(out),
            *map(str, SOURCES)]


def source_digest() -> str:
    """The kernels' sources (C files and headers), hashed in a fixed order."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def library_name(level: str, extra: tuple[str, ...] = ()) -> str:
    """A file name that changes whenever the sources or the compile flags do (a file ``extra`` flags name, such as
    an ``-include``, by its content)."""
    flags = " ".join(compile_command(level, Path("x"), extra)[1:-len(SOURCES)])
    digest = hashlib.sha256((source_digest() + flags).encode())
    for flag in extra:
        if Path(flag).is_file():
            digest.update(Path(flag).read_bytes())
    return f"kiln-cpu-kernels-{level}-{digest.hexdigest()[:12]}.so"


def compile_library(level: str, dest_dir: Path, extra: tuple[str, ...] = ()) -> Path:
    """Compile for ``level`` (with ``extra`` flags) into ``dest_dir`` (atomically); raises RuntimeError naming the
    compiler's error."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / library_name(level, extra)
    if dest.exists():
        return dest
    cmd = compile_command(level, dest, extra)
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"no C compiler: {cmd[0]!r} is not on PATH (set $CC)")
    fd, tmp = tempfile.mkstemp(dir=dest_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd[cmd.index("-o") + 1] = tmp
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def default_dir() -> Path:
    return Path(os.environ.get("KILN_CPU_KERNELS_DIR") or Path.home() / ".cache" / "kiln" / "cpu-kernels")


_shipped: dict[str, Path] = {}  # level -> an artifact's library, set by install_shipped
_installs = 0  # how many times install_shipped ran: native loads the library again when it changes


def build_for_artifact(artifact_dir: Path) -> dict:
    """Compile for every ISA level of this machine's architecture (not only the ones this CPU runs: the
    serving hosts pick theirs) into the compile cache (``default_dir``: a builder compiles each level of
    one source once) and copy them into ``artifact_dir/CPU_DIR``; returns the ``engine.json["kernels"]`` record."""
    levels = ARCH_LEVELS.get(platform.machine(), ())
    if not levels:
        return {"packed": False, "reason": f"kiln's CPU kernels are not built for {platform.machine()}"}
    dest = Path(artifact_dir) / CPU_DIR
    libraries = {}
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for level in levels:  # through the compile cache: the name holds the sources' and flags' hash
            shutil.copyfile(compile_library(level, default_dir()), dest / f"{level}.so")
            libraries[level] = {"file": f"{level}.so", "cpu_flags": list(LEVEL_FLAGS[level])}
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        return {"packed": False, "reason": f"kiln's CPU kernels did not compile in the build image ({exc}): "
                                           f"serving hosts with a C compiler compile them at load"}
    return {"packed": True, "device": "cpu", "path": CPU_DIR, "abi": ABI_VERSION, "source_sha256": source_digest(),
            "libraries": libraries}


def install_from_artifact(artifact_dir: str | Path, doc: dict, trusted: bool = False) -> list[str]:
    """Use an artifact's shipped libraries (``build_for_artifact``) when they are this kiln's kernels and the
    artifact is ``trusted`` (its signature was verified: a library runs code as soon as it is loaded);
    returns the levels installed."""
    record = doc.get(RECORD_KEY) or {}
    if record.get("device") != "cpu" or not record.get("packed"):
        return []
    if not trusted:
        log.warning("the artifact's CPU kernel library is not loaded: its signature was not verified (serve it "
                    "with --verify-key); compiling this kiln's kernels from its own sources here")
        return []
    if record.get("source_sha256") != source_digest() or record.get("abi") != ABI_VERSION:
        log.warning("the artifact's CPU kernels were built from another kiln's source: compiling this kiln's here")
        return []
    root = Path(artifact_dir) / record.get("path", CPU_DIR)
    libraries = {level: root / info["file"] for level, info in (record.get("libraries") or {}).items()
                 if level in LEVEL_FLAGS and (root / info["file"]).is_file()}
    install_shipped(libraries)
    return sorted(libraries)


def install_shipped(libraries: dict[str, Path]) -> None:
    """Prefer an artifact's compiled libraries (level -> path) to compiling here; call before first use (a
    library ``native`` loaded before is loaded again: it asks ``installs``)."""
    global _installs
    _shipped.update(libraries)
    _installs += 1


def installs() -> int:
    """How many times ``install_shipped`` ran in this process (``native.kernels`` keys its loaded library by it)."""
    return _installs


def locate(shipped: bool = True) -> tuple[Path, str] | str:
    """(library path, level) to load on this host: the artifact's for the best level the host may run (unless
    ``shipped`` is False), else compiled here; or why there is none."""
    if os.environ.get("KILN_CPU_KERNELS", "1") == "0":
        return "KILN_CPU_KERNELS=0"
    levels = host_levels()
    if not levels:
        return (f"this CPU ({platform.machine()}) has none of the ISA levels they are built for "
                f"({', '.join(LEVEL_FLAGS)})")
    if shipped and levels[0] in _shipped:
        return _shipped[levels[0]], levels[0]
    try:
        return compile_library(levels[0], default_dir()), levels[0]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return str(exc)
