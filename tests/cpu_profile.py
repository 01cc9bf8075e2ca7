"""Where the suite's CPU goes: a pytest plugin, off unless asked for, that writes one JSON line a test
(wall seconds, the worker's own CPU seconds, the CPU of the processes it started and waited for, and the
whole machine's busy CPU seconds over the test), so a slow phase can be told apart into its tests.

    PYTEST_ADDOPTS="-p tests.cpu_profile" K3PIPE_CPU_PROFILE=/tmp/tests.jsonl make test

The parallel phase is bound by the machine's two cores, so what shortens it is CPU taken out, not
waits: on 2026-12-07 this showed the pytest workers' own CPU a quarter of the measured total, a full
garbage collection before every workload (k3pipe/bench/client.py) and a TLS context made for every
HTTP client (k3pipe/core/http.py) much of it. Not counted: servers a test did not start and wait for
(a session's Prefect or MLflow server, dockerd's containers), which the machine's busy seconds show.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_OUT = Path(os.environ.get("K3PIPE_CPU_PROFILE", "/tmp/k3pipe-cpu-profile.jsonl"))


def _busy() -> float:
    """The machine's busy CPU seconds so far (all cores: /proc/stat less idle and iowait)."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    t0, (own0, waited0), busy0 = time.monotonic(), _cpu(), _busy()
    yield
    t1, (own1, waited1), busy1 = time.monotonic(), _cpu(), _busy()
    line = {
        "id": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
        "start": t0,
        "wall": t1 - t0,
        "self": own1 - own0,
        "children": waited1 - waited0,
        "busy": busy1 - busy0,
    }
    with _OUT.open("a") as fh:  # one short append a test: the workers' lines do not interleave
        fh.write(json.dumps(line) + "\n")
