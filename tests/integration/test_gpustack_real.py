"""The ``gpustack`` launcher against the real GPUStack 2.3.0 server (PyPI, ``make gpustack``), started
in a network namespace of its own (tests/gpustack_real.py says why and how). What the real server
decides is asserted here: its auth, the custom backend, a deployment stored only with a cluster, the
scheduler's reason while no worker can take it, the gateway's 503 for a deployment not serving, and
the deletion. That the deployment serves and is benchmarked is tests/integration/test_gpustack.py's,
against the stand-in: the real worker needs GPUs (or ``cpu_offloading``) and a container runtime."""

from __future__ import annotations

import os

import pytest

from tests.conftest import ASSETS_HOME, TINY_MODEL
from tests.gpustack_real import check, gpustack_venv


@pytest.mark.skipif(
    os.geteuid() != 0, reason="a network namespace of its own needs root (make test runs as root)"
)
def test_the_launcher_deploys_and_deletes_on_the_real_gpustack_server() -> None:
    venv = gpustack_venv(ASSETS_HOME)
    if not (venv / ".installed").exists():
        pytest.fail(f"the real GPUStack is missing: {venv}; `make test` (or `make gpustack`) installs it")
    result = check(ASSETS_HOME, TINY_MODEL, wait_s=8.0)

    assert (result["login"], result["api_key"], result["unauthorized"]) == (200, 200, 401)
    # the server alone has no cluster until one is made: the launcher finds it (without a cluster the
    # real server answers 500 to the deployment)
    status, cluster = result["cluster"]
    assert status == 200
    assert result["model"]["cluster_id"] == cluster, result
    assert result["model"]["source"] == "local_path"
    assert (result["model"]["backend"], result["model"]["backend_version"]) == ("k3pipe-vllm-custom", "v1")
    assert result["backend_versions"] == ["v1"]  # a custom backend's version needs no -custom
    # no worker: the instance waits, and the progress line says why, in the scheduler's words
    assert result["ready"] is False
    name = f"gpustack: instance {result['model']['name']}-"
    pending = [line for line in result["progress"] if line.startswith(name) and " PENDING" in line]
    assert pending, result["progress"]
    assert pending[-1].endswith(" PENDING: No available workers"), result["progress"]
    # the route is there, nothing serves it: 503, not 404
    assert result["chat_while_pending"][0] == 503, result["chat_while_pending"]
    assert result["chat_while_pending"][1]["message"] == "No running instances available"
    # deleted, and confirmed gone
    assert result["after_delete"] == [404, "Model not found"]
    assert result["left_behind"] is None
