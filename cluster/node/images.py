"""Images: kiln's image is this checkout's installed kiln; any other image fails as a pull would.

``ghcr.io/kiln-dev/kiln`` (any tag or digest) runs the commands of the virtual environment the agent runs
in, with the environment serving_image/Dockerfile's ``ENV`` declares (read from that file, so the image
and its stand-in cannot drift), its ``/opt/kiln/bin`` being the environment's ``bin``.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

KILN_IMAGE = "ghcr.io/kiln-dev/kiln"
IMAGE_BIN = "/opt/kiln/bin"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def repository(image: str) -> str:
    """``registry/path`` of an image reference, without its tag or digest."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name.rsplit(":", 1)[0]
    return name


def pull_error(image: str) -> str | None:
    """None for kiln's image; else the message a failed pull shows."""
    if repository(image) == KILN_IMAGE:
        return None
    return (f"the node agent runs only kiln's image ({KILN_IMAGE}, any tag), mapped to this checkout's "
            f"installed kiln; {image!r} cannot be pulled here")


def venv_bin() -> Path:
    return Path(sys.executable).parent


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    """The ``ENV`` instructions of a Dockerfile (``KEY=VALUE`` form), ``$PATH`` expanded."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    env: dict[str, str] = {"PATH": BASE_PATH}
    for line in text.splitlines():
        if not line.startswith("ENV "):
            continue
        for token in shlex.split(line[4:]):
            key, _, value = token.partition("=")
            env[key] = value.replace("$PATH", env["PATH"]).replace("${PATH}", env["PATH"])
    return env


def image_env(dockerfile: Path) -> dict[str, str]:
    env = dockerfile_env(dockerfile)
    env["PATH"] = env["PATH"].replace(IMAGE_BIN, str(venv_bin()))
    return env
