"""The real GPUStack server (2.3.0 from PyPI, ``make gpustack``'s venv) on this machine, for the
``gpustack`` launcher's tests against the real thing, and ``scripts/gpustack-real.sh`` for people.

GPUStack binds 0.0.0.0 whatever its flags say (``gpustack/server/server.py:335-339``), so it runs in a
network namespace of its own (``unshare -n``: loopback only, nothing else reaches it or is reached
from it), with a PostgreSQL cluster of its own there (GPUStack takes only ``postgresql://`` or
``mysql://`` URLs), and whatever talks to it runs in that namespace too (``nsenter --net``). Its
server alone, with a cluster made as an administrator would (the embedded worker makes one, but it
downloads tools from GitHub at start, ``worker/tools_manager.py:104``, finds no GPU here and has no
container runtime to run a custom backend in), so a deployment waits for a worker: what the launcher
is checked against. Measured on 2 cores
(2026-12-05): the API answers about 25 s after the start, most of it importing GPUStack.

``python -m tests.gpustack_real`` starts it, drives the launcher (:func:`drive`) and prints what the
server answered as JSON; the test asserts the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPUSTACK_VERSION = "2.3.0"  # the Makefile's GPUSTACK_VERSION
API_PORT = 18080  # the namespace is the server's own: fixed ports collide with nothing
PG_PORT = 15432
ADMIN_PASSWORD = "k3pipe-Test-0nly"  # the namespace's own server, reachable from nowhere else
KEY_ENV = "K3PIPE_GPUSTACK_TEST_KEY"


def gpustack_venv(home: Path) -> Path:
    return home / "venvs" / f"gpustack-{GPUSTACK_VERSION}"


def _pg_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found:
        raise RuntimeError("PostgreSQL's programs are missing: `make test` installs Debian's postgresql")
    return found[-1].parent


_RUN_IN_NAMESPACE = r"""
set -eu
# loopback up in the fresh namespace (iproute2), then PostgreSQL as its unprivileged user, then GPUStack
ip link set lo up
setpriv --reuid=postgres --regid=postgres --init-groups \
  {pg_bin}/postgres -D {pg_data} -h 127.0.0.1 -p {pg_port} -k {pg_sock} > {work}/postgres.log 2>&1 &
for i in $(seq 100); do
  {pg_bin}/pg_isready -q -h 127.0.0.1 -p {pg_port} && break
  sleep 0.1
done
{psql} -c 'create database gpustack' > /dev/null
exec {gpustack} start --data-dir {work}/data \
  --database-url postgresql://gpustack@127.0.0.1:{pg_port}/gpustack \
  --gateway-mode disabled --disable-builtin-observability --disable-update-check \
  --advertise-address 127.0.0.1 --port {port} --api-port {api_port} --proxy-port {proxy_port} \
  --metrics-port {metrics_port} --bootstrap-password {password}
"""


class RealGpustack:
    """One GPUStack server in a namespace of its own, under ``work`` (a directory the unprivileged
    PostgreSQL user may enter); :meth:`stop` ends its process group (PostgreSQL with it)."""

    def __init__(self, venv: Path, work: Path) -> None:
        self.venv = venv
        self.work = work
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work / "gpustack.log"
        self.url = f"http://127.0.0.1:{API_PORT}"
        self.startup_s: float | None = None

    def start(self, timeout_s: float = 180.0) -> None:
        gpustack = self.venv / "bin" / "gpustack"
        if not gpustack.exists():
            raise RuntimeError(f"{gpustack} is missing: `make gpustack` (make test does it) installs it")
        pg_bin = _pg_bin()
        postgres = pwd.getpwnam("postgres")
        data, sock = self.work / "pg", self.work / "pgsock"
        for d in (data, sock):
            d.mkdir()
            os.chown(d, postgres.pw_uid, postgres.pw_gid)
        subprocess.run(
            [str(pg_bin / "initdb"), "-D", str(data), "-U", "gpustack", "--auth=trust", "-E", "UTF8"],
            user=postgres.pw_uid,
            group=postgres.pw_gid,
            extra_groups=[],
            cwd=data,
            capture_output=True,
            check=True,
        )
        script = _RUN_IN_NAMESPACE.format(
            pg_bin=pg_bin,
            pg_data=data,
            pg_port=PG_PORT,
            pg_sock=sock,
            work=self.work,
            psql=shlex.join([str(pg_bin / "psql"), "-q", "-h", "127.0.0.1", "-p", str(PG_PORT)])
            + " -U gpustack -d postgres",
            gpustack=gpustack,
            port=API_PORT - 80,
            api_port=API_PORT,
            proxy_port=API_PORT + 1,
            metrics_port=API_PORT + 2,
            password=ADMIN_PASSWORD,
        )
        t0 = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["unshare", "-n", "--", "bash", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.work), "LC_ALL": "C.UTF-8"},
            )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"GPUStack exited with {self.proc.returncode}; its log:\n{self.tail()}")
            done = self.run_here(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", self.url + "/healthz"]
            )
            if done.stdout.strip() == "200":
                self.startup_s = time.monotonic() - t0
                return
            time.sleep(1.0)
        raise RuntimeError(f"GPUStack did not answer within {timeout_s:.0f} s; its log:\n{self.tail()}")

    def run_here(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` in the server's network namespace."""
        assert self.proc is not None
        return subprocess.run(
            ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", "--", *argv],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=300,
        )

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def real_gpustack(home: Path) -> Iterator[RealGpustack]:
    """A started server (stopped and its directory removed on the way out)."""
    work = Path(tempfile.mkdtemp(prefix="k3gpustack-", dir="/tmp"))
    work.chmod(0o755)  # the unprivileged PostgreSQL user enters it
    server = RealGpustack(gpustack_venv(home), work)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def drive(url: str, model_dir: str, wait_s: float) -> dict[str, Any]:
    """Run in the server's namespace: an admin session and an API key (GPUStack's own flow), then the
    ``gpustack`` launcher's deployment of a vLLM arm: start, its progress for ``wait_s``, the gateway's
    answer, the deployment's deletion; what happened, as a dict. The key never leaves this process."""
    import httpx

    from k3pipe.experiment.load import parse_experiment
    from k3pipe.launchers.gpustack import Deployment, GpustackLauncher
    from k3pipe.planning.plan import plan_arm
    from k3pipe.schema.launcher_specs import GpustackLauncherSpec

    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as admin:
        login = admin.post("/auth/login", data={"username": "admin", "password": ADMIN_PASSWORD})
        out["login"] = login.status_code
        created = admin.post("/v2/api-keys", json={"name": "k3pipe-test"})
        out["api_key"] = created.status_code
        key = str(created.json()["value"])
        # the server alone has no cluster (its embedded worker would make one): an administrator's
        # first step, and the one the launcher then finds (GET /v2/clusters)
        cluster = admin.post("/v2/clusters", json={"name": "k3pipe-test"})
        out["cluster"] = [cluster.status_code, cluster.json().get("id")]
    os.environ[KEY_ENV] = key
    out["unauthorized"] = httpx.get(url + "/v2/workers", timeout=30, trust_env=False).status_code
    launcher_spec = {
        "kind": "gpustack",
        "server_url": url,
        "api_key_env": KEY_ENV,
        "backend": "k3pipe-vllm-custom",
        "backend_version": "v1",  # a custom backend's versions are free (the suffix is for built-in ones)
        "request_timeout_s": 30,
    }
    spec = parse_experiment(
        {
            "name": "gpustack-real",
            "model": {"source": "local", "path": model_dir},
            "arms": [
                {
                    "name": "vllm",
                    "engine": {"kind": "vllm", "image": "127.0.0.1:5055/k3pipe/vllm-cpu-runtime:bookworm"},
                    "launcher": launcher_spec,
                }
            ],
            "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
        }
    )
    plan = plan_arm(spec, spec.arms[0], Path(model_dir).parent, {"model": model_dir})
    launcher = GpustackLauncher(
        GpustackLauncherSpec.model_validate(launcher_spec),
        Deployment.of(plan, {}),
        key,
        Path(tempfile.mkdtemp()) / "engine.log",
    )
    said: list[str] = []
    try:
        launcher.start()
        out["model_id"] = launcher.model_id
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            out["ready"] = launcher.ready(said.append)
            time.sleep(1.0)
        out["progress"] = said
        model = launcher.api.call("GET", f"/models/{launcher.model_id}").json()
        out["model"] = {
            k: model.get(k) for k in ("name", "cluster_id", "backend", "backend_version", "source")
        }
        backend = launcher.api.call("GET", "/inference-backends/backend_name/k3pipe-vllm-custom").json()
        out["backend_versions"] = sorted(backend.get("version_configs") or {})
        chat = httpx.post(
            url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": plan.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=30,
            trust_env=False,
        )
        out["chat_while_pending"] = [chat.status_code, chat.json().get("error", chat.json())]
    finally:
        launcher.stop()
    gone = httpx.get(
        f"{url}/v2/models/{out.get('model_id')}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
        trust_env=False,
    )
    out["after_delete"] = [gone.status_code, gone.json().get("message")]
    out["left_behind"] = launcher.left_behind
    return out


def check(home: Path, model_dir: Path, wait_s: float) -> dict[str, Any]:
    """Start the server, :func:`drive` the launcher in its namespace, stop it: what it answered."""
    with real_gpustack(home) as server:
        argv = [sys.executable, "-m", "tests.gpustack_real", "drive", server.url, str(model_dir), str(wait_s)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = server.run_here(argv, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the driver failed ({done.returncode}):\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        result["startup_s"] = round(server.startup_s or 0.0, 1)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("check", help="start the real server, drive the launcher, print what it answered")
    run.add_argument("--home", type=Path, default=Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")))
    run.add_argument("--wait", type=float, default=15.0, help="seconds to follow the deployment")
    inner = sub.add_parser("drive", help="(in the server's namespace) drive the launcher")
    inner.add_argument("url")
    inner.add_argument("model_dir")
    inner.add_argument("wait", type=float)
    args = parser.parse_args()
    if args.command == "drive":
        print(json.dumps(drive(args.url, args.model_dir, args.wait)))
        return
    model = args.home / "models" / "tiny-llama"
    print(json.dumps(check(args.home, model, args.wait), indent=2))


if __name__ == "__main__":
    main()
