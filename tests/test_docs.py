"""The README and docs/ stay true: links resolve, and the commands they show run.

Two checks over README.md, docs/*.md and engine/README.md:

- every relative link names a file that exists, and a ``#anchor`` into a markdown file names one
  of its headings (GitHub's slugs: lowercase, punctuation dropped except ``-`` and ``_``, spaces
  to ``-``, a ``-N`` suffix for repeats);
- every command in a fenced ``bash``/``sh`` block is a case here. It runs (from the repository
  root, with ``.venv/bin`` first on PATH, as the README says) when it matches RUNNABLE: commands
  that need no cluster, no network, no server and no long build, and write nothing. Every
  such command must exit 0. Any other command is skipped, with the rule that skips it as the
  reason. Output samples and synopses with placeholders belong in plain fences, not ``bash``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGES = sorted([REPO / "README.md", REPO / "engine" / "README.md", *(REPO / "docs").glob("*.md")])
README_MAX_LINES = 200

# Commands that run here, as written: (pattern over the whole command, why it is safe).
RUNNABLE = [
    (r"kiln( [a-z-]+){0,2} (--help|-h)", "help text"),
    (r"kiln --version", "version"),
    (r"kiln plan -f examples/[\w.-]+\.ya?ml( --json)?", "validates a manifest; no cluster"),
    (r"kiln crd", "prints the CRD"),
    (r"kiln render -f examples/[\w.-]+\.ya?ml", "renders objects; no cluster"),
]
# Filters a runnable command may be piped into.
FILTERS = {"grep", "head", "tail", "wc", "sort"}
# Why the other commands are skipped: the first rule that matches names it.
SKIP_RULES = [
    (r"^(kubectl|helm|docker)\b", "needs a cluster, a chart install or a container runtime"),
    (r"^make\b", "installs or builds for minutes"),
    (r"^curl\b", "needs a running server"),
    (r"^kiln (serve|up|operator)\b", "a long-running server"),
    (r"^kiln (build|bench|make-model)\b", "a long build or writes files"),
    (r"^kiln cache\b", "needs a store"),
    (r"^[A-Z_][A-Z0-9_]*=\S*$|^export\b", "sets a variable for the commands after it"),
]

FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if lang is None and match:
            lang, start, body = match.group(1), number + 1, []
        elif lang is not None and line.startswith("```"):
            blocks.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans (where links and headings are)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.+?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def _links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "target"), _links(),
                         ids=lambda v: v.relative_to(REPO).as_posix() if isinstance(v, Path) else v)
def test_relative_link_resolves(page: Path, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    assert dest.exists(), f"{page.relative_to(REPO)}: link {target!r}: no such file {dest}"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), (
            f"{page.relative_to(REPO)}: link {target!r}: no heading with slug {anchor!r} in "
            f"{dest.relative_to(REPO)}; have {sorted(anchors(dest))}")


def _commands(lines: list[str]) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and blank lines dropped.

    A quoted argument may span lines (as curl's JSON bodies do), so lines are joined until
    shlex can split the command.
    """
    commands, pending = [], ""
    for line in lines:
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            commands.append(" ".join(shlex.quote(w) if not re.fullmatch(r"[|&;<>]+", w) else w
                                     for w in words))
        pending = ""
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return commands


def _shell_commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for lang, start, body in _blocks(page.read_text()):
            if lang in ("bash", "sh", "shell"):
                for command in _commands(body):
                    out.append((f"{page.relative_to(REPO)}:{start}", command))
    return out


def classify(command: str) -> tuple[bool, str]:
    """(runs here, why): runnable commands match RUNNABLE, possibly piped into FILTERS."""
    first, *rest = [part.strip() for part in re.split(r"(?<!\|)\|(?!\|)", command)]
    for pattern, why in RUNNABLE:
        if re.fullmatch(pattern, first):
            if re.search(r"[;&<>`$]", command):
                return False, "uses the shell beyond a pipe (redirects, variables, lists)"
            if not all(part and part.split()[0] in FILTERS for part in rest):
                return False, "piped into a command outside the filters"
            return True, why
    for pattern, why in SKIP_RULES:
        if re.search(pattern, first):
            return False, why
    return False, "not in the allowlist"


SHELL_COMMANDS = _shell_commands()


@pytest.mark.parametrize(("where", "command"), SHELL_COMMANDS, ids=[f"{w} {c[:60]}" for w, c in SHELL_COMMANDS])
def test_shell_command_runs(where: str, command: str) -> None:
    runs, why = classify(command)
    if not runs:
        pytest.skip(f"skipped by rule: {why}")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("KILN_STORE", None)
    result = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}:\n{result.stderr[-2000:]}"


def test_shell_blocks_are_copy_pasteable() -> None:
    """``bash``/``sh`` blocks hold commands, not transcripts or placeholders; bash can parse them."""
    problems = []
    for page in PAGES:
        for lang, start, body in _blocks(page.read_text()):
            if lang not in ("bash", "sh", "shell"):
                continue
            where = f"{page.relative_to(REPO)}:{start}"
            for line in body:
                if line.startswith("$ "):
                    problems.append(f"{where}: a prompt ('$ ') in a shell block: {line!r}")
                if re.search(r"<[a-z][\w-]*>", line.split("#")[0]):
                    problems.append(f"{where}: a <placeholder> bash would read as a redirect: {line!r}")
            check = subprocess.run(["bash", "-n"], input="\n".join(body), capture_output=True, text=True)
            if check.returncode:
                problems.append(f"{where}: bash -n: {check.stderr.strip()}")
    assert not problems, "\n".join(problems)


def test_some_commands_run() -> None:
    """The allowlist is not vacuous: the README's tour has commands that run here."""
    readme = [c for w, c in SHELL_COMMANDS if w.startswith("README.md:") and classify(c)[0]]
    assert len(readme) >= 3, readme


def test_classify_rules() -> None:
    assert classify("kiln plan -f examples/cpu-small.yaml")[0]
    assert classify("kiln render -f examples/x.yaml | grep '^kind:'")[0]
    assert not classify("kiln render -f examples/x.yaml | kubectl apply -f -")[0]
    assert not classify("kiln crd --out crds/x.yaml")[0]
    assert not classify("kiln crd > crds/x.yaml")[0]
    assert classify("kubectl get llme")[1].startswith("needs a cluster")
    assert classify("kiln up -f examples/cpu-small.yaml")[1] == "a long-running server"


def test_readme_is_short_and_links_every_page() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "the README is an entry point; details go in docs/"
    index = (REPO / "docs" / "README.md").read_text()
    for page in (REPO / "docs").glob("*.md"):
        if page.name == "README.md":
            continue
        assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"
        assert f"({page.name})" in index, f"docs/README.md does not list {page.name}"


def test_slug_rules() -> None:
    assert slug("`kiln plan` and `kiln crd`") == "kiln-plan-and-kiln-crd"
    assert slug("The runtime (`kiln.engine`)") == "the-runtime-kilnengine"
    assert slug("The build report — an int8 build (`llama-demo`, gpu cpu, float32 + int8, 2-core CPU)") == (
        "the-build-report--an-int8-build-llama-demo-gpu-cpu-float32--int8-2-core-cpu")
