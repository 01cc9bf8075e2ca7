"""The process launcher on real processes: its own group, log file, fail-fast, bounded stop."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from k3pipe.bench.health import wait_until_healthy
from k3pipe.core.errors import LaunchError
from k3pipe.launchers.external import ExternalLauncher
from k3pipe.launchers.process import ProcessLauncher

# A stand-in engine: prints, starts a child in its group, optionally ignores SIGTERM, then sleeps.
ENGINE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if "--ignore-term" in sys.argv else "")
        + "time.sleep(600)"])
    print("engine up, child", child.pid, flush=True)
    if "--exit" in sys.argv:
        print("boom: cannot allocate KV cache", flush=True)
        sys.exit(3)
    time.sleep(600)
    """
)


def _launcher(tmp_path: Path, *flags: str, stop_timeout_s: float = 5.0) -> ProcessLauncher:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    return ProcessLauncher(
        [sys.executable, str(script), *flags],
        dict(os.environ),
        tmp_path / "logs" / "engine.log",
        stop_timeout_s=stop_timeout_s,
    )


def _wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _child_pid(launcher: ProcessLauncher) -> int:
    _wait_for(lambda: "child" in launcher.log_tail())
    return int(launcher.log_tail().split("child")[1].split()[0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone for our purposes when its state is Z
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_own_group_log_and_stop(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    launcher.start()
    try:
        assert launcher.pid is not None
        assert os.getpgid(launcher.pid) == launcher.pid  # its own process group
        assert os.getpgid(launcher.pid) != os.getpgid(0)
        child = _child_pid(launcher)
        assert launcher.alive()
    finally:
        launcher.stop()
    assert not launcher.alive()
    _wait_for(lambda: _gone(child), 5)
    assert "engine up" in (tmp_path / "logs" / "engine.log").read_text()
    launcher.stop()  # a second stop is harmless


def test_sigkill_after_grace_period(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, "--ignore-term", stop_timeout_s=1.0)
    launcher.start()
    child = _child_pid(launcher)
    t0 = time.monotonic()
    launcher.stop()
    assert time.monotonic() - t0 < 8
    assert launcher.exit_code() == -9
    _wait_for(lambda: _gone(child), 5)


def test_fail_fast_with_log_tail(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, "--exit")
    launcher.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(LaunchError) as info:
            wait_until_healthy("http://127.0.0.1:9/health", launcher, timeout_s=120, poll_s=0.1)
        assert time.monotonic() - t0 < 30  # did not wait for the timeout
        assert "exited with code 3" in str(info.value)
        assert "boom: cannot allocate KV cache" in str(info.value)
    finally:
        launcher.stop()


def test_timeout_names_the_setting(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    launcher.start()
    try:
        with pytest.raises(LaunchError) as info:
            wait_until_healthy("http://127.0.0.1:9/health", launcher, timeout_s=0.5, poll_s=0.1)
        assert "startup_timeout_s" in str(info.value)
        assert "engine up" in str(info.value)
    finally:
        launcher.stop()


def test_missing_executable(tmp_path: Path) -> None:
    launcher = ProcessLauncher([str(tmp_path / "no-such-python")], {}, tmp_path / "e.log")
    with pytest.raises(LaunchError, match=r"engine\.executable"):
        launcher.start()
    launcher.stop()


def test_stop_before_start_and_external() -> None:
    ProcessLauncher(["true"], {}, Path("/nonexistent/log")).stop()
    ext = ExternalLauncher()
    ext.start()
    assert ext.alive()
    ext.stop()


def test_launcher_cpus_pin_the_engine_and_every_process_it_starts(tmp_path: Path) -> None:
    """launcher.cpus: the engine runs under taskset on those CPUs, and so does the child it starts."""
    from k3pipe.schema.launcher_specs import ProcessLauncherSpec

    cpu = sorted(os.sched_getaffinity(0))[-1]
    spec = ProcessLauncherSpec(cpus=str(cpu))
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    launcher = ProcessLauncher(
        spec.pinned([sys.executable, str(script)]),
        dict(os.environ),
        tmp_path / "engine.log",
        stop_timeout_s=5,
    )
    launcher.start()
    try:
        child = _child_pid(launcher)
        engine = launcher.pid
        assert engine is not None
        for pid in (engine, child):
            assert os.sched_getaffinity(pid) == {cpu}
    finally:
        launcher.stop()
