"""Regression alerts (k3pipe.jobs.alerts): a retest judged against the series of earlier retests of the
same experiment. In the library: a first retest has too little history ('insufficient history'); a
planted regression (the same arm against a slower engine, its declared version moved) is found and
named with both versions and the history it was judged against; `k3pipe retest accept` makes it the
new normal, and the retest after it starts a new series. Through Prefect, for real: the retest flow
emits the event, prefect.yaml's `notify` deployment trigger (an automation) starts the notify flow on
a worker, which posts the regression to a Webhook block whose URL is a receiver in this test. The
engines are the scripted OpenAI server (k3pipe/testing/scripted_openai.py).

The history a judgement needs (4 earlier retests) is seeded cheaply: one real retest runs, and three
copies of its record are written with the tracker in the shape the alerts read of an earlier retest
(its run, tags and overrides, and its regression.json with each figure's launch means), each with a
little night-to-night noise. A real retest takes 10-15 s here; three more of them per test would
double its time to test what tests/unit/test_series.py tests on thousands of series. How a retest's
values are read from its study is tested on the real ones (each retest reads its own)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from typer.testing import CliRunner

import k3pipe.cli.main as cli
from k3pipe.core.layout import ACCEPTED_TAG, REGRESSION_FILE, REGRESSION_TAG
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.retest import retest
from k3pipe.jobs.steps import Job
from k3pipe.records.tracking import Tracker
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import PREFECT, REPO, TINY_MODEL, stop_group

pytestmark = pytest.mark.flow


def _experiment(base_url: str, version: str) -> dict[str, Any]:
    return {
        "name": "alert-test",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "engine",
                "engine": {"kind": "vllm", "version": version},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": base_url, "model": "m"},
            },
        ],
        "workloads": [
            {
                "name": "w",
                "input_tokens": 32,
                "output_tokens": 8,
                "concurrency": 2,
                "num_requests": 6,
                "warmup_requests": 0,
                "repeats": 3,
                "seed": 1,
            },
        ],
        "decision": {"metrics": ["output_throughput_tps", "e2e_ms_p50"]},
        "variants": [{"name": "short", "arms": {"engine": {}}, "workloads": {"output_tokens": 4}}],
    }


def seed_history(tracker: Tracker, real: str, copies: int, spread: float = 0.02) -> list[str]:
    """``copies`` earlier retests written with the tracker, each the real retest ``real``'s record
    (its experiment, overrides and figures) with night-to-night noise of ``spread`` (log scale) on
    each launch mean; judged 'none'. Their run ids, oldest first."""
    run = tracker.client.get_run(real)
    recorded = json.loads(tracker.read_artifact(real, REGRESSION_FILE) or b"{}")
    assert recorded["values"], recorded  # the real retest recorded its figures
    rng = random.Random(real)
    experiment = run.data.tags["k3pipe.experiment"]
    overrides = {k: v for k, v in run.data.params.items() if k.startswith("override.")}
    seeded = []
    for _ in range(copies):
        time.sleep(0.01)  # each its own start time, after the real one's
        run_id = tracker.start_run(
            f"retest/{experiment}",
            tags={"k3pipe.kind": "retest", "k3pipe.experiment": experiment, REGRESSION_TAG: "none"},
        )
        tracker.log_params(run_id, {"experiment_file": "seeded", **overrides})
        values = [
            {**v, "launch_log_means": [m + rng.gauss(0.0, spread) for m in v["launch_log_means"]]}
            for v in recorded["values"]
        ]
        tracker.log_dict(run_id, {**recorded, "retest_run_id": run_id, "values": values}, REGRESSION_FILE)
        tracker.end_run(run_id, "FINISHED")
        seeded.append(run_id)
    return seeded


@pytest.fixture
def engines() -> Iterator[tuple[ScriptedOpenAI, ScriptedOpenAI]]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.005), model="m") as good,
        ScriptedOpenAI(Script(inter_token_s=0.03), model="m") as bad,  # six times slower per token
    ):
        yield good, bad


def test_a_regression_is_found_against_the_series_and_accepting_it_starts_a_new_one(
    engines: tuple[ScriptedOpenAI, ScriptedOpenAI], tmp_path: Path
) -> None:
    good, bad = engines
    alerts: list[dict[str, Any]] = []
    job = Job.library()  # K3PIPE_HOME's store: the one `k3pipe retest accept` reads below
    job = Job(job.settings, job.tracker, job.steps, alert=alerts.append)
    tracker = job.tracker

    def run(url: str, version: str) -> str:
        exp = tmp_path / f"alert-{version}.yaml"
        exp.write_text(yaml.safe_dump(_experiment(url, version)))
        return retest(RunRequest(experiment=str(exp)), job).retest_run_id

    def regression(run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(tracker.read_artifact(run_id, REGRESSION_FILE) or b"{}")
        return data

    first = run(good.base_url, "1.0")
    tag = tracker.client.get_run(first).data.tags[REGRESSION_TAG]
    assert tag.startswith("insufficient history: 0 earlier retest(s)"), tag
    assert "needs 4 earlier" in tag
    assert alerts == []
    recorded = regression(first)
    assert {(v["arm"], v["workload"], v["metric"]) for v in recorded["values"]} == {
        ("engine", "w", "output_throughput_tps"),
        ("engine", "w", "e2e_ms_p50"),
    }  # the baseline study's figures, not the variant's

    history = [first, *seed_history(tracker, first, copies=3)]
    second = run(bad.base_url, "1.1")
    tags = tracker.client.get_run(second).data.tags
    assert tags[REGRESSION_TAG].startswith("worse than the series: engine w"), tags[REGRESSION_TAG]
    (alert,) = alerts
    assert alert["retest_run_id"] == second
    assert alert["status"] == "worse"
    by_metric = {w["metric"]: w for w in alert["worse"]}
    assert set(by_metric) == {"output_throughput_tps", "e2e_ms_p50"}, alert["worse"]
    assert by_metric["output_throughput_tps"]["change"].startswith("-")  # throughput fell
    assert by_metric["e2e_ms_p50"]["change"].startswith("+")
    for w in alert["worse"]:
        assert (w["since_run_id"], w["segment"]) == (second, 1)  # since tonight's retest
        assert w["history"] == 4
        assert (w["history_first_run_id"], w["history_last_run_id"]) == (history[0], history[-1])
    assert alert["series"]["retests"] == 4
    assert alert["versions"] == {"engine": {"good": "vllm 1.0", "bad": "vllm 1.1"}}
    assert "vllm 1.0 -> vllm 1.1" in alert["summary"]
    assert first[:12] in alert["summary"]
    assert history[-1][:12] in alert["summary"]
    assert regression(second)["regressed"] is True

    # the slower engine is the new normal: accepted through the command line
    out = CliRunner().invoke(cli.app, ["retest", "accept", second[:12]])
    assert out.exit_code == 0, out.output
    assert f"retest {second} accepted" in out.output
    assert tracker.client.get_run(second).data.tags[ACCEPTED_TAG]
    # ... and a run that is not a retest is refused, naming it
    study = next(c.info.run_id for c in tracker.children(second))
    out = CliRunner().invoke(cli.app, ["retest", "accept", study])
    assert out.exit_code == 2
    assert f"run {study} is not a retest's run" in out.output

    third = run(bad.base_url, "1.1")  # the series starts at the accepted one: 1 earlier retest
    recorded = regression(third)
    assert recorded["status"] == "insufficient history", recorded["summary"]
    assert recorded["series"]["start_run_id"] == second
    assert recorded["series"]["retests"] == 1
    assert f"since retest {second[:12]} was accepted" in recorded["summary"]
    assert len(alerts) == 1


class _Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_scheduled_retests_regression_reaches_the_webhook(
    prefect_server: dict[str, str], engines: tuple[ScriptedOpenAI, ScriptedOpenAI], tmp_path: Path
) -> None:
    good, bad = engines
    receiver = HTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.received = []
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    env = {
        **{k: v for k, v in prefect_server.items() if not k.startswith(("K3PIPE_", "MLFLOW_"))},
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "K3PIPE_HOME": str(tmp_path / "home"),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PYTHONUNBUFFERED": "1",
        "PWD": str(REPO),
    }

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(argv)}: {out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out

    artifacts = tmp_path / "home" / "mlflow" / "artifacts"  # the flows' (K3PIPE_HOME's) artifact root
    run(PREFECT, "work-pool", "create", "k3pipe", "--type", "process")
    run(PREFECT, "--no-prompt", "deploy", "--name", "notify")  # prefect.yaml's, with its trigger
    hook = f"http://127.0.0.1:{receiver.server_port}/hook"
    save = (
        "from prefect.blocks.webhook import Webhook; "
        f"Webhook(method='POST', url='{hook}', allow_private_urls=True)"
        ".save('k3pipe-regression', overwrite=True)"
    )
    run(sys.executable, "-c", save)
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "k3pipe"], cwd=tmp_path, env=env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        first = None
        for url, version in ((good.base_url, "1.0"), (bad.base_url, "1.1")):
            exp = tmp_path / f"alert-{version}.yaml"
            exp.write_text(yaml.safe_dump(_experiment(url, version)))
            if first is not None:  # the history a judgement needs, written beside the real one
                seed_history(Tracker(env["MLFLOW_TRACKING_URI"], "k3pipe", artifacts), first, copies=3)
            run(sys.executable, "-m", "k3pipe.flows.retest", str(exp), timeout=600)
            first = first or _latest_retest(env["MLFLOW_TRACKING_URI"], artifacts)
        deadline = time.monotonic() + 180
        while not _Receiver.received and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        stop_group(worker, signal.SIGINT)
        log.close()
        receiver.shutdown()
    assert _Receiver.received, (tmp_path / "worker.log").read_text(errors="replace")[-4000:]
    (posted,) = _Receiver.received  # one regression, one post: the first had too little history
    assert "vllm 1.0 -> vllm 1.1" in posted["text"]
    assert posted["regression"]["worse"]


def _latest_retest(tracking_uri: str, artifacts: Path) -> str:
    tracker = Tracker(tracking_uri, "k3pipe", artifacts)
    (latest, *_) = tracker.client.search_runs(
        [tracker.require_experiment_id()],
        filter_string="tags.`k3pipe.kind` = 'retest'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return str(latest.info.run_id)
