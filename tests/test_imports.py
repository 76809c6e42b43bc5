"""The import structure of ``qualify/`` and ``harnesses/`` (docs/engine-guide.md, layout).

- every module imports (in a fresh interpreter, so no test's earlier imports help it);
- ``import qualify`` and ``import qualify.cli.main`` import no engine (vllm, deepspeed,
  megatron) and not torch: engines are found through :mod:`qualify.registry` by lazy
  strings;
- no import cycle: the graph is read with :mod:`ast` from the sources, every ``import`` and
  ``from ... import`` statement an edge, wherever it stands (module level, inside a function,
  under ``if TYPE_CHECKING``): a lazy or type-only import still couples the two modules,
  and each hop of a reported cycle says which kind it is;
- no ``qualify`` module imports ``harnesses`` statically (harnesses are found by string).

There is no line cap: a module is split along a real seam, never to meet a count.
"""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
PACKAGES: Final = ("qualify", "harnesses")
ENGINES: Final = ("vllm", "deepspeed", "megatron")


def module_files() -> dict[str, Path]:
    """Every module of :data:`PACKAGES` by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES: Final = module_files()


def _resolve(name: str, known: Iterable[str]) -> str | None:
    """The deepest module of ``known`` that ``name`` is or lies in (``None``: outside)."""
    known = set(known)
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


#: How an import statement runs, strongest first: at import time, when a function runs,
#: only for the type checker (``if TYPE_CHECKING:``). Every kind is an edge of the graph.
KINDS: Final = ("module", "lazy", "TYPE_CHECKING")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(module: str, path: Path, known: Mapping[str, Path]
                     ) -> dict[str, tuple[int, str]]:
    """The modules of ``known`` that ``module`` imports: ``{target: (line, kind)}``.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``; relative imports are resolved against ``module``'s package. ``kind`` is one of
    :data:`KINDS`, the strongest over the statements importing ``target`` (its first line).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    edges: dict[str, tuple[int, str]] = {}

    def add(target: str | None, line: int, kind: str) -> None:
        if target is None or target == module:
            return
        old = edges.get(target)
        if old is None or KINDS.index(kind) < KINDS.index(old[1]):
            edges[target] = (line, kind)

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, known), node.lineno, kind)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(_resolve(sub if sub in known else base, known), node.lineno, kind)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit(stmt, "TYPE_CHECKING")
            for stmt in node.orelse:
                visit(stmt, kind)
            return
        inner = "lazy" if kind == "module" and isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else kind
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, "module")
    return edges


def import_graph() -> dict[str, dict[str, tuple[int, str]]]:
    """``{module: {imported module: (line, kind)}}`` over :data:`MODULES`."""
    return {m: imported_modules(m, p, MODULES) for m, p in MODULES.items()}


def find_cycles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component of size > 1
    (or a self-loop), by Tarjan's algorithm then a search inside the component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, {}):
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles: list[list[str]] = []
    for comp in components:
        members = set(comp)
        start = comp[0]
        # breadth-first from start back to start, inside the component: a shortest cycle
        prev: dict[str, str] = {}
        frontier = [start]
        found: str | None = None
        while frontier and found is None:
            nxt: list[str] = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        assert found is not None
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append([start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start])
    return cycles


def describe(cycle: list[str], graph: Mapping[str, Mapping[str, tuple[int, str]]]) -> str:
    """``a (a.py:12 module) -> b (b.py:40 lazy) -> a``: each hop with the importing line."""
    hops = [f"{a} ({MODULES[a].relative_to(ROOT)}:{graph[a][b][0]} {graph[a][b][1]})"
            for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*hops, cycle[-1]])


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter from the repository root; its stdout."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


# --------------------------------------------------------------------------- the tests


def test_the_graph_reader_on_a_known_cycle(tmp_path: Path) -> None:
    """The cycle finder reports a cycle with its path, and none on a DAG."""
    dag = {"a": {"b": 1}, "b": {"c": 2}, "c": {}}
    assert find_cycles(dag) == []
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 1}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "from . import n\nfrom .n import x\nimport os\n\ndef f():\n    from p.q import r\n"
        "if TYPE_CHECKING:\n    import p.r.s\n    from p import q\n")
    known = {"p": pkg, "p.m": pkg / "m.py", "p.n": pkg / "n.py", "p.q": pkg / "q.py",
             "p.r": pkg / "r"}
    assert imported_modules("p.m", pkg / "m.py", known) == {
        "p.n": (1, "module"), "p.q": (6, "lazy"), "p.r": (8, "TYPE_CHECKING")}


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_qualify_never_imports_harnesses_statically() -> None:
    graph = import_graph()
    bad = [f"{m} ({MODULES[m].relative_to(ROOT)}:{line}) imports {t}"
           for m, edges in graph.items() if m.split(".")[0] == "qualify"
           for t, (line, _) in edges.items() if t.split(".")[0] == "harnesses"]
    assert not bad, "\n".join(bad)


def test_every_module_imports() -> None:
    names = [m for m in MODULES if m.rsplit(".", 1)[-1] != "__main__"]
    code = (
        "import importlib, json, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "failed = {}\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException as exc:\n"
        "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(failed))\n")
    failed = json.loads(run_python(code).splitlines()[-1])
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


@pytest.mark.parametrize("module", ["qualify", "qualify.cli.main"])
def test_import_is_engine_free(module: str) -> None:
    code = (f"import sys, json\nimport {module}\n"
            f"print(json.dumps(sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {[*ENGINES, 'torch']!r})))\n")
    loaded = json.loads(run_python(code).splitlines()[-1])
    assert loaded == [], f"import {module} loads {loaded}"
