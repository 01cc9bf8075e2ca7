"""prefect.yaml's `benchmark`, `rerun` and `study` deployments, run for real: a Prefect server, a
process work pool, a worker, `prefect deployment run`; the experiment uses the `external` launcher
against the session's real vLLM, so the worker starts and stops no engine of its own."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.records.history import recent_runs
from k3pipe.records.tracking import Tracker
from tests.conftest import PREFECT, REPO, RunningEngine, external_experiment, stop_group

pytestmark = [pytest.mark.engine, pytest.mark.flow]


def test_benchmark_deployment_runs_on_a_worker(
    prefect_server: dict[str, str], vllm_engine: RunningEngine, tmp_path: Path
) -> None:
    env = {**prefect_server, "PREFECT_WORKER_QUERY_SECONDS": "2", "ENGINE_KEY": vllm_engine.api_key}
    workloads = [{"name": "w", "input_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4}]
    experiment = external_experiment("external-demo", vllm_engine, "ENGINE_KEY", workloads)
    exp = tmp_path / "external.yaml"
    exp.write_text(yaml.safe_dump(experiment))

    def prefect(*args: str, timeout: float = 120) -> str:
        out = subprocess.run(
            [PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        if out.returncode != 0:
            log = tmp_path / "worker.log"
            worker_tail = log.read_text(errors="replace")[-6000:] if log.exists() else "(no worker log)"
            pytest.fail(
                f"prefect {' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
                f"\n--- the worker's log, last 6000 characters ---\n{worker_tail}"
            )
        return out.stdout

    prefect("work-pool", "create", "k3pipe", "--type", "process")
    prefect("work-pool", "create", "gpu-node", "--type", "process")  # retest/gpu's (a deploy needs it)
    prefect("--no-prompt", "deploy", "--all")
    worker_log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "k3pipe"],
        cwd=tmp_path,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out = prefect(
            "deployment",
            "run",
            "benchmark/benchmark",
            "--param",
            f"experiment={exp}",
            "--watch",
            timeout=400,
        )
        assert "Completed" in out
        settings = Settings()
        tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
        runs = recent_runs(tracker, 5)
        assert list(runs["name"]) == ["external-demo/gateway"]
        assert list(runs["workload"]) == ["w"]
        assert list(runs["status"]) == ["FINISHED"]
        first = str(runs["run_id"][0])
        # the rerun deployment: the run again from its record alone (the experiment file is gone)
        exp.unlink()
        out = prefect(
            "deployment", "run", "rerun/rerun", "--param", f"run_id={first}", "--watch", timeout=400
        )  # fmt: skip
        assert "Completed" in out
        reran = str(recent_runs(tracker, 1)["run_id"][0])
        # the study deployment: the same experiment as a study, its report at the end
        exp.write_text(yaml.safe_dump({**experiment, "name": "external-study"}))
        out = prefect(
            "deployment", "run", "study/study", "--param", f"experiment={exp}", "--watch", timeout=400
        )  # fmt: skip
        assert "Completed" in out
        # the retest deployment: the experiment as a baseline and one variant (twice the output)
        retest = {**experiment, "name": "external-retest"}
        retest["variants"] = [{"name": "longer", "arms": {"gateway": {}}, "workloads": {"output_tokens": 16}}]
        exp.write_text(yaml.safe_dump(retest))
        out = prefect(
            "deployment", "run", "retest/retest", "--param", f"experiment={exp}", "--watch", timeout=400
        )  # fmt: skip
        assert "Completed" in out
    finally:
        stop_group(worker, signal.SIGINT)
        worker_log.close()

    (retest_row, *studies) = [n for n in recent_runs(tracker, 1)["name"] if not n.startswith("    ")]
    assert retest_row == "retest/external-retest"
    assert [s.strip() for s in studies] == ["study/external-retest", "study/external-retest@longer"]
    assert "retest verdicts:" in (tmp_path / "worker.log").read_text()
    runs = recent_runs(tracker, 5)[lambda f: ~f["name"].str.contains("retest")].reset_index(drop=True)
    assert list(runs["name"]) == [
        "study/external-study",
        "  external-study/gateway",
        "external-demo/gateway",
        "external-demo/gateway",
    ]
    study = tracker.client.get_run(str(runs["run_id"][0]))
    assert study.data.tags["k3pipe.kind"] == "study"
    assert {a.path for a in tracker.client.list_artifacts(study.info.run_id, "report")} >= {
        "report/report.html",
        "report/report.md",
    }
    assert "study results:" in (tmp_path / "worker.log").read_text()
    again = tracker.client.get_run(reran)
    assert again.data.tags["k3pipe.rerun_of"] == first
    assert again.info.status == "FINISHED"
    assert "rerun verdict, w:" in (tmp_path / "worker.log").read_text()
    run = tracker.client.get_run(first)
    assert run.data.params["launcher"] == "external"
    assert "prefect.flow_run_id" in run.data.tags
    assert run.data.tags["prefect.flow_run_id"] != "none"
    assert "cold_start_s" not in run.data.metrics
    assert vllm_engine.api_key not in (tmp_path / "worker.log").read_text()
