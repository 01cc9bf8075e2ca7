"""Where the suite's CPU goes: a pytest plugin, off unless asked for, that writes one JSON line a test
(wall seconds, the worker's own CPU seconds, the CPU of the processes it started and waited for, and the
whole machine's busy CPU seconds over the test), so a slow phase can be told apart into its tests.

    PYTEST_ADDOPTS="-p tests.cpu_profile" K3PIPE_CPU_PROFILE=/tmp/tests.jsonl make test

The parallel phase is bound by the machine's two cores, so what shortens it is CPU taken out, not
waits: on 2026-12-07 this showed the pytest workers' own CPU a quarter of the measured total, a full
garbage collection before every workload (k3pipe/bench/client.py) and a TLS context made for every
HTTP client (k3pipe/core/http.py) much of it. Not counted there: servers a test did not start and wait for
(a session's Prefect or MLflow server, dockerd's containers), which the machine's busy seconds show.

Those are what the process sampler counts: the run's first process (the controller under xdist) reads
every process's CPU once a second and gives it to the test named by PYTEST_CURRENT_TEST in the
environment the process started with (pytest sets it while a test runs, and child processes inherit
it: a server started by a module's fixture counts to the test that first asked for it), by kind of
process (vLLM, Prefect server, MLflow server, flow run, k3pipe command...): every process on the
machine, so run nothing else beside it. At the end it writes
``K3PIPE_CPU_PROFILE`` + ``.procs.json``; ``python -m tests.cpu_profile FILE`` prints both as tables.
A process that lives less than a second is missed, and one's last second before it ends.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator, Sequence
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


# the process sampler (the docstring): kinds by command line, first match
_KINDS = (
    ("vllm", ("EngineCore", "vllm.entrypoints", "spawn_main")),
    ("prefect-server", ("prefect.server.api.server", "prefect server start")),
    ("mlflow-server", ("mlflow server", "mlflow.server", "uvicorn_log_config")),
    ("prefect-worker", ("prefect worker start",)),
    ("flow-supervisor", ("_workspace_supervisor",)),
    ("flow-run", ("prefect.engine",)),
    ("k3pipe", ("k3pipe.cli.main", "k3pipe.flows", "bin/k3pipe")),
    ("pytest-worker", ("execnet", "sys.stdin.readline")),
)


def _kind(cmdline: str) -> str:
    for kind, marks in _KINDS:
        if any(mark in cmdline for mark in marks):
            return kind
    head = cmdline.split(" ", 1)[0]
    return head.rsplit("/", 1)[-1] or "-"


class _Sampler:
    """Every process's CPU seconds, a second at a time, by (test, kind)."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.seen: dict[int, tuple[tuple[str, str], float]] = {}
        self.totals: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.stop = threading.Event()
        self.first = True
        self.thread = threading.Thread(target=self._loop, name="cpu-profile", daemon=True)

    def _cpu(self, pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / self.tick
        except (OSError, IndexError, ValueError):
            return None

    def _key(self, pid: int) -> tuple[str, str] | None:
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None
        test = "-"
        for entry in environ:
            if entry.startswith(b"PYTEST_CURRENT_TEST="):
                test = entry.split(b"=", 1)[1].decode(errors="replace").rsplit(" (", 1)[0]
        return test, _kind(cmdline)

    def sample(self) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            cpu = self._cpu(pid)
            if cpu is None:
                continue
            known = self.seen.get(pid)
            if known is None or cpu < known[1]:  # new, or the pid was reused
                key = self._key(pid)
                if key is None:
                    continue
                # what ran before the run began is not the run's
                self.totals[key] += 0.0 if self.first else cpu
            else:
                key = known[0]
                self.totals[key] += cpu - known[1]
            self.seen[pid] = (key, cpu)
        self.first = False

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            self.sample()

    def write(self, path: Path) -> None:
        rows = [{"test": t, "kind": k, "cpu": round(v, 2)} for (t, k), v in sorted(self.totals.items())]
        path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")


_SAMPLER: _Sampler | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _SAMPLER
    if os.environ.get("PYTEST_XDIST_WORKER") is None and sys.platform == "linux":
        _SAMPLER = _Sampler()
        _SAMPLER.sample()
        _SAMPLER.thread.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _SAMPLER is not None:
        _SAMPLER.stop.set()
        _SAMPLER.thread.join()
        _SAMPLER.sample()
        _SAMPLER.write(_OUT.with_name(_OUT.name + ".procs.json"))


def main(argv: Sequence[str]) -> None:
    """Print a profile's tables: CPU by module (the tests' own, then their processes' by kind)."""
    path = Path(argv[0]) if argv else _OUT
    own: dict[str, float] = collections.defaultdict(float)
    wall: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        module = row["id"].split("::", 1)[0]
        own[module] += row["self"]
        wall[module] += row["wall"]
    procs = path.with_name(path.name + ".procs.json")
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    if procs.exists():
        for row in json.loads(procs.read_text()):
            if row["kind"] != "pytest-worker":  # the tests' own CPU: counted above
                kinds[row["test"].split("::", 1)[0]][row["kind"]] += row["cpu"]
    total = {m: own[m] + sum(kinds[m].values()) for m in set(own) | set(kinds)}
    by_kind: dict[str, float] = collections.defaultdict(float)
    for counts in kinds.values():
        for kind, cpu in counts.items():
            by_kind[kind] += cpu
    print(
        f"{sum(total.values()):,.0f} CPU-s: tests' own {sum(own.values()):,.0f}, "
        + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    )
    print(f"{'CPU-s':>7} {'wall s':>7}  module (its processes' CPU-s by kind)")
    for module, cpu in sorted(total.items(), key=lambda kv: -kv[1])[:40]:
        top = sorted(kinds[module].items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in top)
        print(f"{cpu:7.0f} {wall[module]:7.0f}  {module}" + (f" ({parts})" if parts else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
