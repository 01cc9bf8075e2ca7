"""The measurement definitions of docs/measurement.md with the workload sent by two client processes
(sharded: its streams split between them, k3pipe/bench/shards.py). The tests are those of
tests/unit/bench/test_definitions.py, which runs them with one process: every ``test_`` function of
that module is collected here too, and this module's ``client_processes`` fixture gives them two."""

from __future__ import annotations

import pytest

from tests.unit.bench import test_definitions as definitions

pytestmark = pytest.mark.serial

globals().update({name: test for name, test in vars(definitions).items() if name.startswith("test_")})


@pytest.fixture(autouse=True, params=[2], ids=["2-processes"])
def client_processes(request: pytest.FixtureRequest) -> int:
    """Two client processes for :func:`tests.unit.bench.test_definitions.run` (each ~1 s to spawn on 2
    cores)."""
    definitions._PROCESSES[0] = request.param
    return int(request.param)
