"""What a cell costs: the energy the arm's GPUs drew per output token (their power sampled beside the
workload, :func:`k3pipe.machine.node.gpu_energy`) and, with a GPU-hour price in the experiment's
``hardware:``, dollars per million tokens.

Both count the GPUs the arm's engine holds (:meth:`k3pipe.planning.plan.ArmPlan.gpus`), not every board of
the node: a one-GPU arm on an eight-GPU node is charged one GPU, and its energy sums that GPU's power
alone where the launch names the device (``CUDA_VISIBLE_DEVICES``, the engine's device arguments,
the launcher's GPUs). Where only a count is known (the engine's parallel size) the dollars take the
count and the energy stays the node's, said so; where nothing is known, both are the node's (the
experiment's ``gpu_count``). Over those GPUs they are the measured window's (idle moments included):
a cell that keeps its GPUs busier costs less per token, which is the comparison a team buying
capacity makes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from k3pipe.machine.node import GpuEnergy
from k3pipe.schema.specs import HardwareSpec

__all__ = ["COST_METRICS", "ENERGY_METRICS", "cell_cost", "counted_label", "energy_metrics"]

ENERGY_METRICS = (
    "gpu_energy_j",
    "gpu_power_w_mean",
    "gpu_power_samples",
    "energy_j_per_output_token",
    "energy_j_per_token",
)
COST_METRICS = ("cell_usd", "usd_per_m_output_tokens", "usd_per_m_tokens")


def _input_tokens(metrics: Mapping[str, float]) -> float | None:
    # the engine's count (chat template included) is what it processed; the client's otherwise
    server = metrics.get("server_input_tokens_total")
    return server if server is not None else metrics.get("input_tokens_total")


def energy_metrics(energy: GpuEnergy | None, metrics: Mapping[str, float]) -> dict[str, float]:
    """``gpu_energy_j`` (the GPUs counted, over the measured window), ``gpu_power_w_mean`` (their draw
    together), ``gpu_power_samples``, and per token: ``energy_j_per_output_token`` and
    ``energy_j_per_token`` (input and output). Nothing without power samples; no per-token figure
    without tokens."""
    if energy is None:
        return {}
    out = {
        "gpu_energy_j": energy.joules,
        "gpu_power_w_mean": energy.mean_power_w,
        "gpu_power_samples": float(energy.samples),
    }
    output = metrics.get("output_tokens_total") or 0.0
    if output > 0:
        out["energy_j_per_output_token"] = energy.joules / output
        out["energy_j_per_token"] = energy.joules / (output + (_input_tokens(metrics) or 0.0))
    return out


def cell_cost(
    metrics: Mapping[str, float], hardware: HardwareSpec | None, gpus: int | None = None
) -> dict[str, float]:
    """``cell_usd`` (``gpus``, the arm's GPU count, else the experiment's ``gpu_count``, at
    ``gpu_hour_usd`` for the measured window, ``duration_s``), ``usd_per_m_output_tokens`` and
    ``usd_per_m_tokens`` (input and output): the window's cost over its tokens. Nothing without a
    price, a window or a GPU (an engine that holds none: a dollar figure of 0 would read as free);
    no per-token figure without tokens."""
    if hardware is None or hardware.gpu_hour_usd is None:
        return {}
    duration = metrics.get("duration_s") or 0.0
    count = hardware.gpu_count if gpus is None else gpus
    if duration <= 0 or count <= 0:
        return {}
    usd = hardware.gpu_hour_usd * count * duration / 3600.0
    out = {"cell_usd": usd}
    output = metrics.get("output_tokens_total") or 0.0
    if output > 0:
        out["usd_per_m_output_tokens"] = usd / output * 1e6
        out["usd_per_m_tokens"] = usd / (output + (_input_tokens(metrics) or 0.0)) * 1e6
    return out


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def counted_label(
    count: int | None,
    counted: Sequence[int] | None,
    basis: str | None,
    node_gpus: int | None,
    fallback: int | None = None,
) -> str:
    """What an arm's per-GPU and energy figures count, in a few words: 'GPUs 0,1 of 8' (its devices,
    their energy alone), '2 GPUs by parallel size (energy node-wide: 8 GPUs)' (a count only),
    'node-wide: 8 GPUs' (nothing known: ``node_gpus``, nvidia-smi's, else ``fallback``, the
    experiment's ``gpu_count``). ``count``, ``counted`` and ``basis`` as the arm's run records them
    (``gpus.*``)."""
    node = node_gpus or fallback
    if count is None or basis in (None, "node-wide"):
        return f"node-wide: {_gpus(node)}" if node else "node-wide (GPU count unknown)"
    if count == 0:
        return f"no GPU (by {basis})"
    if counted is not None:
        listed = ",".join(map(str, counted))
        one = "GPU" if len(counted) == 1 else "GPUs"
        return f"{one} {listed} of {node_gpus}" if node_gpus else f"{one} {listed}"
    energy = f"energy node-wide: {_gpus(node)}" if node else "energy node-wide"
    return f"{_gpus(count)} by {basis} ({energy})"
