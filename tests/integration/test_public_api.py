"""The public surface is deliberate, and the library never imports Prefect."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import k3pipe


def test_exported_names() -> None:
    assert sorted(k3pipe.__all__) == sorted(
        [
            "ArmPlan",
            "BenchmarkError",
            "EndpointAuthError",
            "ExperimentSpec",
            "HealthError",
            "K3pipeError",
            "LaunchError",
            "ModelNotServedError",
            "ModelSourceError",
            "PreflightError",
            "Settings",
            "SpecError",
            "TrackingError",
            "WorkloadSpec",
            "__version__",
            "load_experiment",
            "parse_experiment",
            "plan_arm",
        ]
    )
    for name in k3pipe.__all__:
        assert hasattr(k3pipe, name)


def test_error_tree() -> None:
    assert issubclass(k3pipe.EndpointAuthError, k3pipe.HealthError)
    assert issubclass(k3pipe.ModelNotServedError, k3pipe.HealthError)
    assert issubclass(k3pipe.PreflightError, k3pipe.SpecError)
    for name in (
        "SpecError",
        "ModelSourceError",
        "LaunchError",
        "HealthError",
        "BenchmarkError",
        "TrackingError",
    ):
        assert issubclass(getattr(k3pipe, name), k3pipe.K3pipeError)


def test_library_does_not_import_prefect() -> None:
    code = (
        "import sys, k3pipe, k3pipe.jobs.arm_run, k3pipe.records.recorder, k3pipe.jobs.rerun, "
        "k3pipe.records.tracking; "
        "print('prefect' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# what the library must never import: the orchestrator and the shell above it (the shell's folders sit
# in the k3pipe namespace: k3pipe/cli and k3pipe/ops, and the links k3pipe/flows and k3pipe/tasks)
SHELL_MODULES = ("prefect", "k3pipe.flows", "k3pipe.tasks", "k3pipe.cli", "k3pipe.ops")
SHELL_FOLDERS = ("cli", "ops")  # the links (flows, tasks) are not walked


def _is_shell(name: str) -> bool:
    return any(name == s or name.startswith(s + ".") for s in SHELL_MODULES)


def shell_imports(package: Path) -> list[str]:
    """Every import of SHELL_MODULES in the package's files but the shell's own, at any depth (inside
    functions too)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in SHELL_FOLDERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                if _is_shell(name):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name}")
                    break
    return found


def test_no_module_of_the_library_imports_the_shell() -> None:
    assert shell_imports(Path(k3pipe.__file__).parent) == []


def test_the_import_scan_sees_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "lib"
    (package / "cli").mkdir(parents=True)
    (package / "ok.py").write_text("import os\nfrom k3pipe import specs\n")
    (package / "cli" / "main.py").write_text("import prefect\n")  # the shell's own: allowed
    (package / "bad.py").write_text(
        "def f():\n    from prefect import flow\n    import k3pipe.flows.benchmark\n"
        "    from k3pipe import cli\n"
    )
    assert shell_imports(package) == [
        "lib/bad.py:2: prefect", "lib/bad.py:3: k3pipe.flows.benchmark", "lib/bad.py:4: k3pipe.cli"
    ]  # fmt: skip


def test_every_test_module_lives_in_a_tier_folder() -> None:
    """A test's tier is its folder (tests/conftest.py marks it so): a module outside the tier folders
    would be in no tier, and a group weight naming a file that is gone would weigh nothing."""
    from tests.conftest import GROUP_SECONDS, REPO, SHARED_ENGINE, SHARED_ENGINE_MODULES, TIERS, tier_of

    modules = [p.relative_to(REPO).as_posix() for p in sorted((REPO / "tests").rglob("test_*.py"))]
    assert [m for m in modules if tier_of(m) is None] == [], f"move these into tests/{{{','.join(TIERS)}}}/"
    assert sorted(g for g in GROUP_SECONDS if not (REPO / g).exists() and g != SHARED_ENGINE) == []
    assert sorted(m for m in SHARED_ENGINE_MODULES if not (REPO / m).is_file()) == []


def test_the_test_scheduler_rests_on_the_pinned_xdist() -> None:
    """tests/conftest.py groups tests by overriding xdist's private LoadScopeScheduling._split_scope:
    the version installed is the one pinned, and the method still takes a node id and returns the
    scope, which the override maps to a group (a module, or all of tests/docker/)."""
    import inspect
    import tomllib
    from importlib.metadata import version

    from xdist.scheduler import LoadScopeScheduling

    from tests.conftest import REPO, group_of

    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    (pin,) = [d for d in dev if d.startswith("pytest-xdist")]
    assert pin == f"pytest-xdist=={version('pytest-xdist')}"
    assert list(inspect.signature(LoadScopeScheduling._split_scope).parameters) == ["self", "nodeid"]
    assert group_of("tests/docker/test_images.py") == "tests/docker"
    assert group_of("tests/engine/test_flow.py") == "tests/engine/test_flow.py"
    assert group_of("tests/engine/test_deployment.py") == group_of("tests/engine/test_engine_real.py")
