"""The whole benchmark flow on the real vLLM, then what MLflow holds; and Ctrl-C during a benchmark."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from mlflow.entities import Run

from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker
from k3pipe.testing.fakehub import client_pointed_at_fake_hub
from tests.conftest import TINY_MODEL, CliRun, demo_experiment, free_port, require_engine

pytestmark = [pytest.mark.engine, pytest.mark.flow]

WORKLOADS = [
    {
        "name": "in64-out16",
        "input_tokens": 64,
        "output_tokens": 16,
        "concurrency": 2,
        "num_requests": 6,
        "warmup_requests": 1,
        "seed": 3,
    },
    {
        "name": "in512-out16",
        "input_tokens": 512,
        "output_tokens": 16,
        "concurrency": 3,
        "num_requests": 6,
        "warmup": "steady",  # waves of 3 until two agree within 5%, at most 3 waves
        "warmup_requests": 9,
        "seed": 4,
        "dataset": {"kind": "shared_prefix", "prefix_tokens": 384, "groups": 2},
        "repeats": 2,
        "slo": {"ttft_ms": 60_000, "e2e_ms": 120_000},
        "metrics_interval_s": 0.5,
    },
]


def _processes_in_group(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _processes_with_port(port: int) -> list[int]:
    needle = f"--port\0{port}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _stopped_before_launch(
    tmp_path: Path, port: int, workloads: list[dict[str, Any]], match: str
) -> tuple[Run, Tracker]:
    """Run the demo experiment with ``workloads``: it must raise a PreflightError matching
    ``match`` within a minute, start nothing on ``port`` and leave one FAILED MLflow run."""
    from k3pipe.core.errors import PreflightError
    from k3pipe.flows.benchmark import benchmark

    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(demo_experiment(port, workloads)))
    t0 = time.monotonic()
    with pytest.raises(PreflightError, match=match):
        benchmark(str(exp))
    assert time.monotonic() - t0 < 60  # no engine was started
    assert _processes_with_port(port) == []
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == "FAILED"
    return run, tracker


def _flow_run_log(flow_run_id: Any) -> str:
    """The flow run's log as Prefect's API holds it (what its UI shows), in order. Read from the
    API, not from a handler of the test's: Prefect's logging set-up, when it runs again in this
    process (non-incrementally after a handler it names was lost), drops every handler on its
    loggers, and its console handler binds the sys.stderr of whichever test first imported
    Prefect; both made this assertion order-dependent (empty after other modules in the worker)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    # the log worker sends in batches: what is queued goes now
    APILogWorker.drain_all(timeout=30, at_exit=False)
    lines: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
                offset=len(lines),
            )
            lines.extend(log.message for log in page)
            if len(page) < 200:
                return "\n".join(lines)


def test_flow_records_everything_in_mlflow(
    prefect_harness: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_engine()
    from k3pipe.flows.benchmark import benchmark

    port = free_port()
    key = "sk-" + secrets.token_hex(16)
    monkeypatch.setenv("K3PIPE_DEMO_API_KEY", key)
    data = demo_experiment(port, WORKLOADS)
    # the weights come through the model step: the real modelscope client, the scripted hub
    data["model"] = {
        "source": "modelscope",
        "id": "k3pipe/tiny-llama",
        "revision": "v1",
        "served_name": "tiny-llama",
    }
    files = {p.name: p.read_bytes() for p in TINY_MODEL.iterdir() if p.is_file()}
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(data))

    with client_pointed_at_fake_hub({"k3pipe/tiny-llama": {"v1": files}}, monkeypatch, tmp_path) as hub:
        state = benchmark(str(exp), return_state=True)
    outcomes = state.result()
    assert any(r.query.get("FilePath") == "model.safetensors" for r in hub.requests)

    assert [o["status"] for o in outcomes] == ["FINISHED"]
    assert _processes_with_port(port) == []

    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    parent = tracker.client.get_run(outcomes[0]["mlflow_run_id"])
    params, metrics = parent.data.params, parent.data.metrics
    assert parent.info.status == "FINISHED"
    assert params["engine"] == "vllm"
    assert params["engine_version"] == "0.32.0"
    assert f"--port {port}" in params["command"]
    assert "--enforce-eager" in params["command"]
    assert params["env.VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert re.fullmatch(r"[0-9a-f]{64}", params["model.digest"])
    assert int(params["model.files"]) == len(files)
    assert params["model.id"] == "k3pipe/tiny-llama"
    # what was fetched is named by its content (the digest of every file's sha256), not by "v1"
    assert params["model.revision"] == "v1"
    assert params["model.resolved_revision"] == f"sha256:{params['model.digest']}"
    home = Path(os.environ["K3PIPE_HOME"])
    assert params["model.path"] == str((home / "models" / "k3pipe" / "tiny-llama" / "v1").resolve())
    assert params["k3pipe_commit"] != ""
    assert params["api_key_env"] == "K3PIPE_DEMO_API_KEY"
    assert parent.data.tags["k3pipe.preflight"] == "clean"
    # the engine's own log, read with vLLM's formats: ready, and the CPU KV pool of 1 GiB
    assert metrics["engine_log.ready"] == 1
    assert metrics["engine_log.kv_pool_tokens"] > 0
    assert metrics["preflight_errors"] == 0
    assert 1 < metrics["cold_start_s"] < 900
    parent_artifacts = {a.path for a in tracker.client.list_artifacts(parent.info.run_id)}
    assert "engine_findings.json" in parent_artifacts
    assert {"command.txt", "experiment.json", "endpoint_check.json", "logs", "provenance"} <= parent_artifacts
    logs = [a.path for a in tracker.client.list_artifacts(parent.info.run_id, "logs")]
    assert len(logs) == 1
    log_text = Path(tracker.client.download_artifacts(parent.info.run_id, logs[0], str(tmp_path))).read_text()
    assert "Starting vLLM" in log_text or "Application startup complete" in log_text

    children = {c.data.tags["k3pipe.workload"]: c for c in tracker.children(parent.info.run_id)}
    assert set(children) == {"in64-out16", "in512-out16"}
    # the workload with repeats: its run holds the statistics, each repeat is a run below it
    stats_run = children["in512-out16"]
    assert stats_run.info.status == "FINISHED"
    assert stats_run.data.metrics["repeats"] == 2
    assert "ttft_ms_p50.ci95_high" in stats_run.data.metrics
    # generous objectives on a 2-core machine: every request meets them
    assert stats_run.data.metrics["slo_attainment_pct"] == 100.0
    repeats = sorted(tracker.children(stats_run.info.run_id), key=lambda r: r.data.tags["k3pipe.repeat"])
    assert [r.data.params["workload.seed"] for r in repeats] == ["4", "5"]
    runs = [(WORKLOADS[0], children["in64-out16"]), *((WORKLOADS[1], r) for r in repeats)]
    digests = set()
    for spec, child in runs:
        m = child.data.metrics
        assert child.info.status == "FINISHED"
        # the prompts as an MLflow dataset input: name, digest and where they came from
        (dataset,) = child.inputs.dataset_inputs
        kind = spec.get("dataset", {"kind": "random"})["kind"]
        assert dataset.dataset.name.startswith(kind)
        assert dataset.dataset.source_type == "generated"
        digests.add(dataset.dataset.digest)
        # vLLM honours continuous_usage_stats: per-token ITL, TPOT over N - k1
        assert m["itl_per_token"] == 1.0
        assert m["tpot_k1_assumed"] == 0.0
        assert m["completed"] == spec["num_requests"]
        assert m["failed"] == 0
        assert 0 < m["ttft_ms_p50"] < 20_000
        # On 2 cores the API server shares a core with this client and Prefect: when it falls
        # behind, vLLM hands it several steps' tokens at once and a whole stream can arrive in one
        # read, so the client's TPOT may be 0 for most requests. The engine's own figure is not.
        assert 0 <= m["tpot_ms_p50"] < 5_000
        assert 0 < m["engine_itl_ms_mean"] < 5_000
        # ... and then that is a finding, not a speed: tagged, with the engine's ITL as the figure
        bursty = m["client_timing_bursty"] == 1.0
        assert child.data.tags["k3pipe.client_timing"] == ("bursty" if bursty else "ok")
        if bursty:
            assert "the engine's ITL" in child.data.tags["k3pipe.client_timing_note"]
        elif m["tpot_ms_p50"] == 0:
            pytest.fail("a TPOT p50 of 0 ms without the bursty flag")
        assert m["output_tokens_total"] == spec["num_requests"] * spec["output_tokens"]
        assert 0 < m["output_throughput_tps"] <= m["output_throughput_bound_tps"] * 1.001
        assert m["throughput_exceeds_bound"] == 0
        assert child.data.params["workload.concurrency"] == str(spec["concurrency"])
        frame = pd.read_parquet(
            tracker.client.download_artifacts(
                child.info.run_id, "requests.parquet", str(tmp_path / spec["name"])
            )
        )
        # the warm-up as recorded: a fixed one sends all its requests, a steady one two waves or more
        sent = m["warmup_requests"]
        assert len(frame) == spec["num_requests"] + sent
        assert int(frame["warmup"].sum()) == sent
        if spec.get("warmup") == "steady":
            assert sent in (6, 9)
            assert m["warmup_waves"] == sent / spec["concurrency"]
            assert "warmup_last_change_pct" in m
            assert m["warmup_steady"] == 1.0 or sent == 9  # it stops early only when steady
            summary = tracker.client.download_artifacts(
                child.info.run_id, "summary.json", str(tmp_path / f"{spec['name']}-summary")
            )
            warmup = json.loads(Path(summary).read_text())["warmup"]
            assert (warmup["mode"], warmup["requests_sent"]) == ("steady", sent)
            assert [w["requests"] for w in warmup["waves"]] == [spec["concurrency"]] * int(m["warmup_waves"])
        else:
            assert sent == spec["warmup_requests"]
        # the measured phase opened with `concurrency` requests at once: their TTFT beside the rest's
        assert m["first_wave_ttft_ratio"] == pytest.approx(
            m["ttft_ms_p50_first_wave"] / m["ttft_ms_p50_after_first_wave"]
        )
        assert (frame["first_chunk_tokens"] >= 1).all()
        # the engine's own figures over exactly the measured window (a scrape opens it after warm-up)
        assert m["engine_generation_tokens"] == spec["num_requests"] * spec["output_tokens"]
        assert m["engine_ttft_ms_mean"] > 0
        assert "client_engine_discrepancies" in m
        child_artifacts = {a.path for a in tracker.client.list_artifacts(child.info.run_id)}
        assert "engine_metrics.parquet" in child_artifacts
    assert len(digests) == 3  # each repeat draws its own prompts
    assert 0 <= stats_run.data.metrics["warmup_steady"] <= 1  # the share of repeats that were steady
    assert metrics["in64-out16.ttft_ms_p50"] == children["in64-out16"].data.metrics["ttft_ms_p50"]
    assert metrics["in512-out16.ttft_ms_p50"] == pytest.approx(
        sum(r.data.metrics["ttft_ms_p50"] for r in repeats) / 2
    )

    # the key never reaches MLflow (DB or artifacts) nor the logs
    for path in (home / "mlflow").rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), f"key leaked into {path}"
    assert key not in caplog.text
    # the flow's log says what the warm-up did
    err = _flow_run_log(state.state_details.flow_run_id)
    assert "in512-out16 (repeat 1/2): 6 requests (+ warm-up until steady within 5%, at most 9)" in err
    assert re.search(r"in512-out16: .*warm-up [69] requests \([23] waves\): (steady|NOT steady)", err)
    assert re.search(r"in64-out16: .*first wave ttft p50 x[0-9.]+ the rest's", err)


def test_preflight_error_stops_before_launch(prefect_harness: None, tmp_path: Path) -> None:
    """A workload longer than the engine's max model length: nothing starts, MLflow says why."""
    port = free_port()
    too_long = [{"name": "too-long", "input_tokens": 4000, "output_tokens": 200, "num_requests": 2}]
    run, tracker = _stopped_before_launch(tmp_path, port, too_long, match="too-long")
    assert run.data.tags["k3pipe.error"].startswith("preflight: ")
    assert run.data.metrics["preflight_errors"] >= 1
    assert "preflight.json" in {a.path for a in tracker.client.list_artifacts(run.info.run_id)}


def test_a_dataset_that_cannot_be_built_stops_before_launch(prefect_harness: None, tmp_path: Path) -> None:
    """A ShareGPT file that is not there: found with the prompts, before any engine starts."""
    port = free_port()
    missing = tmp_path / "no-such.json"
    workloads = [
        {
            "name": "chat",
            "input_tokens": 256,
            "output_tokens": 8,
            "dataset": {"kind": "sharegpt", "path": str(missing)},
        }
    ]
    run, _ = _stopped_before_launch(tmp_path, port, workloads, match=r"workload 'chat'.*no-such\.json")
    assert run.data.tags["k3pipe.error"] == "preflight: dataset"


def test_bad_arm_fails_and_records(prefect_harness: None, tmp_path: Path) -> None:
    """An engine that dies at start: the flow fails with the log tail; MLflow marks the run FAILED."""
    require_engine()
    from k3pipe.flows.benchmark import benchmark

    port = free_port()
    data = demo_experiment(port, WORKLOADS[:1])
    data["arms"][0]["engine"]["args"]["max_model_len"] = 999_999  # above the tiny model's 4096
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(data))
    with pytest.raises(RuntimeError, match="LaunchError"):
        benchmark(str(exp))
    assert _processes_with_port(port) == []
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    runs = tracker.client.search_runs([tracker.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FAILED"
    assert "exited with code" in run.data.tags["k3pipe.error"]
    assert {a.path for a in tracker.client.list_artifacts(run.info.run_id)} >= {"error.txt", "logs"}


# SIGTERM (a cancellation's) is tested in tests/integration/test_faults.py, on the scripted engine: what
# differs between the two signals is k3pipe's, and a real vLLM-CPU start costs two minutes beside other tests
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=["ctrl-c"])
def test_interrupt_during_benchmark_leaves_no_engine(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C (SIGINT) during a benchmark: the engine group is gone."""
    require_engine()
    port = free_port()
    long_workload = [
        {
            "name": "long",
            "input_tokens": 256,
            "output_tokens": 512,
            "concurrency": 2,
            "num_requests": 400,
            "seed": 5,
        }
    ]
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(demo_experiment(port, long_workload)))
    pgid = None
    try:
        with CliRun(exp, tmp_path) as run:
            text = run.wait_for("long: 400 requests")
            match = re.search(r"pid (\d+)", text)
            assert match, text[-3000:]
            pgid = int(match.group(1))
            assert _processes_in_group(pgid), "engine not running during the benchmark"
            time.sleep(3)
            t0 = time.monotonic()
            assert run.interrupt(sig) == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], run.text()[-3000:]
            assert time.monotonic() - t0 < 10, run.text()[-3000:]
            assert _processes_in_group(pgid) == [], run.text()[-3000:]
            assert _processes_with_port(port) == []
        tracker = Tracker(Settings().tracking_uri(), Settings().mlflow_experiment)
        runs = {r.info.run_name: r for r in tracker.client.search_runs([tracker.experiment_id])}
        assert {name: r.info.status for name, r in runs.items()} == {
            "demo-cpu/vllm-cpu": "KILLED",
            "vllm-cpu/long": "KILLED",
        }
        # the requests measured before the signal are recorded, those in flight as aborted
        long_id = runs["vllm-cpu/long"].info.run_id
        frame = pd.read_parquet(tracker.client.download_artifacts(long_id, "requests.parquet", str(tmp_path)))
        assert 0 < len(frame) < 400
        assert frame["error"].fillna("").str.startswith("aborted: interrupted by").any()
    finally:
        if pgid and _processes_in_group(pgid):
            os.killpg(pgid, signal.SIGKILL)
