"""Regression alerts (k3pipe.alerts): a retest compared with the rolling baseline, the last accepted
retest of the same experiment. In the library: the first retest is accepted, a planted regression
(the same arm against a slower engine, its declared version moved) is found and named with the
versions, and the retest after it is compared with the last good one, not the bad one. Through
Prefect, for real: the retest flow emits the event, prefect.yaml's `notify` deployment trigger (an
automation) starts the notify flow on a worker, which posts the regression to a Webhook block whose
URL is a receiver in this test. The engines are the scripted OpenAI server (tests/scripted_openai.py)."""

from __future__ import annotations

import json
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

from k3pipe.alerts import REGRESSION_FILE, REGRESSION_TAG
from k3pipe.jobs.retest import retest
from k3pipe.jobs.steps import Job
from k3pipe.params import RunRequest
from k3pipe.settings import Settings
from k3pipe.tracking import Tracker
from tests.conftest import PREFECT, REPO, TINY_MODEL, stop_group
from tests.scripted_openai import Script, ScriptedOpenAI

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


@pytest.fixture
def engines() -> Iterator[tuple[ScriptedOpenAI, ScriptedOpenAI]]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.005), model="m") as good,
        ScriptedOpenAI(Script(inter_token_s=0.03), model="m") as bad,  # six times slower per token
    ):
        yield good, bad


def test_a_regression_is_found_against_the_last_accepted_retest(
    engines: tuple[ScriptedOpenAI, ScriptedOpenAI], tmp_path: Path
) -> None:
    good, bad = engines
    settings = Settings(home=tmp_path / "home")
    job = Job.library(
        settings, Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "k3pipe", tmp_path / "artifacts")
    )
    alerts: list[dict[str, Any]] = []
    job = Job(job.settings, job.tracker, job.steps, alert=alerts.append)

    def run(url: str, version: str) -> str:
        exp = tmp_path / f"alert-{version}.yaml"
        exp.write_text(yaml.safe_dump(_experiment(url, version)))
        return retest(RunRequest(experiment=str(exp)), job).retest_run_id

    first = run(good.base_url, "1.0")
    tags = job.tracker.client.get_run(first).data.tags
    assert tags[REGRESSION_TAG] == "none"  # the first retest is the first baseline
    assert alerts == []

    second = run(bad.base_url, "1.1")
    tags = job.tracker.client.get_run(second).data.tags
    assert tags[REGRESSION_TAG].startswith(f"worse than retest {first}"), tags[REGRESSION_TAG]
    (alert,) = alerts
    assert alert["retest_run_id"] == second
    assert alert["baseline_run_id"] == first
    worse = {w["metric"] for w in alert["worse"]}
    assert worse == {"output_throughput_tps", "e2e_ms_p50"}, alert["worse"]
    assert alert["versions"] == {"engine": {"good": "vllm 1.0", "bad": "vllm 1.1"}}
    assert "vllm 1.0 -> vllm 1.1" in alert["summary"]
    recorded = json.loads(job.tracker.read_artifact(second, REGRESSION_FILE) or b"{}")
    assert recorded["regressed"] is True

    # the next retest, good again, is compared with the last accepted one (the first), not the bad one
    third = run(good.base_url, "1.2")
    recorded = json.loads(job.tracker.read_artifact(third, REGRESSION_FILE) or b"{}")
    assert recorded["baseline_run_id"] == first
    assert job.tracker.client.get_run(third).data.tags[REGRESSION_TAG] == "none"
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
        for url, version in ((good.base_url, "1.0"), (bad.base_url, "1.1")):
            exp = tmp_path / f"alert-{version}.yaml"
            exp.write_text(yaml.safe_dump(_experiment(url, version)))
            run(sys.executable, "-m", "flows.retest", str(exp), timeout=600)
        deadline = time.monotonic() + 180
        while not _Receiver.received and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        stop_group(worker, signal.SIGINT)
        log.close()
        receiver.shutdown()
    assert _Receiver.received, (tmp_path / "worker.log").read_text(errors="replace")[-4000:]
    (posted,) = _Receiver.received  # one regression, one post: the first retest was accepted
    assert "vllm 1.0 -> vllm 1.1" in posted["text"]
    assert posted["regression"]["worse"]
