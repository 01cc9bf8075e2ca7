"""The team stack for real (`k3pipe stack up|status|env|down`): PostgreSQL, MLflow on it with proxied
artifacts, a Prefect server, the k3pipe work pool and a worker, on free ports under a K3PIPE_HOME of
their own; a run logged through ``Tracker`` lands in PostgreSQL and the server's artifact store.

The module's tests share one stack (started once, ~1 min) and run in file order: the last one takes
it down. The fixture takes it down on every path anyway."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg2
import pytest

from k3pipe.core.settings import Settings
from k3pipe.ops.stack import StackConfig, load_state
from k3pipe.records.tracking import Tracker
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.flow

_ISOLATED = ("K3PIPE_", "MLFLOW_", "PREFECT_")


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _stack_home() -> Path:
    """A home PostgreSQL's unprivileged user can reach (pytest's tmp dirs are mode 0700 under root's)."""
    home = Path(tempfile.mkdtemp(prefix="k3stack-", dir="/tmp"))
    home.chmod(0o755)
    return home


@dataclass
class Stack:
    home: Path
    postgres_port: int
    mlflow_port: int
    prefect_port: int
    env: dict[str, str] = field(default_factory=dict)
    up_output: str = ""
    up_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(_ISOLATED)}
        self.env.update(
            K3PIPE_HOME=str(self.home),
            K3PIPE_STACK_POSTGRES_PORT=str(self.postgres_port),
            K3PIPE_STACK_MLFLOW_PORT=str(self.mlflow_port),
            K3PIPE_STACK_PREFECT_PORT=str(self.prefect_port),
            K3PIPE_STACK_START_TIMEOUT_S="240",
            PYTHONUNBUFFERED="1",
        )

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`k3pipe stack ARGS` as a user runs it, from another directory than the checkout."""
        return subprocess.run(
            [sys.executable, "-m", "k3pipe.cli.main", "stack", *args],
            cwd=self.home,
            env={**self.env, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    @property
    def config(self) -> StackConfig:
        return StackConfig(
            home=self.home,
            postgres_port=self.postgres_port,
            mlflow_port=self.mlflow_port,
            prefect_port=self.prefect_port,
        )

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def prefect_api(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"


def _down_and_remove(stack: Stack) -> None:
    try:
        stack.cli("down", timeout=180)
    finally:
        shutil.rmtree(stack.home, ignore_errors=True)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(_stack_home(), *_free_ports(3))
    try:
        start = time.monotonic()
        out = s.cli("up", timeout=600)
        s.up_seconds = time.monotonic() - start
        s.up_output = out.stdout + out.stderr
        assert out.returncode == 0, s.up_output[-5000:]
        yield s
    finally:
        _down_and_remove(s)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (IPv4 and IPv6), from /proc."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                if len(address) == 8:
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    found.add(f"ipv6:{address}")
    return found


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _processes_inside(directory: Path) -> list[str]:
    """Live processes whose working directory is inside ``directory`` (PostgreSQL's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if cwd.is_relative_to(directory) and _pid_alive(int(entry.name)):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
            found.append(f"{entry.name}: {cmdline!r}")
    return found


def _group(pgid: int) -> list[int]:
    """The live processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def _port_bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_up_starts_every_service_on_localhost(stack: Stack) -> None:
    print(f"stack up from cold: {stack.up_seconds:.1f} s")
    state = load_state(stack.config)
    assert list(state) == ["postgres", "mlflow", "prefect", "worker"]
    for record in state.values():
        assert record.pgid == record.pid
        assert _pid_alive(record.pid)
        assert Path(record.log).is_file()
        assert Path(record.log).is_relative_to(stack.home / "stack" / "logs")
    # bound to 127.0.0.1 and nothing else
    for port in (stack.postgres_port, stack.mlflow_port, stack.prefect_port):
        assert _listening_addresses(port) == {"127.0.0.1"}, port
    # PostgreSQL runs unprivileged, with its data in K3PIPE_HOME
    pg = state["postgres"]
    assert Path(f"/proc/{pg.pid}").stat().st_uid != 0
    assert (stack.home / "stack" / "postgres" / "PG_VERSION").is_file()

    # the pool (process, concurrency limit 1), prefect.yaml's deployments, and the worker online
    pool = httpx.get(f"{stack.prefect_api}/work_pools/k3pipe", trust_env=False).json()
    assert (pool["type"], pool["concurrency_limit"]) == ("process", 1)
    deployments = httpx.post(f"{stack.prefect_api}/deployments/filter", json={}, trust_env=False).json()
    pools = {d["name"]: d["work_pool_name"] for d in deployments}
    assert pools == {"benchmark": "k3pipe", "rerun": "k3pipe", "study": "k3pipe", "retest": "k3pipe",
                     "gpu": "gpu-node", "notify": "k3pipe"}  # fmt: skip
    workers = httpx.post(f"{stack.prefect_api}/work_pools/k3pipe/workers/filter", json={}, trust_env=False)
    assert [w["status"] for w in workers.json()] == ["ONLINE"]
    # the worker's runs log to the stack's MLflow through the stack's Prefect
    environ = Path(f"/proc/{state['worker'].pid}/environ").read_bytes().split(b"\0")
    assert f"MLFLOW_TRACKING_URI={stack.mlflow_url}".encode() in environ
    assert f"PREFECT_API_URL={stack.prefect_api}".encode() in environ

    out = stack.cli("status")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for name in ("postgres", "mlflow", "prefect", "worker"):
        row = next(line for line in lines if line.startswith(name))
        assert f"{name:<9} running " in row, row
        assert f"pid {state[name].pid}" in row
    assert f"export MLFLOW_TRACKING_URI={stack.mlflow_url}" in lines
    assert f"export PREFECT_API_URL={stack.prefect_api}" in lines
    assert str(stack.home / "stack" / "logs" / "mlflow.log") in out.stdout

    # `eval "$(k3pipe stack env)"` sets both
    k3pipe = f"{sys.executable} -m k3pipe.cli.main"
    script = f'eval "$({k3pipe} stack env)"; echo "$MLFLOW_TRACKING_URI $PREFECT_API_URL"'
    shell = subprocess.run(
        ["bash", "-c", script], env={**stack.env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True
    )
    assert shell.stdout.split() == [stack.mlflow_url, stack.prefect_api], shell.stderr
    # the role's password never reaches a log or a command line
    password = (stack.home / "stack" / "pgpass").read_text().split(":")[-1].strip()
    assert (stack.home / "stack" / "pgpass").stat().st_mode & 0o777 == 0o600
    for log in (stack.home / "stack" / "logs").iterdir():
        assert password not in log.read_text(errors="replace"), log
    for record in state.values():
        assert password.encode() not in Path(f"/proc/{record.pid}/cmdline").read_bytes()


@pytest.mark.fresh_home  # what the client writes into its own home is asserted: nothing of MLflow's
def test_a_tracked_run_lands_in_postgres_and_the_servers_artifact_store(
    stack: Stack, clean_environ: Path
) -> None:
    client_home = clean_environ  # the client's own K3PIPE_HOME, not the stack's
    settings = Settings()
    assert settings.home_dir == client_home.resolve()
    tracker = Tracker(stack.mlflow_url, "stack-e2e", artifact_root=settings.artifact_root())
    run_id = tracker.start_run("e2e", tags={"k3pipe.kind": "test"})
    tracker.log_params(run_id, {"engine": "vllm", "concurrency": 4})
    tracker.log_metrics(run_id, {"ttft_ms_p50": 12.5})
    tracker.log_text(run_id, "hello from the client", "notes/hello.txt")
    tracker.end_run(run_id)

    # (b) the experiment's artifacts are proxied by the server, never a client path
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location
    stored = list((stack.home / "stack" / "mlflow-artifacts").rglob("hello.txt"))
    assert len(stored) == 1
    assert stored[0].read_text() == "hello from the client"
    assert run_id in stored[0].parts
    assert tracker.read_artifact(run_id, "notes/hello.txt") == b"hello from the client"
    # (c) nothing under the client's K3PIPE_HOME
    assert not (client_home / "mlflow").exists()

    # (a) the run, its param, metric and experiment are rows of the stack's PostgreSQL, reached over
    # 127.0.0.1 with the role's password (pgpass); without it the server refuses
    pgpass = stack.home / "stack" / "pgpass"
    dsn = f"host=127.0.0.1 port={stack.postgres_port} user=k3pipe dbname=mlflow"
    with psycopg2.connect(dsn, passfile=str(pgpass)) as conn, conn.cursor() as cur:
        cur.execute("SELECT name, status, experiment_id FROM runs WHERE run_uuid = %s", (run_id,))
        assert cur.fetchall() == [("e2e", "FINISHED", int(tracker.experiment_id))]
        cur.execute("SELECT value FROM params WHERE run_uuid = %s AND key = 'concurrency'", (run_id,))
        assert cur.fetchall() == [("4",)]
        cur.execute("SELECT value FROM latest_metrics WHERE run_uuid = %s AND key = 'ttft_ms_p50'", (run_id,))
        assert cur.fetchall() == [(12.5,)]
        cur.execute("SELECT artifact_location FROM experiments WHERE name = 'stack-e2e'")
        assert cur.fetchone()[0].startswith("mlflow-artifacts:")
    empty = client_home.parent / "empty.pgpass"
    empty.touch(mode=0o600)
    with pytest.raises(psycopg2.OperationalError, match="password"):
        psycopg2.connect(dsn, passfile=str(empty))


def test_up_again_leaves_the_running_stack_alone(stack: Stack) -> None:
    before = load_state(stack.config)
    start = time.monotonic()
    out = stack.cli("up")
    took = time.monotonic() - start
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("already running") == 4, out.stdout
    assert "started" not in out.stdout
    after = load_state(stack.config)
    assert {n: (r.pid, r.proc_start) for n, r in after.items()} == {
        n: (r.pid, r.proc_start) for n, r in before.items()
    }
    print(f"stack up, already running: {took:.1f} s")
    assert took < 30


def test_add_node_makes_its_pool_and_launch_deployment(stack: Stack) -> None:
    """`k3pipe stack add-node NAME`: the node's pool (process, one run at a time) and the launch
    deployment a fleet study starts on it, and the commands that start its worker."""
    out = stack.cli("add-node", "gpu-node-1", timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    pool = httpx.get(f"{stack.prefect_api}/work_pools/gpu-node-1", trust_env=False).json()
    assert (pool["type"], pool["concurrency_limit"]) == ("process", 1)
    deployments = httpx.post(f"{stack.prefect_api}/deployments/filter", json={}, trust_env=False).json()
    (launch,) = [d for d in deployments if d["name"] == "gpu-node-1"]
    assert launch["work_pool_name"] == "gpu-node-1"
    flow = httpx.get(f"{stack.prefect_api}/flows/{launch['flow_id']}", trust_env=False).json()
    assert flow["name"] == "launch"
    assert "prefect worker start --pool gpu-node-1" in out.stdout
    assert f"export MLFLOW_TRACKING_URI={stack.mlflow_url}" in out.stdout
    bad = stack.cli("add-node", "../gpu")
    assert bad.returncode == 2
    assert "node (work pool)" in bad.stderr


def test_down_stops_exactly_what_up_started_also_after_a_death(stack: Stack) -> None:
    state = load_state(stack.config)
    # MLflow's leader dies behind the stack's back; its uvicorn child lives on in its process group
    mlflow = state["mlflow"]
    children = [p for p in _group(mlflow.pgid) if p != mlflow.pid]
    assert children, "mlflow server runs uvicorn as a child"
    os.kill(mlflow.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _pid_alive(mlflow.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    status = stack.cli("status")
    assert status.returncode == 1
    assert f"not running (pid {mlflow.pid} gone" in status.stdout, status.stdout

    start = time.monotonic()
    out = stack.cli("down", timeout=180)
    print(f"stack down: {time.monotonic() - start:.1f} s")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("worker", "prefect", "mlflow", "postgres"):
        assert f"{name}: stopped" in out.stdout, out.stdout  # mlflow: what was left of its group
    assert not any(_pid_alive(p) for p in children)
    for record in state.values():
        assert not _pid_alive(record.pid), record
    assert _processes_inside(stack.home) == []  # PostgreSQL's children run in its data directory
    for port in (stack.postgres_port, stack.mlflow_port, stack.prefect_port):
        assert _port_bindable(port), port
    assert not (stack.home / "stack" / "state.json").exists()

    status = stack.cli("status")
    assert status.returncode == 1
    assert status.stdout.count("not started") == 4
    again = stack.cli("down")
    assert again.returncode == 0
    assert "nothing to stop" in again.stdout


def test_a_taken_port_fails_clearly_and_stops_what_the_start_started() -> None:
    s = Stack(_stack_home(), *_free_ports(3))
    holder = socket.socket()
    holder.bind(("127.0.0.1", s.mlflow_port))
    holder.listen()
    try:
        out = s.cli("up", timeout=300)
        assert out.returncode == 2, out.stdout + out.stderr
        assert (
            f"error: mlflow cannot start: port {s.mlflow_port} on 127.0.0.1 is already in use by another "
            "program; free it, or choose another port with K3PIPE_STACK_MLFLOW_PORT=PORT"
        ) in " ".join(out.stderr.split())
        started = {
            line.split(":")[0]: int(line.split("(pid ")[1].split(")")[0])
            for line in out.stdout.splitlines()
            if ": started (pid " in line
        }
        assert set(started) == {"postgres", "prefect"}, out.stdout
        for name in ("postgres", "prefect"):
            assert f"{name}: stopped" in out.stdout, out.stdout
        assert out.stdout.count("(a start failed)") == 2, out.stdout
        assert not any(_pid_alive(pid) for pid in started.values())
        assert _processes_inside(s.home) == []
        assert load_state(s.config) == {}
        assert _port_bindable(s.postgres_port)
        assert _port_bindable(s.prefect_port)
    finally:
        holder.close()
        _down_and_remove(s)


def test_a_service_that_dies_at_start_is_named_with_its_log(tmp_path: Path) -> None:
    """A PostgreSQL that exits at once (a stand-in for a broken install): the error names the service,
    its exit code, its log file and the log's last lines."""
    s = Stack(_stack_home(), *_free_ports(3))
    fake = s.home / "fake-pg-bin"
    fake.mkdir()
    scripts = {
        "initdb": 'cd "$2" && echo 15 > PG_VERSION',
        "postgres": 'echo "FATAL:  pretend: could not load library"; exit 3',
        "pg_isready": "exit 2",
        "psql": "exit 2",
    }
    for name, body in scripts.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    s.env["K3PIPE_STACK_POSTGRES_BIN"] = str(fake)
    try:
        out = s.cli("up", timeout=300)
        assert out.returncode == 2, out.stdout + out.stderr
        log = s.home / "stack" / "logs" / "postgres.log"
        message = out.stderr
        assert "error: postgres exited with code 3 before it was ready" in message, message
        assert f"its log {log} ends with:" in message
        assert "FATAL:  pretend: could not load library" in message
        assert "prefect: stopped" in out.stdout  # started beside it, stopped again
        assert load_state(s.config) == {}
    finally:
        _down_and_remove(s)


def test_a_stack_with_auth_and_tls_refuses_plain_http_and_clients_without_its_password() -> None:
    """K3PIPE_STACK_AUTH and K3PIPE_STACK_TLS on (here on loopback, as a stack bound beyond it must
    have them): both servers serve HTTPS only, with a certificate of the stack's own CA, and MLflow's
    basic-auth app and Prefect's auth string refuse a client without the stack's password, or with a
    wrong one; plain HTTP gets no answer, a client that does not trust the CA refuses the certificate;
    a client with both is served. The worker comes online through them and a tracked run lands
    through `k3pipe stack env`'s settings; `stack status` says auth and TLS are on; the password is in
    a 0600 file, never on a command line, in a log or in `stack env`. Binding beyond loopback without
    auth, or without TLS, is refused before anything starts."""
    s = Stack(_stack_home(), *_free_ports(3))
    s.env["K3PIPE_STACK_AUTH"] = "true"
    s.env["K3PIPE_STACK_TLS"] = "true"
    try:
        for auth, tls, says in (("0", "1", "K3PIPE_STACK_AUTH off"), ("1", "0", "K3PIPE_STACK_TLS off")):
            bare = subprocess.run(
                [sys.executable, "-m", "k3pipe.cli.main", "stack", "up"],
                cwd=s.home,
                env={**s.env, "PYTHONPATH": str(REPO), "K3PIPE_STACK_HOST": "0.0.0.0",
                     "K3PIPE_STACK_AUTH": auth, "K3PIPE_STACK_TLS": tls},
                capture_output=True,
                text=True,
                timeout=120,
            )  # fmt: skip
            assert bare.returncode != 0
            assert "binds MLflow and Prefect beyond loopback" in bare.stderr, bare.stderr
            assert says in bare.stderr, bare.stderr
            assert load_state(s.config) == {}  # nothing started

        out = s.cli("up", timeout=600)
        assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
        creds = s.home / "stack" / "credentials"
        assert creds.stat().st_mode & 0o777 == 0o600
        user, _, password = creds.read_text().strip().partition(":")
        wrong = (user, password + "x")
        tls = s.home / "stack" / "tls"
        assert (tls / "ca.pem").stat().st_mode & 0o777 == 0o644
        for key in ("ca-key.pem", "server-key.pem"):
            assert (tls / key).stat().st_mode & 0o777 == 0o600
        ca = ssl.create_default_context(cafile=str(tls / "ca.pem"))
        mlflow_url = f"https://127.0.0.1:{s.mlflow_port}"
        prefect_api = f"https://127.0.0.1:{s.prefect_port}/api"

        pools = f"{prefect_api}/work_pools/k3pipe"
        search = f"{mlflow_url}/api/2.0/mlflow/experiments/search?max_results=5"
        for url in (pools, search):
            with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS port: no answer
                httpx.get("http://" + url.removeprefix("https://"), auth=(user, password), trust_env=False)
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(url, auth=(user, password), trust_env=False)  # the public CAs only
            assert httpx.get(url, verify=ca, trust_env=False).status_code == 401
            assert httpx.get(url, verify=ca, trust_env=False, auth=wrong).status_code == 401
            assert httpx.get(url, verify=ca, trust_env=False, auth=(user, password)).status_code == 200
        workers = httpx.post(
            f"{pools}/workers/filter", json={}, verify=ca, trust_env=False, auth=(user, password)
        )
        assert [w["status"] for w in workers.json()] == ["ONLINE"]  # the worker authenticated over TLS

        status = s.cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "auth: on" in status.stdout
        (tls_line,) = [line for line in status.stdout.splitlines() if line.startswith("tls: ")]
        assert tls_line.startswith(f"tls: on (CA {tls / 'ca.pem'} (copy it to each node); certificate for ")
        assert "127.0.0.1, " in tls_line
        assert f"export MLFLOW_TRACKING_SERVER_CERT_PATH={tls / 'ca.pem'}" in status.stdout
        assert f"export PREFECT_API_SSL_CERT_FILE={tls / 'ca.pem'}" in status.stdout

        # a client given the stack's env (the password read from the file, the CA trusted) records a
        # run, and k3pipe's own check of the tracking server trusts the same CA
        script = (
            f'eval "$({sys.executable} -m k3pipe.cli.main stack env)"; '
            f'{sys.executable} -c "import mlflow; from k3pipe.records.push import probe_tracking; '
            f"assert probe_tracking('{mlflow_url}') is None; mlflow.set_tracking_uri('{mlflow_url}'); "
            "mlflow.set_experiment('auth-check'); r = mlflow.start_run(); mlflow.log_metric('m', 1.0); "
            'mlflow.end_run(); print(r.info.run_id)"'
        )
        shell = subprocess.run(
            ["bash", "-c", script], env={**s.env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert shell.returncode == 0, shell.stderr[-3000:]
        env_out = s.cli("env")
        assert password not in env_out.stdout + env_out.stderr
        assert str(creds) in env_out.stdout
        # never on a command line, never in a log
        for record in load_state(s.config).values():
            assert password.encode() not in Path(f"/proc/{record.pid}/cmdline").read_bytes()
        for log in (s.home / "stack" / "logs").iterdir():
            assert password not in log.read_text(errors="replace"), log
    finally:
        _down_and_remove(s)
