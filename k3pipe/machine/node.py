"""The node an arm runs on, for the record: its GPUs, driver and CUDA (from ``nvidia-smi``), how the
GPUs are connected (``nvidia-smi topo -m``) and the NCCL / symmetric-memory settings the engine gets
(``NCCL_*``, ``TORCH_NCCL_*``, ``TORCH_SYMM_MEM_*``: what decides NVLink multicast, the transports, the
rings), the engine interpreter's package versions, and the GPUs' memory and power draw sampled while a
workload runs (the energy a workload took: :func:`gpu_energy`, over the GPUs an arm holds where
they are known).

Without ``nvidia-smi`` on PATH (a CPU machine) nothing here is recorded and nothing fails:
:func:`probe_node` returns None, :func:`nvidia_smi_report` None and :class:`GpuMemorySampler`
samples nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.engines import get_engine

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "GpuEnergy",
    "GpuInfo",
    "GpuMemorySample",
    "GpuMemorySampler",
    "NodeInfo",
    "comm_env",
    "engine_python",
    "gpu_energy",
    "gpu_memory_frame",
    "gpus_here",
    "hardware_label",
    "interpreter_versions",
    "node_here",
    "nvidia_smi_report",
    "parse_cuda_version",
    "parse_gpu_query",
    "parse_memory_query",
    "parse_uuid_query",
    "probe_node",
]

NVIDIA_SMI = "nvidia-smi"
GPU_QUERY = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
MEMORY_QUERY = ["--query-gpu=memory.used,power.draw", "--format=csv,noheader"]
"""Each GPU's memory in use and its power draw (``1234 MiB, 312.45 W``; ``[N/A]`` where the board
does not report power)."""
UUID_QUERY = ["--query-gpu=index,uuid", "--format=csv,noheader"]
"""Each GPU's index and UUID (``0, GPU-8d2f...``): what a UUID in CUDA_VISIBLE_DEVICES is matched to."""
TOPOLOGY = ["topo", "-m"]
COMM_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_")
"""The environment that steers collective communication (NCCL_NVLS_ENABLE and
TORCH_SYMM_MEM_DISABLE_MULTICAST among them: NVLink multicast)."""
_TIMEOUT_S = 30.0


class GpuInfo(BaseModel):
    """One GPU as ``nvidia-smi --query-gpu=name,memory.total,driver_version`` lists it."""

    model_config = ConfigDict(frozen=True)

    index: int
    name: str
    memory_total_mib: int | None
    driver_version: str
    uuid: str | None = None


class NodeInfo(BaseModel):
    """The node under an arm: GPUs, driver, CUDA, and the versions in the engine's interpreter."""

    model_config = ConfigDict(frozen=True)

    gpus: list[GpuInfo]
    cuda_version: str | None = Field(description="The CUDA version nvidia-smi's header reports.")
    python: str | None = Field(default=None, description="The engine's interpreter (process arms).")
    packages: dict[str, str | None] = Field(
        default_factory=dict, description="Versions in the engine's interpreter ('python' included)."
    )
    nvidia_smi: str = Field(description="nvidia-smi's full output before launch.")
    topology: str | None = Field(
        default=None, description="``nvidia-smi topo -m`` before launch (None: it failed or is absent)."
    )
    comm_env: dict[str, str] = Field(
        default_factory=dict,
        description="The engine's NCCL_* / TORCH_NCCL_* / TORCH_SYMM_MEM_* environment (inherited or set).",
    )

    def describe(self) -> str:
        """One line for the flow's log."""
        p = self.params()
        text = f"{p.get('node.gpu_count')} x {p.get('node.gpu_name')} ({p.get('node.gpu_memory_mib')} MiB)"
        text += f", driver {p.get('node.driver_version')}, CUDA {self.cuda_version}"
        versions = ", ".join(f"{k} {v}" for k, v in self.packages.items())
        return text + (f"; engine interpreter {self.python}: {versions}" if versions else "")

    def params(self) -> dict[str, Any]:
        """MLflow params ``node.*``."""
        names = sorted({g.name for g in self.gpus})
        memory = sorted({g.memory_total_mib for g in self.gpus if g.memory_total_mib is not None})
        out: dict[str, Any] = {
            "node.gpu_name": ", ".join(names) or None,
            "node.gpu_count": len(self.gpus),
            "node.gpu_memory_mib": ", ".join(str(m) for m in memory) or None,
            "node.driver_version": self.gpus[0].driver_version if self.gpus else None,
            "node.cuda_version": self.cuda_version,
            "node.engine_python": self.python,
        }
        for name, version in self.packages.items():
            out[f"node.{name}_version"] = version
        return {k: v for k, v in out.items() if v is not None}


def hardware_label(params: Mapping[str, Any]) -> str | None:
    """'8 x NVIDIA H200, driver 580.159.04' from a run's ``node.*`` params (:meth:`NodeInfo.params`);
    None when no GPU was recorded."""
    name = params.get("node.gpu_name")
    if not name or name == "None":
        return None
    return f"{params.get('node.gpu_count', '?')} x {name}, driver {params.get('node.driver_version', '?')}"


def node_here() -> str:
    """This machine as restart noise and cold starts are kept for it (k3pipe.records.priors): its GPUs'
    label, else its host name."""
    import socket

    gpus = gpus_here()
    if gpus:
        label = hardware_label(NodeInfo(gpus=gpus, cuda_version=None, nvidia_smi="").params())
        if label:
            return label
    return f"host {socket.gethostname()}"


def gpus_here() -> list[GpuInfo]:
    """This machine's GPUs as nvidia-smi lists them (empty without nvidia-smi)."""
    return parse_gpu_query(_nvidia_smi(GPU_QUERY) or "")


def _nvidia_smi(args: Sequence[str] = ()) -> str | None:
    exe = shutil.which(NVIDIA_SMI)
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def comm_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The variables of ``env`` that steer NCCL and torch's symmetric memory, sorted by name."""
    return {k: str(v) for k, v in sorted((env or {}).items()) if k.startswith(COMM_ENV_PREFIXES)}


def nvidia_smi_report() -> str | None:
    """``nvidia-smi``'s full output (None: no nvidia-smi, or it failed)."""
    return _nvidia_smi()


_MIB = re.compile(r"^\s*(\d+)\s*MiB\s*$")


def _mib(text: str) -> int | None:
    match = _MIB.match(text)
    return int(match.group(1)) if match else None


_WATTS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*W\s*$")


def _watts(text: str) -> float | None:
    match = _WATTS.match(text)
    return float(match.group(1)) if match else None


def parse_memory_query(text: str) -> list[tuple[int, float | None]]:
    """The lines of ``nvidia-smi --query-gpu=memory.used,power.draw --format=csv,noheader``
    (``1234 MiB, 312.45 W``), one (MiB in use, watts or None) per GPU in index order; a line whose
    memory does not parse is skipped, a power of ``[N/A]`` is None."""
    out: list[tuple[int, float | None]] = []
    for line in text.splitlines():
        memory, _, power = line.partition(",")
        used = _mib(memory)
        if used is not None:
            out.append((used, _watts(power)))
    return out


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """The lines of ``nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader``
    (e.g. ``NVIDIA H200, 143771 MiB, 580.159.04``), one per GPU in index order."""
    out: list[GpuInfo] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) != 3 or not parts[0]:
            continue
        out.append(
            GpuInfo(index=len(out), name=parts[0], memory_total_mib=_mib(parts[1]), driver_version=parts[2])
        )
    return out


def parse_uuid_query(text: str) -> dict[int, str]:
    """The lines of ``nvidia-smi --query-gpu=index,uuid --format=csv,noheader`` (``0, GPU-8d2f...``):
    index -> UUID; a line that is not an index and a UUID is skipped."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        index, _, uuid = (p.strip() for p in line.partition(","))
        if index.isdigit() and uuid.startswith("GPU-"):
            out[int(index)] = uuid
    return out


_CUDA = re.compile(r"CUDA Version:\s*([\w.]+)")


def parse_cuda_version(report: str) -> str | None:
    """The CUDA version in nvidia-smi's header (``... CUDA Version: 13.0 |``)."""
    match = _CUDA.search(report)
    return match.group(1) if match else None


def engine_python(executable: str, path: str | None = None) -> str | None:
    """The Python interpreter behind an arm's executable: the executable itself when it is a python,
    else the interpreter its ``#!`` line names (entry-point scripts such as ``vllm``), else a
    ``python`` beside it. ``path`` is the PATH to look a bare name up in."""
    found = shutil.which(executable, path=path) if "/" not in executable else executable
    if found is None or not Path(found).is_file():
        return None
    exe = Path(found)
    if exe.name.startswith("python"):
        return str(exe)
    try:
        with exe.open("rb") as fh:
            first = fh.readline(512).decode(errors="replace")
    except OSError:
        first = ""
    if first.startswith("#!"):
        words = first[2:].split()
        if words and Path(words[0]).name == "env" and len(words) > 1:
            words = [shutil.which(words[1], path=path) or words[1], *words[2:]]
        if words and Path(words[0]).name.startswith("python") and Path(words[0]).is_file():
            return words[0]
    for name in ("python", "python3"):
        if (exe.parent / name).is_file():
            return str(exe.parent / name)
    return None


# Reads distribution metadata only: importing torch or vLLM would take seconds and touch the GPU.
_VERSIONS = """
import importlib.metadata as md, json, platform, sys
names = md.packages_distributions()
out = {"python": platform.python_version()}
for pkg in sys.argv[1:]:
    version = None
    for dist in [pkg, *names.get(pkg, [])]:
        try:
            version = md.version(dist)
            break
        except md.PackageNotFoundError:
            pass
    out[pkg] = version
print(json.dumps(out))
"""


def interpreter_versions(
    python: str, packages: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 60.0
) -> dict[str, str | None]:
    """``{'python': X.Y.Z, package: version or None}`` as ``python`` sees them ({} when it cannot run)."""
    try:
        done = subprocess.run(
            [python, "-c", _VERSIONS, *packages],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(env) if env is not None else None,
            check=False,
        )
        data = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}
    return {str(k): (str(v) if v is not None else None) for k, v in data.items()}


def probe_node(
    argv: Sequence[str],
    engine: str,
    env: Mapping[str, str] | None = None,
    *,
    interpreter: bool = False,
) -> NodeInfo | None:
    """This node's GPUs, driver and CUDA, their topology, the NCCL / symmetric-memory variables of
    ``env`` (the engine's environment), and (``interpreter``: the engine runs in a local interpreter)
    the torch and engine versions of the interpreter ``argv[0]`` runs in; None without nvidia-smi."""
    report = nvidia_smi_report()
    if report is None:
        return None
    uuids = parse_uuid_query(_nvidia_smi(UUID_QUERY) or "")
    listed = parse_gpu_query(_nvidia_smi(GPU_QUERY) or "")
    gpus = [g.model_copy(update={"uuid": uuids.get(g.index)}) for g in listed]
    python = None
    packages: dict[str, str | None] = {}
    if interpreter and argv:
        python = engine_python(argv[0], (env or {}).get("PATH"))
        wanted = ["torch", *([p] if (p := get_engine(engine).python_package) else [])]
        if python is not None:
            packages = interpreter_versions(python, wanted, env)
    return NodeInfo(
        gpus=gpus,
        cuda_version=parse_cuda_version(report),
        python=python,
        packages=packages,
        nvidia_smi=report,
        topology=_nvidia_smi(TOPOLOGY),
        comm_env=comm_env(env),
    )


@dataclass(frozen=True)
class GpuMemorySample:
    """GPU ``gpu``'s memory in use and power draw at ``t`` (``time.perf_counter()``)."""

    t: float
    gpu: int
    memory_used_mib: int
    power_w: float | None = None


class GpuMemorySampler:
    """Samples every GPU's memory in use and power draw every ``interval_s`` in a thread, while in
    its ``with`` block, and once more at its end (nothing when nvidia-smi is absent or ``enabled`` is
    false)."""

    def __init__(self, interval_s: float = 1.0, enabled: bool = True) -> None:
        self.interval_s = max(0.1, interval_s)
        self.enabled = enabled
        self.samples: list[GpuMemorySample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:
        t = time.perf_counter()
        text = _nvidia_smi(MEMORY_QUERY)
        if text is None:
            return
        for gpu, (used, watts) in enumerate(parse_memory_query(text)):
            self.samples.append(GpuMemorySample(t, gpu, used, watts))

    def _run(self) -> None:
        while True:
            self.sample_once()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> GpuMemorySampler:
        if self.enabled and shutil.which(NVIDIA_SMI) is not None:
            self._thread = threading.Thread(target=self._run, name="k3pipe-gpu-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_TIMEOUT_S + 5)
            self.sample_once()  # the state at the end of the window

    def max_used_mib(self) -> int | None:
        return max((s.memory_used_mib for s in self.samples), default=None)


def gpu_memory_frame(samples: Sequence[GpuMemorySample], t0: float) -> pd.DataFrame:
    """One row per sample: ``t_s`` (seconds from ``t0``, the workload's start), ``gpu``,
    ``memory_used_mib``, ``power_w`` (NaN where the board reported none)."""
    import pandas as pd  # the command line's start stays light (preflight asks for gpus_here)

    return pd.DataFrame(
        {
            "t_s": [s.t - t0 for s in samples],
            "gpu": [s.gpu for s in samples],
            "memory_used_mib": [s.memory_used_mib for s in samples],
            "power_w": [float("nan") if s.power_w is None else s.power_w for s in samples],
        }
    )


@dataclass(frozen=True)
class GpuEnergy:
    """The energy GPUs drew over a window, from their sampled power: the node's, or the GPUs an arm
    holds."""

    joules: float
    """Summed over the GPUs: each GPU's power, linear between samples and held flat before its first
    and after its last, integrated over the window."""
    mean_power_w: float
    """``joules`` over the window's length: the GPUs' mean draw together."""
    gpus: int
    samples: int
    """Power samples taken inside the window (of the GPUs counted)."""


def gpu_energy(
    samples: Sequence[GpuMemorySample],
    t_start: float,
    t_end: float,
    gpus: Collection[int] | None = None,
) -> GpuEnergy | None:
    """The energy over ``[t_start, t_end]`` of the GPUs whose index is in ``gpus`` (None: every
    sampled GPU, the node's), from their power samples (None: a window of no length, or none of
    those GPUs reported its power). The sampler reads every GPU; summing only an arm's leaves the
    idle boards beside it out of its energy."""
    if not t_end > t_start:
        return None
    by_gpu: dict[int, list[tuple[float, float]]] = {}
    for s in samples:
        if s.power_w is not None and (gpus is None or s.gpu in gpus):
            by_gpu.setdefault(s.gpu, []).append((s.t, s.power_w))
    if not by_gpu:
        return None
    joules = 0.0
    for points in by_gpu.values():
        points.sort()
        joules += _integral(points, t_start, t_end)
    inside = sum(1 for pts in by_gpu.values() for t, _ in pts if t_start <= t <= t_end)
    return GpuEnergy(joules, joules / (t_end - t_start), len(by_gpu), inside)


def _integral(points: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """The integral over [a, b] of the function linear between ``points`` (sorted by time) and
    flat beyond its ends."""
    import numpy as np

    ts = np.array([t for t, _ in points], dtype=float)
    ps = np.array([p for _, p in points], dtype=float)
    grid = np.concatenate(([a], ts[(ts > a) & (ts < b)], [b]))
    values = np.interp(grid, ts, ps)  # flat beyond the ends
    return float(np.sum(np.diff(grid) * (values[1:] + values[:-1]) / 2))
