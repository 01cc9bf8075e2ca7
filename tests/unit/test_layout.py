"""The MLflow record's names live in k3pipe.core.layout alone (issue 48): no module of the library or its
shell spells a tag, a tag family's prefix or a container label itself, so a rename is one line and
shows in tests/integration/test_store_layout.py; each name is one constant; every run is stamped with
the layout's version."""

from __future__ import annotations

import ast
from pathlib import Path

import k3pipe.core.layout as layout
from tests.conftest import REPO

PACKAGES = ("k3pipe", "cli", "flows", "tasks", "ops")
# the names spelled k3pipe.*: tags, tag families, labels (a run kind's value, 'study', is a plain word)
NAMES = {getattr(layout, n): n for n in layout.__all__ if getattr(layout, n).startswith("k3pipe.")}
PREFIXES = tuple(v for v in NAMES if v.endswith("."))


def _spelled(path: Path) -> list[str]:
    """The string constants of a module that are a layout name or start with a prefix of one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value in NAMES or (value.startswith(PREFIXES) and "\n" not in value):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {value!r}")
    return found


def test_no_module_spells_a_name_of_the_record_itself() -> None:
    spelled = [
        hit
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        # k3pipe/__init__.py names modules ('k3pipe.experiment.load': the public surface's lazy imports)
        if path not in (REPO / "k3pipe" / "core" / "layout.py", REPO / "k3pipe" / "__init__.py")
        for hit in _spelled(path)
    ]
    assert spelled == [], "use the constants of k3pipe.core.layout:\n" + "\n".join(spelled)


def test_each_name_is_one_constant() -> None:
    values = [getattr(layout, n) for n in layout.__all__ if n != "LAYOUT_VERSION"]
    assert len(values) == len(set(values))
    plain = sorted(n for n in layout.__all__ if not getattr(layout, n).startswith("k3pipe."))
    assert plain == ["LAYOUT_VERSION", "RETEST_KIND", "STUDY_KIND"]


def test_every_run_carries_the_layout_version(tmp_path: Path) -> None:
    from k3pipe.records.tracking import Tracker

    tracker = Tracker(
        f"sqlite:///{tmp_path / 'mlflow.db'}", "k3pipe", tmp_path / "artifacts", allow_spool=False
    )
    run_id = tracker.start_run("a run", tags={layout.ARM_TAG: "a"})
    tags = tracker.client.get_run(run_id).data.tags
    assert tags[layout.LAYOUT_TAG] == layout.LAYOUT_VERSION
    assert tags[layout.ARM_TAG] == "a"
