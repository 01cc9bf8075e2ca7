"""The MLflow record's names live in k3pipe.core.layout alone (issue 48): no module of the library or its
shell spells a tag, a tag family's prefix, a container label or an artifact's file name itself, so a
rename is one line and shows in tests/integration/test_store_layout.py; each name is one constant;
every run is stamped with the layout's version."""

from __future__ import annotations

import ast
from pathlib import Path

import k3pipe.core.layout as layout
from tests.conftest import REPO

PACKAGES = ("k3pipe", "flows", "tasks")  # k3pipe/cli and k3pipe/ops: under k3pipe
# the names spelled k3pipe.*: tags, tag families, labels (a run kind's value, 'study', is a plain word)
NAMES = {
    value: n
    for n in layout.__all__
    if isinstance(value := getattr(layout, n), str) and (value.startswith("k3pipe.") or n.endswith("_FILE"))
}
PREFIXES = tuple(v for v in NAMES if v.endswith(".") and v.startswith("k3pipe."))


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
    values = [v for n in layout.__all__ if n != "LAYOUT_VERSION" and isinstance(v := getattr(layout, n), str)]
    assert len(values) == len(set(values))
    plain = sorted(
        n
        for n in layout.__all__
        if isinstance(v := getattr(layout, n), str)
        and not v.startswith("k3pipe.")
        and not n.endswith(("_FILE", "_PREFIX"))
    )
    assert plain == ["LAYOUT_VERSION", "LOGS_DIR", "NODE_DIR", "REPORT_DIR", "RETEST_KIND", "STUDY_KIND"]


def test_the_artifact_paths_are_the_layout_s() -> None:
    """Every file k3pipe writes on a run, and the readers that find it, take its path from the layout:
    a renamed artifact is one line here, and the stored studies' fixture says what it breaks."""
    assert layout.prompts_path("w", 0) == "prompts/w/r0.json"
    assert layout.provenance_path("model") == "provenance/model.json"
    files = sorted(
        v for n in layout.__all__ if n.endswith("_FILE") and isinstance(v := getattr(layout, n), str)
    )
    assert "answers.json" in files
    assert "requests.parquet" in files
    assert "run_record.json" in files


def test_every_run_carries_the_layout_version(tmp_path: Path) -> None:
    from k3pipe.records.tracking import Tracker

    tracker = Tracker(
        f"sqlite:///{tmp_path / 'mlflow.db'}", "k3pipe", tmp_path / "artifacts", allow_spool=False
    )
    run_id = tracker.start_run("a run", tags={layout.ARM_TAG: "a"})
    tags = tracker.client.get_run(run_id).data.tags
    assert tags[layout.LAYOUT_TAG] == layout.LAYOUT_VERSION
    assert tags[layout.ARM_TAG] == "a"


def test_a_run_s_tags_read_through_the_typed_view() -> None:
    """Readers ask a run's kind, arm, repeat ... of RunTags, never its tags by name: the values as
    written, numbers as numbers, None where the run has none."""
    from types import SimpleNamespace

    tags = {
        layout.KIND_TAG: layout.STUDY_KIND,
        layout.ARM_TAG: "vllm",
        layout.REPEAT_TAG: "0",
        layout.LAUNCH_TAG: "2",
        "mlflow.parentRunId": "p1",
    }
    view = layout.RunTags.of(SimpleNamespace(data=SimpleNamespace(tags=tags)))
    assert (view.kind, view.arm, view.parent) == ("study", "vllm", "p1")
    assert view.repeat == 0  # a number, and repeat 0 is not "no repeat"
    assert view.launch == 2
    assert view.workload is None
    assert view.aborted is None
    assert layout.RunTags({}).repeat is None


def test_the_stage_scheme_is_read_as_it_is_written() -> None:
    """A study run's stage times: each arm launch's read back alone (launch 1's prefix also starts
    the later launches' keys), by the reader beside the writer's scheme."""
    metrics = {
        layout.stage_prefix("a") + "run_s": 10.0,
        layout.stage_prefix("a", 2) + "run_s": 20.0,
        layout.stage_prefix("a", 0) + "models_s": 5.0,
        layout.stage_prefix("ab") + "run_s": 30.0,
    }
    assert layout.stage_prefix("a", 2) == "stage.a.launch2."
    assert layout.stage_times(metrics, "a") == {"run": 10.0}
    assert layout.stage_times(metrics, "a", 2) == {"run": 20.0}
    assert layout.stage_times(metrics, "a", 0) == {"models": 5.0}
    assert layout.cold_start_metric("weight_load") == "cold_start.weight_load_s"
    assert layout.verdict_metric("fp8", "worse") == "verdict.fp8.worse"
