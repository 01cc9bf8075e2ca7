"""The study's schedule from its spec: arms, the A/A copy, launches interleaved, the models each needs."""

from __future__ import annotations

from k3pipe.experiment.load import parse_experiment
from k3pipe.schema.schedule import (
    describe_study,
    interleaved_order,
    launch_order,
    prime_order,
    study_arm_names,
)


def test_interleaved_order_balances_drift() -> None:
    order = interleaved_order(["a", "b"], [3, 3])
    assert order == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    # a linear drift over the six slots: each arm's mean slot is the same after an even number of rounds
    four = interleaved_order(["a", "b"], [4, 4])
    slots = {arm: [i for i, (x, _) in enumerate(four) if x == arm] for arm in "ab"}
    assert sum(slots["a"]) == sum(slots["b"])
    assert interleaved_order(["a", "b", "c"], [1, 2, 1]) == [("a", 1), ("b", 1), ("c", 1), ("b", 2)]


def test_the_calibration_copy_runs_right_after_the_baseline_and_is_described() -> None:
    arm = {"engine": {"kind": "vllm", "executable": ["vllm"]}, "launches": 2}
    spec = parse_experiment(
        {
            "name": "exp",
            "model": {"source": "local", "path": "/nonexistent"},
            "arms": [{"name": "a", **arm}, {"name": "b", **arm}],
            "workloads": [{"name": "w", "input_tokens": 32, "output_tokens": 8}],
            "decision": {"calibration": True},
        }
    )
    names = study_arm_names(spec)
    assert names == ["a", "a-aa", "b"]
    assert launch_order(spec, names) == [("a", 1), ("a-aa", 1), ("b", 1), ("b", 2), ("a-aa", 2), ("a", 2)]
    text = "\n".join(describe_study(spec))
    assert "a-aa (A/A copy of the baseline)" in text
    assert "launch order: a#1 a-aa#1 b#1 b#2 a-aa#2 a#2" in text


def test_priming_launches_each_configuration_once_and_is_described() -> None:
    arm = {"engine": {"kind": "vllm", "executable": ["vllm"]}}
    doc = {
        "name": "exp",
        "model": {"source": "local", "path": "/nonexistent"},
        "arms": [{"name": "a", **arm}, {"name": "b", **arm}],
        "workloads": [{"name": "w", "input_tokens": 32, "output_tokens": 8}],
    }
    plain = parse_experiment({**doc, "decision": {"calibration": True}})
    assert prime_order(plain, study_arm_names(plain)) == []
    assert "fill the node's caches" not in "\n".join(describe_study(plain))
    spec = parse_experiment({**doc, "decision": {"calibration": True, "prime": True}})
    # the A/A copy is its baseline's configuration: primed once, as the baseline
    assert prime_order(spec, study_arm_names(spec)) == ["a", "b"]
    assert prime_order(spec, ["b"]) == ["b"]
    assert "first, each of a, b launched once to fill the node's caches" in "\n".join(describe_study(spec))


def test_the_plan_says_what_load_a_ladder_or_a_capacity_search_sends() -> None:
    """A ladder's points and a search's range and objectives, not the single load they replace (the
    plan printed "poisson at None req/s" for a capacity search)."""
    base = {"input_tokens": 32, "output_tokens": 8}
    spec = parse_experiment(
        {
            "name": "exp",
            "model": {"source": "local", "path": "/nonexistent"},
            "arms": [{"name": "a", "engine": {"kind": "vllm", "executable": ["vllm"]}}],
            "workloads": [
                {"name": "one", **base, "concurrency": 4},
                {"name": "steady", **base, "load": "constant", "rate_rps": 0.25, "concurrency": 8},
                {"name": "lad", **base, "ladder": {"points": [8, 1, 64]}},
                {
                    "name": "rates",
                    **base,
                    "load": "poisson",
                    "concurrency": 32,
                    "ladder": {"over": "rate", "start": 0.5, "stop": 2, "stop_when_saturated": False},
                },
                {
                    "name": "cap",
                    **base,
                    "load": "poisson",
                    "concurrency": 256,
                    "duration_s": 10,
                    "slo": {"ttft_ms": 500, "tpot_ms": 25},
                    "capacity": {"low": 0.1, "high": 400, "max_probes": 6},
                },
            ],
        }
    )
    lines = {line.split(":")[0].split()[-1]: line for line in describe_study(spec) if "workload " in line}
    assert ", 4 streams," in lines["one"]
    assert "constant at 0.25 req/s (at most 8 in flight)" in lines["steady"]
    assert "a concurrency ladder of 1, 8, 64 streams, ended past saturation (gain under 5%)" in lines["lad"]
    assert "a poisson rate ladder of 0.5, 1, 2 req/s (at most 32 in flight)," in lines["rates"]
    assert (
        "the highest poisson rate in 0.1-400 req/s meeting TTFT <= 500 ms, TPOT <= 25 ms for 90% of "
        "requests (at most 6 probes, at most 256 in flight)" in lines["cap"]
    )
    assert "requests or 10 s (+" in lines["cap"]
    assert "None" not in "\n".join(lines.values())
