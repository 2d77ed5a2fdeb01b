"""Which package may import which (docs/architecture.md), read from the source with ast.

Every import counts, those inside functions included: a lazy import still ties the
two modules together. The rules:
- producer and worker never import each other; both import jobstore;
- server (spec-serve) imports only jobstore and producer of this project;
- jobstore, producer, reporting and server never reach MLX or the engine (a machine that only
  submits installs without them), not even through another module of this project;
- the engine never imports Redis or RQ; jobstore.stats and the jobstore package itself
  import neither Redis nor MLX, so the engine may use jobstore.stats;
- no import cycle anywhere in the tree.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = (
    "engine",
    "jobstore",
    "producer",
    "reporting",
    "server",
    "worker",
    "benchmarks",
    "scripts",
    "tests",
)
SUBMIT_SIDE = ("jobstore", "producer", "reporting", "server")
MLX = ("mlx", "mlx_lm", "engine")
REDIS = ("redis", "rq")

#: Cycles that exist today and are being removed elsewhere; each must still exist (the
#: test says when one is gone, so the entry is deleted), and no other may appear.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if ".venv" not in path.parts:
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Fully qualified names this module imports (modules, or modules' attributes)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def _project_edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (an attribute import counts as its module)."""
    edges = {}
    for name, path in MODULES.items():
        targets = set()
        for imported in _imports(name, path):
            while imported and imported not in MODULES:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


EDGES = _project_edges()
# Direct imports of every module, project or not (top-level names: "mlx", "redis", ...).
TOPS = {
    name: {i.split(".")[0] for i in _imports(name, path) if i} for name, path in MODULES.items()
}


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return name.split(".")[0] in packages


def _reach(start: str) -> dict[str, list[str]]:
    """Every project module reachable from start, with one import path to it."""
    paths, todo = {start: [start]}, [start]
    while todo:
        current = todo.pop()
        for nxt in sorted(EDGES[current]):
            if nxt not in paths:
                paths[nxt] = paths[current] + [nxt]
                todo.append(nxt)
    return paths


def test_the_scan_sees_the_tree():
    assert {"jobstore.stats", "producer.cli", "worker.cli", "engine.core"} <= MODULES.keys()
    assert "producer.batches" in EDGES["server.batches"]
    assert "jobstore.keys" in EDGES["producer.submit"]
    assert "engine" in TOPS["worker.execute"]


def test_producer_and_worker_never_import_each_other():
    bad = [
        f"{a} imports {b}"
        for a, targets in EDGES.items()
        for b in targets
        if {a.split(".")[0], b.split(".")[0]} == {"producer", "worker"}
    ]
    assert bad == []


def test_the_server_imports_only_jobstore_and_producer():
    bad = [
        f"{a} imports {b}"
        for a, targets in EDGES.items()
        if _in(a, ("server",))
        for b in targets
        if not _in(b, ("jobstore", "producer", "server"))
    ]
    assert bad == []


def test_the_submit_side_never_reaches_mlx_or_the_engine():
    bad = []
    for start in (m for m in MODULES if _in(m, SUBMIT_SIDE)):
        for module, path in _reach(start).items():
            hits = sorted(TOPS[module] & set(MLX)) or (
                ["engine"] if _in(module, ("engine",)) else []
            )
            if hits:
                bad.append(f"{' -> '.join(path)} imports {', '.join(hits)}")
                break
    assert bad == []


def test_the_engine_knows_no_redis():
    bad = [f"{m} imports {t}" for m in MODULES if _in(m, ("engine",)) for t in TOPS[m] & set(REDIS)]
    assert bad == []


def test_jobstore_stats_and_the_package_import_neither_redis_nor_mlx():
    for start in ("jobstore", "jobstore.stats"):
        for module, path in _reach(start).items():
            assert not TOPS[module] & set(REDIS + MLX), " -> ".join(path)


def _cycles() -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(frozenset(component))

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere():
    cycles = _cycles()
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert new == [], "import cycles"
    assert gone == [], "no longer a cycle: delete it from KNOWN_CYCLES"


def test_submitting_loads_no_mlx():
    """What the ast says, checked in a real interpreter: the submit-side commands import
    without MLX or the engine."""
    code = (
        "import sys, producer.cli, reporting.report, jobstore.store, jobstore.stats\n"
        "import server.app, server.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'engine'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
