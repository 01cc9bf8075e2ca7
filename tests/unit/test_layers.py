"""The house's floors hold: the library's folders are its floors. ``k3pipe/`` holds packages only
(and its facade, ``__init__.py``), each package sits on one floor, no module imports one on a floor
above its own, and no set of modules imports itself in a circle.

Every import counts, wherever it is written: at the top of a module, inside a function (a lazy
import is still a dependency) and under ``if TYPE_CHECKING:`` (a type is still a dependency of the
design). ``from package import name`` is an import of the module ``package.name`` when there is one.
A new module goes into the package of its floor; a new package gets a floor here, deliberately;
docs/architecture.md draws the floors and says where a new feature goes."""

from __future__ import annotations

import ast
import graphlib
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("k3pipe",)
# the shell sits in the one installed namespace: k3pipe/cli and k3pipe/ops are its folders, and
# k3pipe/flows, k3pipe/tasks link to the top-level flows/ and tasks/ (where Prefect's deployments and
# the project's layout want them)
SHELL = ("k3pipe.cli", "k3pipe.flows", "k3pipe.tasks")

# (floor, its packages: a package covers every module below it), lowest first
FLOORS: list[tuple[str, list[str]]] = [
    ("core: errors, secrets, settings, processes, figures, the record's layout", ["k3pipe.core"]),
    ("verdicts: the statistics", ["k3pipe.verdicts"]),
    ("schema: the experiment as data", ["k3pipe.schema"]),
    ("engines: each engine's flags, logs and KV pool", ["k3pipe.engines"]),
    ("experiment: loading and checking an experiment", ["k3pipe.experiment"]),
    ("inputs: models, images, prompts", ["k3pipe.sources", "k3pipe.prompts"]),
    ("planning: an arm's plan and cold start", ["k3pipe.planning"]),
    ("machines: launchers, the node", ["k3pipe.launchers", "k3pipe.machine"]),
    ("bench: the load generator, the health gate, the probes", ["k3pipe.bench"]),
    ("records: MLflow, the spool, the recorder", ["k3pipe.records"]),
    ("report: a study's and a retest's", ["k3pipe.report"]),
    ("jobs: every lifetime (arm, study, resume, rerun, retest, fleet, alerts)", ["k3pipe.jobs"]),
    ("testing: the fakes (the library never imports them)", ["k3pipe.testing"]),
    ("the facade: `import k3pipe`", ["k3pipe"]),
    ("operations, a wing beside the library: the team stack, the offline bundle", ["k3pipe.ops"]),
    ("shell: Prefect tasks and flows, the command line", list(SHELL)),
]


def python_files(folder: Path) -> list[Path]:
    """Every ``*.py`` under ``folder``, through the links of k3pipe/flows and k3pipe/tasks."""
    return sorted(
        Path(dirpath) / name
        for dirpath, _, names in os.walk(folder, followlinks=True)
        for name in names
        if name.endswith(".py")
    )


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in python_files(root / package):
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
    """The floor of ``module``: that of the longest package of FLOORS holding it."""
    best: tuple[int, int] | None = None
    for level, (_, names) in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (level, len(name))
    return None if best is None else best[0]


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


def test_the_library_holds_packages_only() -> None:
    """``ls k3pipe/`` lists packages: every module but the facade lives in the package of its floor."""
    loose = sorted(p.name for p in (REPO / "k3pipe").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"move these into the package of their floor: {loose}"
    packages = sorted(p.name for p in (REPO / "k3pipe").iterdir() if (p / "__init__.py").is_file())
    placed = {name.split(".")[1] for _, names in FLOORS for name in names if name.startswith("k3pipe.")}
    assert sorted(placed) == packages


def test_no_twin_names() -> None:
    """No two modules of the library share a name (``study.py`` and ``jobs/study.py`` were twins), and
    no module is named after a package; ``base`` (each family's interface) is the one shared name.
    The shell is the exception by design: a command's module, its flow and its job share the name the
    user types (``k3pipe study``, the ``study`` flow, ``jobs/study.py``)."""
    names: dict[str, list[str]] = {}
    for path in (REPO / "k3pipe").rglob("*.py"):  # not through the links: flows/ and tasks/ are shell
        if path.relative_to(REPO / "k3pipe").parts[0] in ("cli",):
            continue
        if path.name != "__init__.py" and path.stem != "base":
            names.setdefault(path.stem, []).append(str(path.relative_to(REPO)))
    packages = {p.name for p in (REPO / "k3pipe").rglob("*") if (p / "__init__.py").is_file()}
    twins = {n: sorted(ps) for n, ps in names.items() if len(ps) > 1 or n in packages}
    assert twins == {}


def test_every_module_has_a_floor() -> None:
    unplaced = sorted(m for m in modules(REPO, PACKAGES) if floor_of(m) is None)
    assert unplaced == [], f"give these modules a floor in tests/unit/test_layers.py: {unplaced}"


def test_no_module_imports_one_above_it() -> None:
    assert upward(imports(modules(REPO, PACKAGES))) == []


def test_no_circle() -> None:
    assert circle(imports(modules(REPO, PACKAGES))) is None


def private_imports(root: Path, folder: str, package: str) -> list[str]:
    """``file:line: module.name`` for each private name (``_x``) a module of ``folder`` (the package
    ``package``) imports from another module of it: what two modules share is public in one of them,
    or in a third."""
    found = []
    for path in python_files(root / folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_the_flows_share_no_private_helpers() -> None:
    """The flows once imported each other's private helpers; what they share lives in flows/runtime.py."""
    assert private_imports(REPO, "flows", "k3pipe.flows") == []


def test_the_private_import_scan_finds_one(tmp_path: Path) -> None:
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "a.py").write_text("from k3pipe.flows.b import public, _private\n")
    assert private_imports(tmp_path, "flows", "k3pipe.flows") == ["flows/a.py:1: k3pipe.flows.b._private"]


def test_the_scan_sees_lazy_and_type_checking_imports_and_circles(tmp_path: Path) -> None:
    for package in ("k3pipe", "k3pipe/core", "k3pipe/schema"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "k3pipe" / "core" / "errors.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from k3pipe.schema.specs import Spec\n"
    )
    (tmp_path / "k3pipe" / "schema" / "specs.py").write_text("def f():\n    from ..core import errors\n")
    edges = imports(modules(tmp_path, ("k3pipe",)))
    assert edges["k3pipe.core.errors"] == {"k3pipe.schema.specs"}
    assert edges["k3pipe.schema.specs"] == {"k3pipe.core.errors"}
    assert upward(edges) == ["k3pipe.core.errors (core) -> k3pipe.schema.specs (schema)"]
    assert set(circle(edges) or []) == {"k3pipe.core.errors", "k3pipe.schema.specs"}


BARE_SHELL = ("cli", "ops", "flows", "tasks")


def bare_shell_imports(root: Path, folders: tuple[str, ...]) -> list[str]:
    """``file:line: name`` for each import of the shell by a bare top-level name (``flows.study``
    rather than ``k3pipe.flows.study``): the wheel installs no such name, and in a checkout the two
    names would load two copies of one module."""
    found = []
    for folder in folders:
        for path in python_files(root / folder):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                found += [
                    f"{path.relative_to(root)}:{node.lineno}: {n}"
                    for n in names
                    if n.split(".")[0] in BARE_SHELL
                ]
    return found


def test_nothing_imports_the_shell_by_a_bare_name() -> None:
    folders = tuple(
        f for f in ("k3pipe", "flows", "tasks", "tests", "scripts", "benchmarks") if (REPO / f).is_dir()
    )
    assert bare_shell_imports(REPO, folders) == []


def test_the_bare_name_scan_finds_one(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        "import k3pipe.flows.study\ndef f():\n    from flows.study import study\n"
    )
    assert bare_shell_imports(tmp_path, ("tests",)) == ["tests/t.py:3: flows.study"]
