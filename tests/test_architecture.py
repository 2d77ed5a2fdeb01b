"""Which package may import which (docs/architecture.md), read from the source with ast.

Every import counts, those inside functions included: a lazy import still ties the two
modules together. Every rule is about what a module *reaches* (its imports, their
imports, and so on), not only what it names itself:
- `contract` reaches nothing of this project but itself, and nothing outside the
  standard library (`sys.stdlib_module_names`); every package may import it;
- the engine reaches, of this project, only `contract`, and nothing on its paths
  imports Redis or RQ;
- jobstore reaches nothing of this project but itself and contract; reporting only
  jobstore; producer jobstore and reporting; server (the HTTP submit side) jobstore,
  producer and reporting; none of them, nor anything they reach, imports MLX;
- worker reaches engine, jobstore and reporting, never producer (and producer never
  worker: what both need goes in jobstore);
- a top-level package the page does not name yet is checked as submit side (no MLX,
  no engine, no worker), and the others may import it only if their own rule holds
  through it;
- no import cycle anywhere in the tree.

The checker takes a graph, so the mutation tests at the end build graphs that break
each rule (a temporary package tree, and edges added to the real graph) and watch it fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Folders of scripts and tests (no package file): scanned, bound by no rule but "no cycle".
TOOLS = ("benchmarks", "scripts", "tests")
MLX = frozenset({"mlx", "mlx_lm"})
REDIS = frozenset({"redis", "rq"})


@dataclass(frozen=True)
class Rule:
    """What every module of a package may reach through its imports."""

    says: str  # the rule as docs/architecture.md words it
    packages: frozenset[str]  # project packages it may reach, every module of them
    banned: frozenset[str] = frozenset()  # outside names nothing it reaches may import
    stdlib_only: bool = False  # nothing it reaches imports anything but the standard library


def _rule(says: str, packages=(), banned=frozenset(), stdlib_only=False) -> Rule:
    # Every package may import the contract (standard library only, reaching nothing).
    return Rule(says, frozenset(packages) | {"contract"}, frozenset(banned), stdlib_only)


#: Per top-level package. A package not listed here gets SUBMIT_SIDE (its own name added).
RULES: dict[str, Rule] = {
    "contract": _rule(
        "contract -> nothing of this project; standard library only", stdlib_only=True
    ),
    "engine": _rule("engine -> contract only; no Redis or RQ", ["engine"], REDIS),
    "jobstore": _rule("jobstore -> contract only; no MLX", ["jobstore"], MLX),
    "producer": _rule(
        "producer -> jobstore, reporting; no MLX", ["producer", "jobstore", "reporting"], MLX
    ),
    "reporting": _rule("reporting -> jobstore; no MLX", ["reporting", "jobstore"], MLX),
    "worker": _rule(
        "worker -> engine, jobstore, reporting; never producer",
        ["worker", "engine", "jobstore", "reporting"],
    ),
    "server": _rule(
        "server -> jobstore, producer, reporting; no MLX",
        ["server", "jobstore", "producer", "reporting"],
        MLX,
    ),
}
SUBMIT_SIDE = _rule(
    "a package docs/architecture.md does not name is submit side: no MLX, engine or worker",
    ["jobstore", "producer", "reporting", "server"],
    MLX,
)


@dataclass
class Graph:
    """Modules of a tree: project modules each imports, and the top-level names of all
    it imports (outside packages such as "mlx" or "redis" included)."""

    edges: dict[str, set[str]]
    tops: dict[str, set[str]]
    packages: set[str] = field(default_factory=set)  # the tree's top-level names


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _trees(root: Path) -> list[str]:
    """The tool folders, and every top-level folder that is a Python package."""
    found = [t for t in TOOLS if (root / t).is_dir()]
    for path in sorted(root.iterdir()):
        if path.name not in found and (path / "__init__.py").is_file():
            found.append(path.name)
    return found


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


def scan(root: Path) -> Graph:
    """The import graph of every module under root's packages and tool folders."""
    trees = _trees(root)
    paths = {}
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            if ".venv" not in path.relative_to(root).parts:
                paths[_module_name(root, path)] = path
    edges, tops = {}, {}
    for name, path in paths.items():
        imported = {i for i in _imports(name, path) if i}
        targets = set()
        for target in imported:
            while target and target not in paths:  # an attribute import counts as its module
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
        tops[name] = {i.split(".")[0] for i in imported}
    return Graph(edges, tops, set(trees))


def _top(module: str) -> str:
    return module.split(".")[0]


def rule_for(package: str) -> Rule | None:
    """The package's rule; None for the tool folders."""
    if package in TOOLS:
        return None
    if package in RULES:
        return RULES[package]
    base = SUBMIT_SIDE
    return Rule(base.says, base.packages | {package}, base.banned)


def _allowed(rule: Rule, module: str) -> bool:
    top = _top(module)
    # A package without a rule of its own may be imported; the walk goes on through it,
    # except from a standard-library-only package (its import is itself outside).
    unnamed = top not in RULES and top not in TOOLS and not rule.stdlib_only
    return top in rule.packages or unnamed


def _outside(rule: Rule, tops: set[str]) -> list[str]:
    """What of these imported top-level names the rule forbids."""
    hits = tops & rule.banned
    if rule.stdlib_only:
        hits |= tops - sys.stdlib_module_names - rule.packages
    return sorted(hits)


def _check(graph: Graph, start: str, rule: Rule) -> dict[tuple[str, str], list[str]]:
    """{(module reached, what is wrong with it): a shortest import path to it}, walking
    from start; the walk stops at the first module on a path that breaks the rule."""
    bad, paths, todo = {}, {start: [start]}, deque([start])
    while todo:
        module = todo.popleft()
        path = paths[module]
        if not _allowed(rule, module):
            bad[module, f"breaks '{rule.says}'"] = path
            continue
        if hits := _outside(rule, graph.tops.get(module, set())):
            bad[module, f"imports {', '.join(hits)}, breaks '{rule.says}'"] = path
        for nxt in sorted(graph.edges.get(module, ())):
            if nxt not in paths:
                paths[nxt] = path + [nxt]
                todo.append(nxt)
    return bad


def violations(graph: Graph) -> list[str]:
    """Every module reached against a rule, with the shortest path that reaches it, one
    line each: "a -> b -> c: breaks '...'"."""
    found: dict[tuple[str, str], list[str]] = {}
    for module in sorted(graph.edges):
        rule = rule_for(_top(module))
        if rule is None:
            continue
        for key, path in _check(graph, module, rule).items():
            if key not in found or len(path) < len(found[key]):
                found[key] = path
    return sorted(f"{' -> '.join(path)}: {what}" for (_, what), path in found.items())


def cycles(graph: Graph) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.edges[v]):
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

    for v in sorted(graph.edges):
        if v not in index:
            visit(v)
    return out


GRAPH = scan(ROOT)


# -- the real tree ---------------------------------------------------------------------------


def test_the_scan_sees_the_tree():
    assert {"contract.stats", "producer.cli", "worker.cli", "engine.core"} <= GRAPH.edges.keys()
    assert "jobstore.keys" in GRAPH.edges["producer.submit"]
    assert "engine" in GRAPH.tops["worker.execute"]
    assert "reporting.progress" in GRAPH.edges["producer.cli"]  # a function-level import
    assert {"contract", "engine", "jobstore", "producer", "reporting", "worker"} <= GRAPH.packages
    assert "contract" in GRAPH.edges["engine.types"] and "tests" in GRAPH.packages


def test_every_import_path_keeps_the_rules():
    bad = violations(GRAPH)
    assert not bad, "\n".join(bad)


def test_packages_without_a_rule_are_checked_as_submit_side():
    unnamed = sorted(p for p in GRAPH.packages if p not in RULES and p not in TOOLS)
    if unnamed:
        warnings.warn(
            f"no rule for {unnamed} in tests/test_architecture.py: checked as submit side; "
            "name them in docs/architecture.md and RULES",
            stacklevel=1,
        )
    for package in unnamed:
        assert rule_for(package).banned == MLX


def test_no_import_cycle_anywhere():
    found = sorted(sorted(c) for c in cycles(GRAPH))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_submitting_loads_no_mlx():
    """What the ast says, checked in a real interpreter: the submit-side commands import
    without MLX or the engine."""
    code = (
        "import sys, producer.cli, reporting.report, jobstore.store, contract\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'engine'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_contract_imports_only_the_standard_library():
    """Read from the source, and checked in a fresh interpreter (no site packages):
    importing the contract loads nothing but it and the standard library."""
    contract = [m for m in GRAPH.tops if _top(m) == "contract"]
    assert len(contract) >= 4
    for module in contract:
        assert GRAPH.tops[module] - {"contract"} <= sys.stdlib_module_names, module
    code = (
        "import sys\nbefore = set(sys.modules)\nimport contract\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}"
        " - sys.stdlib_module_names))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "['contract']"


# -- each rule fails when it is broken -------------------------------------------------------

#: A small tree in the shape of the real one, within the rules: the mutants below break it.
FAKE_TREE = {
    "contract/__init__.py": "from contract import stats\n",
    "contract/stats.py": "from __future__ import annotations\nimport math\n",
    "engine/__init__.py": "",
    "engine/core.py": "from contract import stats\n",
    "engine/batch.py": "from engine import core\n",
    "jobstore/__init__.py": "",
    "jobstore/store.py": "import redis\nfrom contract import stats\n",
    "producer/__init__.py": "",
    "producer/cli.py": "from jobstore import store\n\ndef watch():\n    from reporting import progress\n",
    "reporting/__init__.py": "",
    "reporting/progress.py": "import rich\nimport contract\n",
    "worker/__init__.py": "",
    "worker/jobs.py": "import mlx.core\nimport engine.batch, jobstore.store, reporting.progress\n",
    "server/__init__.py": "",
    "server/app.py": "import fastapi\nfrom producer import cli\nfrom contract import stats\n",
    "newpkg/__init__.py": "import json\nimport contract\n",
    "tests/test_x.py": "import engine.batch, producer.cli, worker.jobs\n",
}

#: ({file: an import added inside a function}, the rule that must fail, a module on its path)
MUTANTS = [
    ({"engine/batch.py": "import jobstore.store"}, "engine -> contract only", "jobstore.store"),
    ({"engine/core.py": "import jobstore"}, "engine -> contract only", "jobstore"),
    ({"engine/core.py": "from producer import cli"}, "engine -> contract only", "producer.cli"),
    ({"engine/core.py": "import rq"}, "no Redis or RQ", "engine.core"),
    # Transitive: the engine's own files are unchanged; what it imports now reaches jobstore.
    ({"contract/stats.py": "from jobstore import store"}, "engine -> contract", "engine.core"),
    ({"contract/stats.py": "from jobstore import store"}, "contract -> nothing", "jobstore"),
    ({"contract/stats.py": "import redis"}, "standard library only", "contract.stats"),
    ({"contract/stats.py": "import redis"}, "no Redis or RQ", "contract.stats"),
    ({"contract/stats.py": "import pydantic"}, "standard library only", "contract.stats"),
    ({"contract/__init__.py": "import engine.core"}, "contract -> nothing", "engine.core"),
    # A package without a rule is no way out of the contract's.
    ({"contract/stats.py": "import newpkg"}, "contract -> nothing", "newpkg"),
    ({"jobstore/store.py": "import reporting.progress"}, "jobstore -> contract", "jobstore.store"),
    ({"jobstore/store.py": "import mlx_lm"}, "jobstore -> contract", "jobstore.store"),
    ({"producer/cli.py": "import worker.jobs"}, "producer -> jobstore, reporting", "worker.jobs"),
    # Transitive: through reporting, worker reaches producer, and producer worker.
    ({"reporting/progress.py": "import producer.cli"}, "never producer", "reporting.progress"),
    ({"reporting/progress.py": "import worker.jobs"}, "producer -> jobstore", "reporting.progress"),
    ({"reporting/progress.py": "import engine.core"}, "reporting -> jobstore", "engine.core"),
    ({"worker/jobs.py": "import server.app"}, "never producer", "server.app"),
    ({"server/app.py": "import engine.batch"}, "server -> jobstore", "engine.batch"),
    ({"server/app.py": "import mlx.core"}, "server -> jobstore", "server.app"),
    ({"newpkg/__init__.py": "import mlx_lm"}, "is submit side", "newpkg"),
    ({"newpkg/__init__.py": "import worker.jobs"}, "is submit side", "worker.jobs"),
    # Through a package without a rule: the importer's own rule holds through it.
    (
        {"engine/core.py": "import newpkg", "newpkg/__init__.py": "import jobstore.store"},
        "engine -> contract only",
        "newpkg",
    ),
]


def _write_tree(root: Path, added: dict[str, str] | None = None) -> Path:
    """FAKE_TREE under root, each file of `added` with one more import inside a function."""
    for rel, text in FAKE_TREE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        line = (added or {}).get(rel)
        (root / rel).write_text(text + (f"\n\ndef _lazy():\n    {line}\n" if line else ""))
    return root


def test_the_fake_tree_keeps_every_rule(tmp_path):
    graph = scan(_write_tree(tmp_path))
    assert violations(graph) == [] and cycles(graph) == set()
    assert "reporting.progress" in graph.edges["producer.cli"]
    names = {"contract", "engine", "jobstore", "producer", "reporting", "worker", "server"}
    names |= {"newpkg", "tests"}
    assert graph.packages == names


@pytest.mark.parametrize("added, rule, on_path", MUTANTS)
def test_each_rule_fails_on_a_forbidden_import(tmp_path, added, rule, on_path):
    found = violations(scan(_write_tree(tmp_path, added)))
    hits = [v for v in found if rule in v]
    assert hits, found
    assert any(on_path in v.split(":")[0].split(" -> ") for v in hits), hits


def test_a_cycle_fails(tmp_path):
    graph = scan(_write_tree(tmp_path, {"engine/core.py": "from engine import batch"}))
    assert cycles(graph) == {frozenset({"engine.core", "engine.batch"})}


@pytest.mark.parametrize(
    "source, target, rule",
    [
        ("engine.batch", "jobstore.store", "engine -> contract only"),
        ("engine.types", "jobstore", "engine -> contract only"),
        ("engine.batch", "producer.status", "engine -> contract only"),
        ("contract.stats", "jobstore.keys", "contract -> nothing"),
        ("contract.stats", "jobstore.keys", "engine -> contract only"),  # engine.types reaches it
        ("contract.limits", "engine.core", "contract -> nothing"),
        ("producer.cli", "worker.execute", "producer -> jobstore, reporting"),
        ("reporting.progress", "producer.cli", "never producer"),  # worker.local reaches it
        ("jobstore.lines", "reporting.progress", "jobstore -> contract only"),
        ("reporting.report", "engine.core", "reporting -> jobstore"),
    ],
)
def test_an_edge_added_to_the_real_graph_fails(source, target, rule):
    edges = {k: set(v) for k, v in GRAPH.edges.items()}
    edges[source].add(target)
    found = violations(Graph(edges, GRAPH.tops, GRAPH.packages))
    assert any(rule in v for v in found), found


@pytest.mark.parametrize("outside", ["pydantic", "redis", "numpy"])
def test_an_outside_import_added_to_the_contract_fails(outside):
    tops = {k: set(v) for k, v in GRAPH.tops.items()}
    tops["contract.defaults"].add(outside)
    found = violations(Graph(GRAPH.edges, tops, GRAPH.packages))
    assert any(
        v.startswith("contract.defaults:") and "standard library only" in v for v in found
    ), found
