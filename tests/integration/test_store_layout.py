"""The MLflow record is the contract every past study depends on (issue 48): a store that k3pipe wrote
(tests/fixtures/stores/study-v1: a small study of two arms against the scripted server, launched twice
each with an A/A copy, two workloads, the output probe; made by scripts/make_store_fixture.py, its
store.json says when and at which commit) must give the same report it gave then, whatever k3pipe
changes in how it writes or reads runs. A change that renames a tag, a metric or an artifact, or reads
one differently, shows here as a difference in the report; a change that means to change the report
makes the fixture again and says why in its commit."""

from __future__ import annotations

import difflib
import json
import tarfile
from pathlib import Path

from k3pipe.records.tracking import Tracker
from k3pipe.report import build_report
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "stores" / "study-v1"


def test_a_store_written_before_gives_the_same_report(tmp_path: Path) -> None:
    with tarfile.open(FIXTURE / "store.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    store = json.loads((FIXTURE / "store.json").read_text())
    tracker = Tracker(
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "k3pipe",
        tmp_path / "home" / "mlflow" / "artifacts",
        read_artifacts_from=tmp_path / "artifacts",
        allow_spool=False,
    )
    report = build_report(tracker, store["study_run_id"])
    want = (FIXTURE / "report.md").read_text()
    diff = "\n".join(
        difflib.unified_diff(want.splitlines(), report.markdown.splitlines(), "then", "now", lineterm="")
    )
    assert report.markdown == want, (
        f"the report of a store written at {store['commit'][:12]} changed:\n{diff}"
    )
    assert report.analysis.answers is not None  # the store holds the output probe's answers
    assert report.analysis.calibration == ("slow", "slow-aa")
