"""What a cell costs: the energy the node's GPUs drew per output token (their power sampled beside the
workload, :func:`k3pipe.node.gpu_energy`) and, with a GPU-hour price in the experiment's
``hardware:``, dollars per million tokens.

Both are of the node, not of the requests alone: the energy is every GPU's draw over the measured
window (idle GPUs and idle moments included), the dollars are ``gpu_count`` GPUs rented for that
window. A cell that keeps the node busier costs less per token, which is the comparison a team
buying capacity makes.
"""

from __future__ import annotations

from collections.abc import Mapping

from k3pipe.node import GpuEnergy
from k3pipe.specs import HardwareSpec

__all__ = ["COST_METRICS", "ENERGY_METRICS", "cell_cost", "energy_metrics"]

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
    """``gpu_energy_j`` (all GPUs over the measured window), ``gpu_power_w_mean`` (their draw
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


def cell_cost(metrics: Mapping[str, float], hardware: HardwareSpec | None) -> dict[str, float]:
    """``cell_usd`` (``gpu_count`` GPUs at ``gpu_hour_usd`` for the measured window,
    ``duration_s``), ``usd_per_m_output_tokens`` and ``usd_per_m_tokens`` (input and output): the
    window's cost over its tokens. Nothing without a price or a window; no per-token figure
    without tokens."""
    if hardware is None or hardware.gpu_hour_usd is None:
        return {}
    duration = metrics.get("duration_s") or 0.0
    if duration <= 0:
        return {}
    usd = hardware.gpu_hour_usd * hardware.gpu_count * duration / 3600.0
    out = {"cell_usd": usd}
    output = metrics.get("output_tokens_total") or 0.0
    if output > 0:
        out["usd_per_m_output_tokens"] = usd / output * 1e6
        out["usd_per_m_tokens"] = usd / (output + (_input_tokens(metrics) or 0.0)) * 1e6
    return out
