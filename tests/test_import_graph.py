"""The import graph: modules arranged in layers, the lower never importing the upper.

Every ``import`` in every file counts -- at module level, under ``if TYPE_CHECKING``, inside a function -- since
a deferred import hides a cycle rather than breaking it. Within one component (the core, the engine, the
builder, the serving image, the operator) the modules form no cycle; the engine's layers and config never
import the tactics above them (llama.cpp's ggml-cpu: the op asks the kernel table beneath it, and nothing
the table holds imports the ops). The CPU kernels' C sources are held to the same: no include cycle, no
``.c`` file included by another, and no two files calling each other's ``kiln_*`` functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kiln": "kiln", "operator": "kiln.operator", "engine": "kiln.engine", "builder_job": "kiln.builder",
           "serving_image": "kiln.serving"}
COMPONENTS = {"kiln.engine": "engine", "kiln.builder": "builder", "kiln.serving": "serving",
              "kiln.operator": "operator", "kiln": "core"}
CSRC = ROOT / "engine" / "kernels" / "csrc"

# Cycles known today in components whose owners have not broken them yet, each as the set of modules it runs
# through (a cycle found inside one of these sets passes). Empty it as they go; the test says when an entry is
# stale.
KNOWN_CYCLES: list[frozenset[str]] = []


def modules() -> dict[str, Path]:
    """Every module of the five packages: import name -> file."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _known(name: str, known: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``known``'s modules (None: not kiln's)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kiln modules ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(_known(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = ".".join(p for p in (base, node.module) if p)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else _known(base, known))
    out.discard(None)
    out.discard(module)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def component(module: str) -> str:
    return next(COMPONENTS[p] for p in sorted(COMPONENTS, key=len, reverse=True)
                if module == p or module.startswith(p + "."))


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(scc)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def a_cycle(edges: dict[str, set[str]], scc: set[str]) -> list[str]:
    """One shortest cycle through the first node of ``scc``, as a path that returns to it."""
    start = min(scc)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, ()) & scc):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError("not a cycle")


def cycles_within_components(edges: dict[str, set[str]]) -> list[tuple[set[str], list[str]]]:
    inside = {v: {w for w in ws if component(w) == component(v)} for v, ws in edges.items()}
    return [(scc, a_cycle(inside, scc)) for scc in strongly_connected(inside)]


def test_no_import_cycle_within_a_component():
    found = cycles_within_components(graph())
    new = [" -> ".join(path) for scc, path in found if not any(scc <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles (break them: the lower module must not import the upper):\n" + "\n".join(new)
    stale = [sorted(known) for known in KNOWN_CYCLES if not any(scc <= known for scc, _ in found)]
    assert not stale, f"these cycles are gone: remove them from KNOWN_CYCLES: {stale}"


def test_layers_and_config_never_import_the_tactics():
    edges = graph()
    upward = sorted(f"{v} -> {w}" for v, ws in edges.items() for w in ws
                    if (v == "kiln.engine.config" or v.startswith("kiln.engine.layers."))
                    and (w == "kiln.engine.tactics" or w.startswith("kiln.engine.tactics.")))
    assert not upward, "the tactics sit above the layers and config (the candidate table is kernels.candidates):\n" \
                       + "\n".join(upward)


def test_the_kernels_import_nothing_above_them():
    """The kernel table (kernels.candidates) and the kernels beneath it are the bottom of the engine's ops."""
    above = ("kiln.engine.tactics", "kiln.engine.layers", "kiln.engine.models", "kiln.engine.config")
    edges = graph()
    upward = sorted(f"{v} -> {w}" for v, ws in edges.items() if v.startswith("kiln.engine.kernels.") for w in ws
                    if any(w == a or w.startswith(a + ".") for a in above))
    assert not upward, "kiln.engine.kernels imports modules above it:\n" + "\n".join(upward)


def test_the_graph_sees_every_kind_of_import():
    """The parser counts function-level imports and resolves ``from pkg import module`` to the module."""
    edges = graph()
    assert "kiln.engine.kernels.candidates" in edges["kiln.engine.layers.linear"]
    assert "kiln.engine.kernels.candidates" in edges["kiln.engine.tactics.resolve"]
    assert "kiln.engine.kernels.isa" in edges["kiln.engine.kernels.native"]
    assert {"kiln.engine.kernels.cpu_library", "kiln.engine.kernels.packed"} <= edges["kiln.engine.kernels.native"]
    assert not strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()})
    assert strongly_connected({"a": {"b"}, "b": {"a"}}) == [{"a", "b"}]
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, {"a", "b", "c"}) == ["a", "b", "c", "a"]


def _c_code(path: Path) -> str:
    """The file without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(\\.|[^"\\\n])*"', '""', text)


def c_includes() -> dict[str, set[str]]:
    """File name -> the local files it ``#include "..."``s."""
    return {p.name: set(re.findall(r'^\s*#\s*include\s*"([^"]+)"', p.read_text(), re.M))
            for p in sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")])}


def c_calls() -> dict[str, set[str]]:
    """.c file -> the other .c files whose ``kiln_*`` functions it calls (a definition: at brace depth 0,
    the name, its parameters, then a body)."""
    defined: dict[str, str] = {}
    called: dict[str, set[str]] = {}
    for path in sorted(CSRC.glob("*.c")):
        code = _c_code(path)
        code = re.sub(r"^\s*#[^\n]*(\\\n[^\n]*)*", " ", code, flags=re.M)  # directives and multi-line macros
        depth, names = 0, set()
        for m in re.finditer(r"[{}]|\bkiln_\w+(?=\s*\()", code):
            token = m.group()
            if token == "{":
                depth += 1
            elif token == "}":
                depth -= 1
            elif depth == 0 and re.match(r"\s*\((?:[^()]|\([^()]*\))*\)\s*\{", code[m.end():]):
                defined.setdefault(token, path.name)
            elif depth > 0:
                names.add(token)
        called[path.name] = names
    return {name: {defined[f] for f in fns if f in defined} - {name} for name, fns in called.items()}


def test_the_c_sources_include_no_cycle_and_no_c_file():
    includes = c_includes()
    assert "kiln_cpu.h" in includes["gemm.c"]
    dot_c = sorted(f"{src} includes {dst}" for src, dsts in includes.items() for dst in dsts if dst.endswith(".c"))
    assert not dot_c, dot_c
    found = [" -> ".join(a_cycle(includes, scc)) for scc in strongly_connected(includes)]
    assert not found, f"include cycles: {found}"


def test_the_c_files_call_each_other_one_way():
    """The GEMMs (gemm.c, gemm_amx.c) sit beneath the int8 GEMM that widens into them (gemm_int8.c), and all
    three beneath the tactic dispatch (kiln_gemm) that the module path and the decoder stack call."""
    calls = c_calls()
    assert "gemm.c" in calls["gemm_int8.c"]  # the parser sees calls across files
    found = [" -> ".join(a_cycle(calls, scc)) for scc in strongly_connected(calls)]
    assert not found, f"C files calling each other: {found}"
