"""Record a small study with today's k3pipe into a fresh MLflow store, and keep that store and its
report as a fixture (issue 48: the MLflow record is the contract every past study depends on; a
change to how k3pipe writes or reads it must still give the same report of a store written before).

The study: two arms against the scripted OpenAI server (k3pipe/testing/scripted_openai.py, vLLM's wire format)
through the external launcher, one answering each token 2 ms later than the other, each launched
twice, two workloads of two repeats, the baseline's A/A copy, and the output probe (the scripted
server answers it as vLLM's completions do). No engine starts; about 30 s.

    .venv/bin/python scripts/make_store_fixture.py tests/fixtures/stores/study-v1

writes ``store.tar.gz`` (mlflow.db and the artifacts, paths as recorded), ``report.md`` (the report
as k3pipe built it from that store) and ``store.json`` (the study's run id, the K3PIPE_HOME it was
recorded under, the k3pipe commit). tests/integration/test_store_layout.py rebuilds the report from
the unpacked store and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _not_the_report(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "/artifacts/report" in info.name else info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the fixture's folder")
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="k3pipe-store-"))
    os.environ["K3PIPE_HOME"] = str(home)
    for var in ("MLFLOW_TRACKING_URI", "K3PIPE_MLFLOW_TRACKING_URI"):
        os.environ.pop(var, None)

    import yaml

    from k3pipe.core.settings import Settings
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study
    from k3pipe.report import build_report
    from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI

    model = REPO / ".k3pipe" / "models" / "tiny-llama"
    if not (model / "config.json").is_file():
        sys.exit(f"no tiny model at {model}: make model")
    with (
        ScriptedOpenAI(Script(first_token_delay_s=0.02, inter_token_s=0.002), model="m", probe=True) as fast,
        ScriptedOpenAI(Script(first_token_delay_s=0.02, inter_token_s=0.004), model="m", probe=True) as slow,
    ):
        arms = [
            {"name": name, "launches": 2, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
             "endpoint": {"base_url": server.base_url, "model": "m"}}
            for name, server in (("fast", fast), ("slow", slow))
        ]  # fmt: skip
        experiment = {
            "name": "store-fixture",
            "description": "A small study recorded by scripts/make_store_fixture.py (issue 48).",
            "model": {"source": "local", "path": str(model)},
            "arms": arms,
            "workloads": [
                {
                    "name": "in64-out16",
                    "input_tokens": 64,
                    "output_tokens": 16,
                    "concurrency": 2,
                    "num_requests": 6,
                    "warmup_requests": 1,
                    "repeats": 2,
                    "seed": 1,
                },
                {
                    "name": "in256-out16",
                    "input_tokens": 256,
                    "output_tokens": 16,
                    "concurrency": 2,
                    "num_requests": 6,
                    "warmup_requests": 1,
                    "repeats": 2,
                    "seed": 11,
                },
            ],
            "decision": {"baseline": "slow", "calibration": True, "metrics": ["tpot_ms_p50", "ttft_ms_p50"]},
            "answers": {"prompts": 4, "prompt_tokens": 8, "output_tokens": 4, "continuation_tokens": 4},
        }
        exp = home / "store-fixture.yaml"
        exp.write_text(yaml.safe_dump(experiment))
        job = Job.library(Settings())
        result = study(RunRequest(experiment=str(exp)), job)
    bad = [a for a in result.arms if a.status != "FINISHED"]
    if bad:
        sys.exit(f"the study did not finish: {[(a.arm, a.error) for a in bad]}")
    report = build_report(job.tracker, result.study_run_id)
    (out / "report.md").write_text(report.markdown)
    with tarfile.open(out / "store.tar.gz", "w:gz") as tar:
        tar.add(home / "mlflow" / "mlflow.db", arcname="mlflow.db")
        # the report k3pipe attached to the study's run is left out: the test builds it again
        tar.add(home / "mlflow" / "artifacts", arcname="artifacts", filter=_not_the_report)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    store = {"study_run_id": result.study_run_id, "home": str(home), "commit": git.stdout.strip(),
             "experiment": experiment}  # fmt: skip
    (out / "store.json").write_text(json.dumps(store, indent=1) + "\n")
    print(f"store of study {result.study_run_id} in {out}: {(out / 'store.tar.gz').stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
