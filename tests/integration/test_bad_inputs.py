"""Bad inputs, the cases that take seconds or a process of their own: 60,000 workloads, and what
`k3pipe render` prints for a bad file. tests/unit/test_bad_inputs.py holds the corpus itself."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import load_experiment
from k3pipe.schema.specs import MAX_WORKLOADS
from tests.unit.test_bad_inputs import CORPUS, REPO, _clear, _experiment


@pytest.mark.parametrize("count", [60_000])
def test_too_many_workloads_are_refused_quickly_with_the_limit(tmp_path: Path, count: int) -> None:
    """60,000 workloads took 86 s to render and over 120 s to preflight; now parsing them is the
    cost (about 5 s on two busy cores, so that case is in tests/integration/)."""
    path = tmp_path / "huge.yaml"
    path.write_text(_experiment(count))
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    assert time.perf_counter() - start < 30
    message = str(info.value)
    assert f"workloads: holds {count:,} items; at most {MAX_WORKLOADS:,}" in message
    assert "split the experiment" in message
    assert not _clear(message)


# -- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("025-encoding-latin1.yaml", "not UTF-8"),
        ("027-encoding-utf16-le-bom.yaml", "UTF-16"),
        ("<directory>", "is a directory"),
        ("<nested>", "nest"),
        ("180-concurrency-bool.yaml", "workloads[0].concurrency: expected a whole number"),
    ],
)
def test_render_prints_the_error_without_a_traceback(name: str, says: str, tmp_path: Path) -> None:
    if name == "<directory>":
        path = CORPUS
    elif name == "<nested>":
        path = tmp_path / "nested.yaml"
        path.write_text("name: " + "[" * 10_000 + "]" * 10_000 + "\n")
    else:
        path = CORPUS / name
    result = subprocess.run(
        [sys.executable, "-m", "k3pipe.cli.main", "render", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr
    assert says in result.stderr


def test_the_fetch_task_retries_a_download_not_a_missing_directory() -> None:
    """It retried a missing local directory twice, 10 s apart, before the same error."""
    from prefect.states import Failed

    from k3pipe.core.errors import ModelSourceError
    from k3pipe.tasks.steps import _worth_retrying, fetch_model_task

    assert fetch_model_task.retries == 2
    assert fetch_model_task.retry_condition_fn is _worth_retrying
    gone = ModelSourceError("model.path: directory /x does not exist", retryable=False)
    assert _worth_retrying(fetch_model_task, None, Failed(data=gone)) is False
    assert _worth_retrying(fetch_model_task, None, Failed(data=ModelSourceError("timed out"))) is True
    assert _worth_retrying(fetch_model_task, None, Failed(data=OSError("reset"))) is True
