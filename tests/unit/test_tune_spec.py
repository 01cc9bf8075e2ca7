"""`tune:` in the experiment (issue 50, item 1; k3pipe/schema/tune.py): the search space of one arm's
engine settings, its constraints, objective and budget, read and checked where the experiment is
parsed; the candidates are the arm with each combination's settings."""

from __future__ import annotations

from typing import Any

import pytest

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import parse_experiment

BASE: dict[str, Any] = {
    "name": "tune-e",
    "model": {"source": "local", "path": "/m"},
    "arms": [
        {"name": "vllm", "engine": {"kind": "vllm", "executable": ["vllm", "serve"],
                                    "args": {"max_model_len": 4096, "max_num_seqs": 8}, "env": {"A": "1"}},
         "launcher": {"kind": "process", "port": 8000}},
    ],
    "workloads": [
        {"name": "w", "input_tokens": 256, "output_tokens": 32, "concurrency": 8, "num_requests": 32}
    ],
}  # fmt: skip

TUNE: dict[str, Any] = {
    "arm": "vllm",
    "args": {"max_num_seqs": [8, 16, 32], "max_num_batched_tokens": [16, 2048, 8192]},
    "env": {"VLLM_CPU_OMP_THREADS_BIND": ["auto", "nobind"]},
    "where": ["max_num_batched_tokens >= max_num_seqs", "max_num_seqs <= 16"],
    "objective": {"metric": "output_throughput_tps", "workload": "w"},
}


def test_the_candidates_are_the_arm_with_each_combination_that_meets_the_constraints() -> None:
    spec = parse_experiment({**BASE, "tune": TUNE}, "e.yaml")
    assert spec.tune is not None
    candidates = spec.tune.candidates(spec.arms[0])
    # max_num_seqs 32 fails 'max_num_seqs <= 16'; every other pair meets the first rule (16 >= 16)
    assert len(candidates) == 2 * 3 * 2
    narrow = parse_experiment(
        {**BASE, "tune": {**TUNE, "where": ["max_num_batched_tokens > max_num_seqs"]}}, "e"
    )
    assert narrow.tune is not None
    assert len(narrow.tune.grid()) == (3 * 3 - 2) * 2  # (16 tokens, 16 seqs) and (16, 32) fail
    settings = [c.settings for c in candidates]
    assert all(s["max_num_batched_tokens"] >= s["max_num_seqs"] for s in settings)
    assert all(s["max_num_seqs"] <= 16 for s in settings)
    first = candidates[0]
    assert first.name == "vllm.t01"
    assert first.arm.name == "vllm.t01"
    assert first.arm.launches == 2  # the budget's first launches
    # the arm's own args and env stay, the candidate's settings replace theirs
    assert first.arm.engine.args == {"max_model_len": 4096, "max_num_seqs": 8, "max_num_batched_tokens": 16}
    assert first.arm.engine.env == {"A": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    assert first.label == "max_num_seqs=8 max_num_batched_tokens=16 env.VLLM_CPU_OMP_THREADS_BIND=auto"
    assert spec.arms[0].engine.args["max_num_seqs"] == 8  # the experiment's arm is untouched
    assert len({c.name for c in candidates}) == len(candidates)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"arm": "sglang"}, "tune.arm 'sglang' is not an arm of the experiment; its arms: vllm"),
        ({"objective": {"metric": "output_throughput_tps", "workload": "x"}},
         "tune.objective.workload 'x' is not a workload of the experiment; its workloads: w"),
        ({"objective": {"metric": "speed", "workload": "w"}},
         "tune.objective.metric 'speed' is not a figure"),
        ({"where": ["max_num_seqs =< 8"]}, "where: 'max_num_seqs =< 8' is not a constraint k3pipe reads"),
        ({"where": ["block_size >= 16"]}, "names 'block_size', which tune.args does not vary"),
        ({"args": {"max_num_seqs": []}, "env": {}}, "max_num_seqs: give at least one value"),
        ({"args": {"max_num_seqs": [8, 8]}, "env": {}}, "max_num_seqs: a value is listed twice"),
        ({"args": {}, "env": {}, "where": []}, "give the settings to search in args or env"),
        ({"args": {"max_num_seqs": [8]}, "env": {}, "where": []}, "1 candidate(s) meet the constraints"),
        ({"args": {"a": list(range(9)), "b": list(range(8))}, "env": {}, "where": []},
         "72 candidates, more than 64"),
        ({"budget": {"first_launches": 4, "max_launches": 3}}, "budget.max_launches=3 is below"),
        ({"budget": {"first_launches": 1}}, "first_launches"),
        ({"budget": {"device_minutes": 0}}, "budget.device_minutes"),
        ({"budget": {"device_minutes": "2h"}}, "budget.device_minutes"),
    ],
)  # fmt: skip
def test_a_bad_search_is_refused_naming_the_field(change: dict[str, Any], expected: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_experiment({**BASE, "tune": {**TUNE, **change}}, "e.yaml")
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"decision": {"calibration": True}}, "decision.calibration"),
        ({"decision": {"until": {"ci_pct": 5, "max_launches": 4}}}, "decision.until"),
        ({"variants": [{"name": "v", "arms": {"vllm": {"args": {"max_num_seqs": 4}}}}]}, "variants"),
    ],
)
def test_a_search_refuses_the_designs_it_replaces(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=f"tune with {field}: a search races its candidates by its own rules"):
        parse_experiment({**BASE, **extra, "tune": TUNE}, "e.yaml")


def test_a_search_over_a_fleet_runs_each_candidate_on_its_arms_pools() -> None:
    fleet = {"pools": ["node-a", "node-b", "node-c"], "arms": {"vllm": ["node-a", "node-b"]}}
    spec = parse_experiment({**BASE, "fleet": fleet, "tune": TUNE}, "e.yaml")
    assert spec.fleet is not None
    names = [c.name for c in spec.tune_candidates()]
    assert {spec.searched(n) for n in names} == {"vllm"}
    assert spec.fleet.pools_of(spec.searched(names[0])) == ["node-a", "node-b"]
    assert spec.searched("vllm.t99") == "vllm.t99"  # no such candidate: itself
    assert spec.searched("vllm") == "vllm"


def test_render_states_the_device_time_budget() -> None:
    from k3pipe.schema.schedule import describe_study

    budget = {"first_launches": 2, "max_launches": 6, "device_minutes": 90}
    spec = parse_experiment({**BASE, "tune": {**TUNE, "budget": budget}}, "e.yaml")
    (line,) = [ln for ln in describe_study(spec) if "a search over arm vllm's settings" in ln]
    assert line.endswith("at most 6 each (72 in all), and no round past 90 min of device time")
    plain = parse_experiment({**BASE, "tune": TUNE}, "e.yaml")
    (line,) = [ln for ln in describe_study(plain) if "a search over arm vllm's settings" in ln]
    assert line.endswith("at most 8 each (96 in all)")


def test_the_gpu_record_check_expects_each_candidates_first_round() -> None:
    """scripts/check_gpu_record.py on a search's record: the candidates' arm runs (ARM.tNN, each with its
    settings), each launched budget.first_launches times at least; not the searched arm by its own name."""
    import importlib.util
    import sys

    import yaml

    from tests.conftest import REPO

    path = REPO / "scripts" / "check_gpu_record.py"
    spec = importlib.util.spec_from_file_location("check_gpu_record", path)
    assert spec is not None
    assert spec.loader is not None
    checker = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = checker  # its dataclasses look their module up
    spec.loader.exec_module(checker)
    experiment = yaml.safe_load((REPO / "experiments" / "tune-h100.yaml").read_text())
    arms = checker.study_arms(experiment)
    assert [(a["name"], a["engine"]["args"]["max_num_seqs"], n) for a, n in arms] == [
        ("vllm.t01", 64, 2), ("vllm.t02", 128, 2)
    ]  # fmt: skip
    assert all(a["engine"]["args"]["max_num_batched_tokens"] == 8192 for a, _ in arms)
