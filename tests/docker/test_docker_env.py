"""scripts/docker-env.sh itself, on the real dockerd and registry: cold starts, and failed starts that
must leave nothing running.

Each test gets its own K3PIPE_HOME (so its own socket, data and exec roots, pid files and logs) and a
free registry port, so it runs beside the daemons `make test` started. "Nothing left" is checked by
scanning every process's command line for the test's K3PIPE_HOME: dockerd, the containerd it starts
and the registry all name a path under it. Whatever a test started is stopped in a finally, by pid.

Failures are made real, not mocked: the registry's port taken by another listener, a registry that
exits or never answers, a storage driver dockerd does not know, a signal in the middle of `up`, a
Debian mirror that refuses the base image build. A slow exec (as on a cold page cache, where the
registry's binary is read from disk after the fork) is a wrapper that sleeps before it execs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "docker-env.sh"


def _processes_under(home: Path) -> dict[int, str]:
    """pid -> command line of every live process whose command line names a path under ``home``."""
    found: dict[int, str] = {}
    needle = str(home).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state not in ("Z", "X"):
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


class DockerEnv:
    """scripts/docker-env.sh with its own K3PIPE_HOME and registry port."""

    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        # not the session's daemon and registry (`make test` exports them): this env's own
        inherited = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "K3PIPE_REGISTRY")}
        self.env = {
            **inherited,
            "K3PIPE_HOME": str(home),
            "K3PIPE_REGISTRY_ADDR": self.addr,
            **env,
        }

    def popen(self, command: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(SCRIPT), command],
            env=self.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(SCRIPT), command],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def left_running(self) -> dict[int, str]:
        return _processes_under(self.home)

    def cleanup(self) -> None:
        """down, then end by pid whatever of ours is still alive (a failed test must not leak)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.run("down", timeout=60)
        for pid in self.left_running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def docker_env() -> Iterator[DockerEnv]:
    # a short path: containerd's socket under it must fit a unix socket's 108 bytes (pytest's
    # tmp_path does not; docker-env.sh refuses such a home, see test_a_home_too_long_is_refused)
    root = Path(tempfile.mkdtemp(prefix="k3de-", dir="/tmp"))
    env = DockerEnv(root / "home")
    try:
        yield env
    finally:
        env.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def _wrapper(path: Path, body: str) -> str:
    """An executable shell script standing in for a daemon's binary."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def _drop_page_cache() -> None:
    """Make the next start cold, where the kernel lets us (root on a VM); otherwise a no-op."""
    subprocess.run(["sync"], check=False)
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _assert_up(env: DockerEnv) -> None:
    assert httpx.get(f"http://{env.addr}/v2/", timeout=5, trust_env=False).status_code == 200
    info = subprocess.run(
        ["/usr/bin/docker", "-H", f"unix://{env.home}/docker/docker.sock", "info", "--format", "{{.ID}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert info.returncode == 0, info.stderr


def _assert_nothing_left(env: DockerEnv) -> None:
    left = env.left_running()
    assert not left, f"processes left running: {left}"
    assert not (env.home / "docker" / "dockerd.pid").exists()
    assert not (env.home / "registry" / "registry.pid").exists()


def test_cold_starts_come_up_and_go_down_cleanly(docker_env: DockerEnv, tmp_path: Path) -> None:
    """Several cold starts in a row, each from no daemons: plain, and with binaries that exec 1.5 s
    after the fork (what the first start on a fresh machine looked like: the registry's log said
    'listening' while `up` had already given up, because /proc/PID/comm still named setsid)."""
    slow_registry = _wrapper(tmp_path / "slow-registry", 'sleep 1.5; exec docker-registry "$@"')
    slow_dockerd = _wrapper(tmp_path / "slow-dockerd", 'sleep 1.5; exec dockerd "$@"')
    variants = [{}, {"K3PIPE_REGISTRY_BIN": slow_registry, "K3PIPE_DOCKERD_BIN": slow_dockerd}, {}]
    for i, extra in enumerate(variants):
        _drop_page_cache()
        docker_env.env.update(extra)
        for key in ("K3PIPE_REGISTRY_BIN", "K3PIPE_DOCKERD_BIN"):
            if key not in extra:
                docker_env.env.pop(key, None)
        up = docker_env.run("up")
        assert up.returncode == 0, f"start {i + 1}: {up.stderr}"
        assert "registry ready" in up.stderr
        assert "dockerd ready" in up.stderr
        _assert_up(docker_env)
        # a second `up` finds both running and starts nothing
        again = docker_env.run("up")
        assert again.returncode == 0, again.stderr
        assert "dockerd already running" in again.stderr
        assert "registry already running" in again.stderr
        down = docker_env.run("down")
        assert down.returncode == 0, down.stderr
        _assert_nothing_left(docker_env)


def test_up_that_fails_at_the_registry_stops_the_dockerd_it_started(docker_env: DockerEnv) -> None:
    """The registry's port is taken: `up` names the port, fails, and leaves no dockerd behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", docker_env.port))
        taken.listen()
        up = docker_env.run("up")
    assert up.returncode != 0
    assert f"{docker_env.addr} is already in use" in up.stderr
    assert "K3PIPE_REGISTRY_ADDR" in up.stderr  # what to do
    assert "dockerd ready" in up.stderr  # it had started dockerd ...
    assert "up failed: stopping what it started" in up.stderr  # ... and stopped it
    _assert_nothing_left(docker_env)


def test_up_that_fails_when_the_registry_exits_leaves_nothing(docker_env: DockerEnv, tmp_path: Path) -> None:
    docker_env.env["K3PIPE_REGISTRY_BIN"] = _wrapper(
        tmp_path / "dying-registry", 'echo "registry: cannot start" >&2; sleep 0.5; exit 1'
    )
    up = docker_env.run("up")
    assert up.returncode != 0
    assert "the registry exited during start-up" in up.stderr
    assert "registry: cannot start" in up.stderr  # the end of its log is shown
    _assert_nothing_left(docker_env)


def test_up_that_times_out_is_bounded_and_leaves_nothing(docker_env: DockerEnv, tmp_path: Path) -> None:
    """A registry that never answers: `up` gives up after the timeout it names, and stops it."""
    docker_env.env["K3PIPE_DOCKER_START_TIMEOUT_S"] = "3"
    # never execs the registry; its command line names the config under K3PIPE_HOME, so it is seen
    docker_env.env["K3PIPE_REGISTRY_BIN"] = _wrapper(
        tmp_path / "silent-registry", "exec python3 -c 'import time; time.sleep(600)' \"$@\""
    )
    t0 = time.monotonic()
    up = docker_env.run("up")
    elapsed = time.monotonic() - t0
    assert up.returncode != 0
    assert f"the registry did not answer on {docker_env.addr} within 3 s" in up.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s"
    _assert_nothing_left(docker_env)


def test_up_that_fails_at_dockerd_starts_no_registry(docker_env: DockerEnv) -> None:
    docker_env.env["K3PIPE_DOCKER_STORAGE_DRIVER"] = "no-such-driver"
    up = docker_env.run("up")
    assert up.returncode != 0
    assert "dockerd exited during start-up" in up.stderr
    assert "registry ready" not in up.stderr
    _assert_nothing_left(docker_env)


def test_interrupted_up_stops_what_it_started(docker_env: DockerEnv, tmp_path: Path) -> None:
    """SIGTERM while `up` waits for a slow registry: dockerd (already up) and the registry both go."""
    docker_env.env["K3PIPE_REGISTRY_BIN"] = _wrapper(
        tmp_path / "slow-registry", 'sleep 5; exec docker-registry "$@"'
    )
    proc = docker_env.popen("up")
    try:
        deadline = time.monotonic() + 60
        while not (docker_env.home / "registry" / "registry.pid").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "up never reached the registry"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr
    assert "up failed: stopping what it started" in stderr
    _assert_nothing_left(docker_env)


def test_make_docker_stops_the_daemons_when_the_image_build_fails(docker_env: DockerEnv) -> None:
    """`make docker`: the daemons come up, the base image build fails (its Debian mirror refuses),
    and the recipe stops both before it fails. The caller's DOCKER_HOST and K3PIPE_REGISTRY point at
    another daemon and registry (as inside `make test`): the build must use the ones `up` started
    (it once found the base image in the other daemon and passed)."""
    closed = free_port()  # nothing listens there: debootstrap fails at once
    env = {
        **docker_env.env,
        "K3PIPE_DEBIAN_MIRROR": f"http://127.0.0.1:{closed}/debian",
        "DOCKER_HOST": os.environ.get("DOCKER_HOST", "unix:///nonexistent/docker.sock"),
        "K3PIPE_REGISTRY": os.environ.get("K3PIPE_REGISTRY", "127.0.0.1:1"),
    }
    proc = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), "docker", f"K3PIPE_HOME={docker_env.home}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    assert "registry ready" in proc.stderr
    assert "debootstrap failed" in proc.stderr
    assert "stopping dockerd" in proc.stderr
    _assert_nothing_left(docker_env)


def test_a_home_too_long_for_containerd_is_refused(tmp_path: Path) -> None:
    """containerd's socket under a long K3PIPE_HOME exceeds a unix socket path's 108 bytes, and
    dockerd would time out after 20 s with a gRPC dial error: `up` says so at once instead."""
    env = DockerEnv(tmp_path / ("x" * 80) / "home")
    try:
        up = env.run("up", timeout=60)
        assert up.returncode != 0
        assert "too long for a unix socket" in up.stderr
        assert "K3PIPE_HOME" in up.stderr
        assert not env.left_running()
    finally:
        env.cleanup()


def test_a_package_removed_but_not_purged_is_installed_again(docker_env: DockerEnv, tmp_path: Path) -> None:
    """`apt-get remove docker.io` leaves 'deinstall ok config-files', which `dpkg -s` reports as
    present although dockerd is gone (a fresh user's first `make test` failed so). `up` asks apt
    for it. dpkg-query and apt-get are stand-ins here that say how the packages stand and record
    what was asked; dockerd is made to fail at once, so nothing is started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asked = tmp_path / "apt-get.calls"
    _wrapper(
        bin_dir / "dpkg-query",
        "for last; do :; done\n"
        'case $last in docker.io) printf "deinstall ok config-files" ;;\n'
        '  *) printf "install ok installed" ;;\nesac',
    )
    _wrapper(bin_dir / "apt-get", f'echo "$*" >> {asked}')
    docker_env.env["PATH"] = f"{bin_dir}:{docker_env.env['PATH']}"
    docker_env.env["K3PIPE_DOCKERD_BIN"] = "/bin/false"
    up = docker_env.run("up")
    assert up.returncode != 0  # dockerd "failed"
    calls = asked.read_text().splitlines()
    assert any(c.startswith("install") and c.split()[-1] == "docker.io" for c in calls), calls
    assert not any("docker-registry" in c or "debootstrap" in c for c in calls), calls
    assert "apt-get install docker.io" in up.stderr
    _assert_nothing_left(docker_env)
