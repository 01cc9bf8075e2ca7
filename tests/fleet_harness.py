"""Two GPU nodes on this machine for fleet studies (an experiment's ``fleet``): a process work pool per
node (one run at a time) with its ``launch`` deployment, deployed as `k3pipe stack add-node` does, and
a worker of its own whose K3PIPE_HOME is its own; a study flow run as a user runs it
(`python -m k3pipe.flows.study`, its own process). :func:`team_stack` is the stack they run against as a
team runs it beyond loopback (k3pipe.ops.stack: PostgreSQL, MLflow, Prefect; auth and TLS on), here on
127.0.0.1. tests/integration/test_fleet_prefect.py and benchmarks/fleet_wall.py use them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import yaml

from k3pipe.ops.stack import StackConfig, add_node, down, up
from tests.conftest import PREFECT, REPO, free_port, stop_group

__all__ = ["Fleet", "StudyProcess", "base_env", "kill_flow_runs_of", "prefect_cli", "team_stack"]

_ISOLATED = ("K3PIPE_", "MLFLOW_", "PREFECT_")


def prefect_cli(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    """The Prefect CLI, from the checkout, with ``env``; its output (an assertion names a failure)."""
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


def base_env() -> dict[str, str]:
    """This environment without any k3pipe, MLflow or Prefect setting."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_ISOLATED)}


@contextmanager
def team_stack(pools: tuple[str, ...] = ()) -> Iterator[StackConfig]:
    """The team stack (k3pipe.ops.stack.up) with auth and TLS on, as beyond loopback, bound to 127.0.0.1 on
    free ports, without a worker of its own; each of ``pools`` set up as `k3pipe stack add-node` does.
    Its home is under /tmp (PostgreSQL's unprivileged user must reach it). Taken down on the way out."""
    home = Path(tempfile.mkdtemp(prefix="k3fleet-", dir="/tmp"))
    home.chmod(0o755)
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_port())
    pg, ml, pf = sorted(ports)
    config = StackConfig(
        home=home, postgres_port=pg, mlflow_port=ml, prefect_port=pf, start_timeout_s=300, worker=False,
        project_dir=REPO, base_env=base_env(), auth=True, tls=True,
    )  # fmt: skip
    try:
        up(config)
        for pool in pools:
            add_node(config, pool)
        yield config
    finally:
        try:
            down(config)
        finally:
            shutil.rmtree(home, ignore_errors=True)


class StudyProcess:
    """A study (or retest) flow in a process of its own, its output in a file that can be read while
    it runs; ``communicate``, ``poll`` and ``returncode`` as a ``Popen``'s."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def wait_for(self, marker: str, timeout_s: float = 300) -> str:
        """The output once it holds ``marker``; fails if the study ends or the time passes first."""
        deadline = time.monotonic() + timeout_s
        while marker not in (text := self.text()):
            assert self.proc.poll() is None, f"the study ended before {marker!r}:\n{text[-6000:]}"
            assert time.monotonic() < deadline, f"{marker!r} never appeared:\n{text[-6000:]}"
            time.sleep(0.5)
        return text

    def communicate(self, timeout: float) -> tuple[str, None]:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                stop_group(self.proc, signal.SIGINT)
            self._out.close()
        return self.text(), None


class Fleet:
    """The pools' workers (each its own K3PIPE_HOME), and how to run a study flow against them as a
    user does (`python -m k3pipe.flows.study`, its own process). ``start(deploy=True)`` also makes each pool
    and its launch deployment (without a stack's `add-node`)."""

    def __init__(
        self, env: dict[str, str], tmp_path: Path, pools: tuple[str, ...] = ("node-a", "node-b")
    ) -> None:
        self.env, self.tmp, self.pools = env, tmp_path, pools
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def start(self, deploy: bool = True) -> None:
        if deploy:
            for pool in self.pools:
                prefect_cli(self.env, "work-pool", "create", pool, "--type", "process")
                prefect_cli(self.env, "work-pool", "set-concurrency-limit", pool, "1")
                prefect_cli(
                    self.env, "--no-prompt", "deploy", "flows/fleet.py:launch", "--name", pool, "--pool", pool
                )
        for pool in self.pools:
            self.start_worker(pool)

    def start_worker(self, pool: str) -> None:
        log = (self.tmp / f"worker-{pool}.log").open("ab")
        self._logs.append(log)
        self.workers[pool] = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", pool],
            cwd=self.tmp,
            env={**self.env, "K3PIPE_HOME": str(self.tmp / pool)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def study(self, experiment: dict[str, Any], flow: str = "study") -> StudyProcess:
        """The study (or, ``flow="retest"``, the retest) flow of ``experiment`` in a process of its own."""
        exp = self.tmp / f"{experiment['name']}.yaml"
        exp.write_text(yaml.safe_dump(experiment))
        return StudyProcess(
            [sys.executable, "-m", f"k3pipe.flows.{flow}", str(exp)],
            {**self.env, "K3PIPE_HOME": str(self.tmp / "parent")},
            self.tmp / f"{experiment['name']}-{flow}.log",
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
