"""The study's schedule from its spec: arms, the A/A copy, launches interleaved, the models each needs."""

from __future__ import annotations

from k3pipe.experiment import parse_experiment
from k3pipe.schedule import describe_study, interleaved_order, launch_order, prime_order, study_arm_names


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
