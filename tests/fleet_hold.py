"""A flow that holds a work pool's one slot until it is let go: a node busy with another study, for
tests/integration/test_fleet_prefect.py (deployed on a pool as ``hold/<pool>``). Prefect only, so that
its flow run starts in a second."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow


@flow(name="hold")
def hold(release: str, max_s: float = 300.0) -> None:
    """Run until the file ``release`` exists, or ``max_s`` has passed (a test that died lets go)."""
    deadline = time.monotonic() + max_s
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
