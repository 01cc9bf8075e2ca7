"""The house's floors hold: every module of the library and its shell sits on a floor, no module
imports one on a floor above its own, and no set of modules imports itself in a circle.

Every import counts, wherever it is written: at the top of a module, inside a function (a lazy
import is still a dependency) and under ``if TYPE_CHECKING:`` (a type is still a dependency of the
design). ``from package import name`` is an import of the module ``package.name`` when there is one.
A new module gets a floor here, deliberately; docs/architecture.md describes the floors."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("k3pipe", "ops", "flows", "tasks", "cli")

# (floor, the modules on it: a name covers the module and, with ".*", every module below it)
FLOORS: list[tuple[str, list[str]]] = [
    (
        "ground: errors, secrets, settings, processes, the statistics (nothing of k3pipe's above)",
        [
            "k3pipe.errors", "k3pipe.secrets", "k3pipe.settings", "k3pipe.procs", "k3pipe.figures",
            "k3pipe.stats", "k3pipe.series", "k3pipe.capacity", "k3pipe.provenance", "k3pipe.observe",
            "k3pipe.kvpool", "k3pipe.owners", "k3pipe.answers", "k3pipe.layout",
        ],
    ),
    (
        "specs: the experiment as data, the engines' knowledge, what a study runs",
        [
            "k3pipe.launchers.specs", "k3pipe.specs", "k3pipe.schedule", "k3pipe.engines", "k3pipe.engines.*",
            "k3pipe.experiment", "k3pipe.variants", "k3pipe.params", "k3pipe.preflight", "k3pipe.speculation",
        ],
    ),
    (
        "plan and inputs: an arm's plan, its models, images and prompts",
        [
            "k3pipe.plan", "k3pipe.sources", "k3pipe.sources.*", "k3pipe.coldstart", "k3pipe.bench.datasets",
            "k3pipe.bench.corpus_tools", "k3pipe.bench.documents", "k3pipe.bench.sharegpt",
            "k3pipe.bench.corpora", "k3pipe.bench.prompts",
        ],
    ),
    (
        "machines: launchers, the node, the engine's health and metrics, the load generator",
        [
            "k3pipe.launchers", "k3pipe.launchers.base", "k3pipe.launchers.process",
            "k3pipe.launchers.docker", "k3pipe.launchers.external", "k3pipe.launchers.gpustack",
            "k3pipe.launchers.factory",
            "k3pipe.node", "k3pipe.cost", "k3pipe.metrics", "k3pipe.health", "k3pipe.bench",
            "k3pipe.bench.records",
            "k3pipe.bench.transport", "k3pipe.bench.warmup", "k3pipe.bench.repeats", "k3pipe.bench.client",
            "k3pipe.bench.shards", "k3pipe.bench.watch", "k3pipe.bench.summary", "k3pipe.bench.session",
            "k3pipe.bench.probe", "k3pipe.bench.structured", "k3pipe.bench.accuracy",
        ],
    ),
    (
        "records: MLflow and the spool, what a run records, the reports",
        [
            "k3pipe.spool", "k3pipe.push", "k3pipe.tracking", "k3pipe.runrecord", "k3pipe.record",
            "k3pipe.compare", "k3pipe.history", "k3pipe.sync", "k3pipe.report", "k3pipe.report.*",
            "k3pipe.priors", "k3pipe.design",
        ],
    ),
    (
        "lifetimes: an arm's run, a study (and its resume), a rerun, a retest",
        ["k3pipe.run", "k3pipe.fleet", "k3pipe.rerun", "k3pipe.alerts", "k3pipe.study", "k3pipe.resume",
         "k3pipe.retest", "k3pipe.jobs", "k3pipe.jobs.*"],
    ),
    ("the facade: `import k3pipe`", ["k3pipe"]),
    ("operations, a wing beside the library: the team stack, the offline bundle", ["ops", "ops.*"]),
    (
        "shell: Prefect tasks and flows, the command line",
        ["tasks", "tasks.*", "flows", "flows.*", "cli", "cli.*"],
    ),
]  # fmt: skip


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``found`` it imports, at any depth of its file."""

    def resolve(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in found.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in found]
                names = subs or [base]
            else:
                continue
            targets.update(t for name in names if (t := resolve(name)) is not None and t != module)
        edges[module] = targets
    return edges


def floor_of(module: str) -> int | None:
    for level, (_, names) in enumerate(FLOORS):
        for name in names:
            if module == name or (name.endswith(".*") and module.startswith(name[:-1])):
                return level
    return None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor, as 'a (floor) -> b (floor)'."""
    found = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            fa, fb = floor_of(a), floor_of(b)
            if fa is not None and fb is not None and fb > fa:
                found.append(f"{a} ({FLOORS[fa][0].split(':')[0]}) -> {b} ({FLOORS[fb][0].split(':')[0]})")
    return found


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, or None."""
    try:
        tuple(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_every_module_has_a_floor() -> None:
    unplaced = sorted(m for m in modules(REPO, PACKAGES) if floor_of(m) is None)
    assert unplaced == [], f"give these modules a floor in tests/unit/test_layers.py: {unplaced}"


def test_no_module_imports_one_above_it() -> None:
    assert upward(imports(modules(REPO, PACKAGES))) == []


def test_no_circle() -> None:
    assert circle(imports(modules(REPO, PACKAGES))) is None


def private_imports(root: Path, package: str) -> list[str]:
    """``file:line: module.name`` for each private name (``_x``) a module of ``package`` imports
    from another module of it: what two modules share is public in one of them, or in a third."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_the_flows_share_no_private_helpers() -> None:
    """The flows once imported each other's private helpers; what they share lives in flows.runtime."""
    assert private_imports(REPO, "flows") == []


def test_the_private_import_scan_finds_one(tmp_path: Path) -> None:
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "a.py").write_text("from flows.b import public, _private\n")
    assert private_imports(tmp_path, "flows") == ["flows/a.py:1: flows.b._private"]


def test_the_scan_sees_lazy_and_type_checking_imports_and_circles(tmp_path: Path) -> None:
    pkg = tmp_path / "k3pipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from k3pipe.specs import Spec\n"
    )
    (pkg / "specs.py").write_text("def f():\n    from . import errors\n")
    edges = imports(modules(tmp_path, ("k3pipe",)))
    assert edges["k3pipe.errors"] == {"k3pipe.specs"}
    assert edges["k3pipe.specs"] == {"k3pipe.errors"}
    assert upward(edges) == ["k3pipe.errors (ground) -> k3pipe.specs (specs)"]
    assert set(circle(edges) or []) == {"k3pipe.errors", "k3pipe.specs"}
