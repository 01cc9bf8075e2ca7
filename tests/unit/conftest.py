"""The unit tier's own: preflight's port probe answers "free" (what a port of this machine is doing
is not a unit's to know; tests/unit/engines/test_preflight.py probes a real socket on purpose)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _ports_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("k3pipe.experiment.preflight.port_taken", lambda host, port: False)
