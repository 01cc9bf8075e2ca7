"""The verdicts on the real engine here: one study through the study flow with the real vLLM (CPU
build) serving the tiny model, the demo's two arms (max_num_seqs 4 against 1) each launched twice,
interleaved, and the A/A calibration (the first arm's copy, launched twice too).

What must hold: the A/A is never called better or worse (equivalent within the margin, or
inconclusive), the A/B is detected on TTFT p50 (batch1 queues three of the four streams: about 15x),
every verdict is one of the three outcomes with the interval it was made with, and restart noise is
measured (two launches of every arm). The decision rests on TTFT p50 at alpha 0.01: by design this
test could fail on the A/A at most 1% of the time, if the engine's noise is as the model says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3pipe.report import build_report
from k3pipe.settings import Settings
from k3pipe.tracking import Tracker
from tests.conftest import ASSETS_HOME, REPO, free_port, require_engine

pytestmark = [pytest.mark.engine, pytest.mark.flow]


def _experiment() -> dict:
    data = yaml.safe_load((REPO / "experiments" / "demo-study.yaml").read_text())
    data = yaml.safe_load(yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME)))
    data["name"] = "verdicts-cpu"
    for arm in data["arms"]:
        arm["launches"] = 2
        arm["launcher"]["port"] = free_port()
        arm["engine"]["env"]["VLLM_CACHE_ROOT"] = str(ASSETS_HOME / "cache" / "vllm")
    data["decision"] = {"metrics": ["ttft_ms_p50"], "alpha": 0.01, "calibration": True}
    data["workloads"] = [
        {"name": "in256-out64", "input_tokens": 256, "output_tokens": 64, "concurrency": 4,
         "num_requests": 8, "warmup_requests": 1, "repeats": 3, "seed": 1}
    ]  # fmt: skip
    return data


def test_an_a_a_and_an_a_b_on_the_real_engine(prefect_harness: None, tmp_path: Path) -> None:
    require_engine()
    from flows.study import study

    exp = tmp_path / "verdicts-cpu.yaml"
    exp.write_text(yaml.safe_dump(_experiment()))
    result = study(str(exp))
    order = [(o["arm"], o["launch"]) for o in result["arms"]]
    assert order == [
        ("batch4", 1), ("batch4-aa", 1), ("batch1", 1), ("batch1", 2), ("batch4-aa", 2), ("batch4", 2)
    ]  # fmt: skip
    assert all(o["status"] == "FINISHED" for o in result["arms"])

    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    report = build_report(tracker, result["study_run_id"])
    (ttft,) = [r for r in report.analysis.rows if r.decision]
    assert ttft.metric.key == "ttft_ms_p50"
    assert all(c.estimate.basis == "launches" for c in ttft.cells.values())
    assert report.analysis.restart_noise_measured

    # the A/B: batch4 better on TTFT, detected with restart noise in the interval
    (ab,) = ttft.verdicts
    assert ab.different, ab.text()
    assert ab.leader == "batch4"
    assert ab.verdict.restart_noise_measured
    assert ab.ci is not None
    assert ab.ci[0] > 1

    # the A/A: never better or worse
    aa = ttft.calibration
    assert aa is not None
    assert aa.outcome in ("equivalent", "inconclusive"), aa.text()

    text = report.markdown
    assert "no difference" not in text
    assert "## Calibration: A/A" in text
    assert "## Noise: restart and repeat" in text
    noise = next(n for n in report.analysis.noise if n.metric.key == "ttft_ms_p50")
    assert noise.components is not None
    assert noise.components.df_between == 3  # three arms, two launches each
