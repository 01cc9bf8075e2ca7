"""A study's wall time on one worker against two (an experiment's ``fleet``), measured in one run.

    python benchmarks/fleet_wall.py                 # about 6 minutes on 2 cores

The study: the real vLLM (CPU build, the demo's batch4 arm, launched by its node's worker) and a
scripted endpoint whose requests take as long (k3pipe/testing/scripted_openai.py), two launches each, the same
prompts. Run twice through the study flow against a real Prefect server and MLflow server (the
harness of tests/fleet_harness.py: each node a work pool with its launch deployment and a worker of
its own K3PIPE_HOME): first with every launch on node-a alone, then with vllm placed on node-a and
the scripted arm on node-b. Prints each wall time (the study run's ``study.wall_s``, and the flow's
process from start to exit) and their ratio. On real GPU nodes the engines do not share CPUs; here
the vLLM engine and the client share two cores, so the figure is a floor of what nodes give.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.faults import MlflowServer  # noqa: E402
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI  # noqa: E402
from tests.conftest import ASSETS_HOME, free_port, running_prefect_server  # noqa: E402
from tests.fleet_harness import Fleet  # noqa: E402
from tests.stores import seed_mlflow_db  # noqa: E402


def experiment(name: str, scripted_url: str, fleet: dict[str, Any]) -> dict[str, Any]:
    data = yaml.safe_load((REPO / "experiments" / "demo-study.yaml").read_text())
    data = yaml.safe_load(yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME)))
    vllm = data["arms"][0]
    vllm.update(name="vllm", launches=2, endpoint={})
    vllm["launcher"]["port"] = free_port()
    scripted = {
        "name": "scripted", "launches": 2, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
        "endpoint": {"base_url": scripted_url, "model": "m"},
    }  # fmt: skip
    return {
        "name": name,
        "model": data["model"],
        "arms": [vllm, scripted],
        "workloads": [{**data["workloads"][0], "num_requests": 16, "repeats": 2}],
        "fleet": fleet,
    }


def run(fleet: Fleet, data: dict[str, Any], uri: str) -> tuple[float, float]:
    """The study's process wall time and its run's study.wall_s."""
    from mlflow import MlflowClient

    began = time.monotonic()
    proc = fleet.study(data)
    out, _ = proc.communicate(timeout=1800)
    wall = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"study {data['name']} failed:\n{out[-4000:]}\n{fleet.logs()}")
    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "k3pipe"]
    where = f"tags.`k3pipe.experiment` = '{data['name']}' and tags.`k3pipe.kind` = 'study'"
    (study,) = client.search_runs([exp.experiment_id], where)
    return wall, float(study.data.metrics["study.wall_s"])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="k3pipe-fleet-wall-"))
    mlflow = MlflowServer(tmp / "mlflow")
    seed_mlflow_db(tmp / "mlflow" / "mlflow.db")
    mlflow.start()
    try:
        with running_prefect_server(tmp / "prefect") as prefect:
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("K3PIPE", "MLFLOW", "PREFECT"))},
                **prefect,
                "MLFLOW_TRACKING_URI": mlflow.uri,
                "PREFECT_WORKER_QUERY_SECONDS": "2",
                "PYTHONUNBUFFERED": "1",
            }
            fleet = Fleet(env, tmp)
            fleet.start()
            try:
                # a scripted request as long as the real engine's (64 tokens at ~30 ms on 2 cores)
                with ScriptedOpenAI(Script(inter_token_s=0.03), model="m") as scripted:
                    alone = {"pools": ["node-a"]}
                    one = run(fleet, experiment("fleet-one", scripted.base_url, alone), mlflow.uri)
                    placed = {
                        "pools": ["node-a", "node-b"],
                        "arms": {"vllm": ["node-a"], "scripted": ["node-b"]},
                    }
                    two = run(fleet, experiment("fleet-two", scripted.base_url, placed), mlflow.uri)
            finally:
                fleet.stop()
    finally:
        if mlflow.proc is not None and mlflow.proc.poll() is None:
            os.killpg(mlflow.proc.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    print("study of 4 launches (vllm x2 real CPU engine, scripted x2), same prompts:")
    print(f"  one worker (node-a):           {one[0]:6.1f} s  (study.wall_s {one[1]:6.1f} s)")
    print(f"  two workers (node-a, node-b):  {two[0]:6.1f} s  (study.wall_s {two[1]:6.1f} s)")
    print(f"  two workers take {two[1] / one[1]:.2f}x the time of one (study.wall_s)")


if __name__ == "__main__":
    main()
