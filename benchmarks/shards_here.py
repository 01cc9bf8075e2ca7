"""k3pipe's client at 1000 streams in one process and sharded over several, beside ``vllm bench serve``.

The exact server (k3pipe/testing/exact_server.py) runs pinned to the last CPU under SCHED_FIFO, as in
benchmarks/client_vs_peers.py, with that script's 1000-stream point (TTFT 20 ms + U[0, 50) ms, gap
50 ms, 16 tokens: 20,000 token events/s nominal). Each layout is run ``--rounds`` times in turn:

- ``k3pipe``: one client process on CPU 0 (what the flow runs with ``client.processes: 1``);
- ``k3pipe xN``: N client processes (``k3pipe.bench.shards.run_sharded``), process k on CPU k mod
  the machine's CPUs (on 2 CPUs the second shares the server's);
- ``vllm bench serve`` on CPU 0 (``--peer``; needs the engine venv).

Errors are against the script (truth), split as in client_vs_peers.py: delivery (server write ->
client stamp) and the server's own lateness. Usage:
``.venv/bin/python benchmarks/shards_here.py [--processes 2] [--rounds 2] [--peer]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client_vs_peers as bench  # beside this script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--processes", type=int, default=2, help="client processes of the sharded run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each layout, in turn")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--peer", action="store_true", help=f"also run {bench.PEER} (engine venv)")
    parser.add_argument("--log", default=str(bench.HOME / "bench" / "shards_here.log"))
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, realtime = cpus[-1], 10
    layouts: list[tuple[str, int, list[list[int]] | None]] = [
        ("k3pipe", 1, None),
        (f"k3pipe x{args.processes}", args.processes, [[cpus[k % len(cpus)]] for k in range(args.processes)]),
    ]
    point = bench.FULL.point(f"level{args.streams}", args.streams, bench.FULL.level_shape, 400)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with (
        open(args.log, "w") as log,
        bench.ExactServer(server_cpu, realtime, log) as server,
        bench.Peer(bench.ENGINE_PYTHON, cpus[0], log) if args.peer else _Nothing() as peer,
    ):
        for _ in range(args.rounds):
            for name, processes, process_cpus in layouts:
                server.set_script(point.shape)
                server.reset()
                run = bench.run_k3pipe(
                    point, server, cpus[0], realtime, bench.MODEL_DIR, log, (), processes, process_cpus
                )
                rows.append(_row(name, run, server))
                print(_line(rows[-1]), flush=True)
            if peer is not None:
                server.set_script(point.shape)
                server.reset()
                rows.append(_row(bench.PEER, peer.run(point, server, bench.MODEL_DIR, realtime), server))
                print(_line(rows[-1]), flush=True)
    print()
    head = ["client", "TTFT err p99 (ms)", "ITL err p99 (ms)", "delivery p99 (ms)", "server late p99 (ms)"]
    print("| " + " | ".join([*head, "client CPU (s)", "failed"]) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['client']} | {r['ttft']:.1f} | {r['itl']:.1f} | {r['delivery']:.1f} | {r['late']:.1f} "
            f"| {r['cpu']} | {r['failed']} |"
        )
    return 0


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _row(name: str, run: bench.ClientRun, server: bench.ExactServer) -> dict[str, object]:
    ev = bench.evaluate(run, server.records())

    def p99(key: str) -> float:
        value = ev[key]["p99"]
        return float("nan") if value is None else float(value)

    return {
        "client": name,
        "ttft": p99("ttft_err_ms"),
        "itl": p99("itl_err_ms"),
        "delivery": p99("delivery_ms"),
        "late": p99("server_late_ms"),
        "cpu": "-" if run.cpu_s is None else f"{run.cpu_s:.2f}",
        "failed": run.failed,
    }


def _line(r: dict[str, object]) -> str:
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())


if __name__ == "__main__":
    sys.exit(main())
