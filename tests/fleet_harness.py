"""Two GPU nodes on this machine for fleet studies (an experiment's ``fleet``): a process work pool per
node (one run at a time) with its ``launch`` deployment, deployed as `k3pipe stack add-node` does, and
a worker of its own whose K3PIPE_HOME is its own; a study flow run as a user runs it
(`python -m flows.study`, its own process). tests/integration/test_fleet_prefect.py and
benchmarks/fleet_wall.py use it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import PREFECT, REPO, stop_group

__all__ = ["Fleet", "kill_flow_runs_of"]


def _prefect(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    out = subprocess.run(
        [PREFECT, *args],
        cwd=REPO,
        env={**env, "PWD": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"prefect {' '.join(args)}: {out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


class Fleet:
    """The two pools with their launch deployments and workers (each its own K3PIPE_HOME), and how
    to run a study flow against them as a user does (`python -m flows.study`, its own process)."""

    def __init__(
        self, env: dict[str, str], tmp_path: Path, pools: tuple[str, ...] = ("node-a", "node-b")
    ) -> None:
        self.env, self.tmp, self.pools = env, tmp_path, pools
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def start(self) -> None:
        for pool in self.pools:
            _prefect(self.env, "work-pool", "create", pool, "--type", "process")
            _prefect(self.env, "work-pool", "set-concurrency-limit", pool, "1")
            _prefect(
                self.env, "--no-prompt", "deploy", "flows/fleet.py:launch", "--name", pool, "--pool", pool
            )
        for pool in self.pools:
            log = (self.tmp / f"worker-{pool}.log").open("wb")
            self._logs.append(log)
            self.workers[pool] = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", pool],
                cwd=self.tmp,
                env={**self.env, "K3PIPE_HOME": str(self.tmp / pool)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def study(self, experiment: dict[str, Any], flow: str = "study") -> subprocess.Popen[str]:
        """The study (or, ``flow="retest"``, the retest) flow of ``experiment`` in a process of its own."""
        exp = self.tmp / f"{experiment['name']}.yaml"
        exp.write_text(yaml.safe_dump(experiment))
        return subprocess.Popen(
            [sys.executable, "-m", f"flows.{flow}", str(exp)],
            cwd=REPO,
            env={**self.env, "K3PIPE_HOME": str(self.tmp / "parent")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- worker {p} ---\n" + (self.tmp / f"worker-{p}.log").read_text(errors="replace")[-3000:]
            for p in self.pools
        )

    def stop(self) -> None:
        for proc in self.workers.values():
            stop_group(proc, signal.SIGINT)
        for log in self._logs:
            log.close()


_KILL_FLOW_RUNS = """
import os, signal, sys
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName,
)

with get_client(sync_client=True) as client:
    runs = client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[sys.argv[1]])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["RUNNING"]))),
    )
for run in runs:
    pid = (run.infrastructure_pid or "").rsplit(":", 1)[-1]
    if pid.isdigit():
        try:
            os.killpg(int(pid), signal.SIGKILL)  # a flow run in a session of its own
        except ProcessLookupError:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass  # gone with its worker
"""


def kill_flow_runs_of(env: dict[str, str], pool: str) -> None:
    """SIGKILL the process of every running flow run of ``pool`` (its infrastructure pid, on this
    machine), as a node that dies takes them with it (a process worker may start them in a session
    of their own, which killing the worker's group leaves running)."""
    subprocess.run([sys.executable, "-c", _KILL_FLOW_RUNS, pool], env=env, check=True, timeout=120)
