"""The compile cache a launch hands its engine, on a real process (a shell stands in for vLLM): the
unit tier (tests/unit/engines/test_compile_cache.py) starts no process."""

from __future__ import annotations

from pathlib import Path

from tests.unit.engines.test_compile_cache import experiment, plan


def test_launch_gives_the_engine_the_variable(tmp_path: Path) -> None:
    """launch_engine creates the directory and sets the variable (a shell stands in for vLLM)."""
    import time

    from k3pipe.core.settings import Settings
    from k3pipe.launchers.factory import launch_engine

    data = experiment()
    data["arms"][0]["engine"]["executable"] = ["/bin/sh", "-c", 'echo "cache=$VLLM_CACHE_ROOT"', "sh"]
    p = plan(data, home=tmp_path)
    assert p.compile_cache is not None
    log = tmp_path / "engine.log"
    launcher = launch_engine(p, log, Settings(), None)
    try:
        deadline = time.monotonic() + 10
        while launcher.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        launcher.stop()
    assert log.read_text().strip() == f"cache={p.compile_cache.dir}"
    assert Path(p.compile_cache.dir).is_dir()
