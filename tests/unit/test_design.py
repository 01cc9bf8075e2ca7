"""What a study's design costs and can see, said before it runs (k3pipe.records.design), from an
experiment and
a node's history whose figures are known."""

from __future__ import annotations

import math

from k3pipe.experiment.load import parse_experiment
from k3pipe.records.design import History, design_lines
from k3pipe.records.priors import NoiseEntry
from k3pipe.verdicts import stats


def _spec(launches: int | None = None, arms: int = 2) -> object:
    arm = {"engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
           "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}  # fmt: skip
    return parse_experiment(
        {
            "name": "d",
            "model": {"source": "modelscope", "id": "org/model", "revision": "v1"},
            "arms": [
                {**arm, "name": f"a{i}", **({"launches": launches} if launches else {})} for i in range(arms)
            ],
            "workloads": [{"name": "w", "input_tokens": 64, "output_tokens": 8, "repeats": 3}],
        },
        "test",
    )


def test_the_design_alone_says_launches_cold_starts_and_comparisons() -> None:
    lines = design_lines(_spec())  # type: ignore[arg-type]
    assert lines[0] == (
        "design: 2 arm(s), 2 launch(es) each (interleaved): 4 cold start(s); each launch runs 1 "
        "workload(s) x 3 repeat(s)"
    )
    assert (
        lines[1]
        == "verdicts: 3 decision figure(s) x 1 pair(s) x 1 workload(s) = 3 comparison(s) sharing alpha 0.05"
    )
    once = design_lines(_spec(launches=1))  # type: ignore[arg-type]
    assert any(line.startswith("launched once: a0, a1: judged only with restart noise") for line in once)


def test_with_the_node_history_it_says_the_cost_and_what_it_can_see() -> None:
    """Cold starts of 60, 64 and 70 s and launches of 120-140 s recorded here; restart noise 4% and
    repeat noise 6% kept by two studies: the lines give the medians and the smallest difference a
    2 x 3 pair finds at 80% power, as k3pipe.verdicts.stats computes it."""
    between, within = math.log1p(0.04**2), math.log1p(0.06**2)
    entries = [
        NoiseEntry(
            key="k", label="", engine="vllm", model="org/model", node="1 x GPU",
            metric="output_throughput_tps", arm="a", workload="w", ss=(between + within / 3) * 3, df=3,
            repeats=[3] * 4, ss_within=within * 8, df_within=8, study_run_id=str(i),
        )
        for i in range(2)
    ]  # fmt: skip
    history = History(
        "1 x GPU", "org/model", {("vllm", "org/model"): [60.0, 64.0, 70.0]}, [120.0, 130.0, 140.0], entries
    )
    lines = design_lines(_spec(), history)  # type: ignore[arg-type]
    cost = next(line for line in lines if line.startswith("cost:"))
    assert "cold start on 1 x GPU: vllm 64 s (median of 3)" in cost
    assert "a launch of d took 130 s here (median of 3): about 9 minute(s) for 4 launch(es)" in cost
    see = next(line for line in lines if line.startswith("can see"))
    design = stats.Design(tests=3)
    se = math.sqrt(2 * (between + within / 3) / 2)
    expected = stats.detectable(stats.exp_or_inf(stats.mde(se, 2, design.per_test_alpha), minus_one=True))
    assert f"decode throughput, client: {expected} (restart 4.0%, repeat 6.0%" in see
    assert "2 earlier studies kept on 1 x GPU for vllm serving org/model" in see
    # nothing recorded for this model: said so, never a made-up figure
    bare = design_lines(_spec(), History("1 x GPU", "org/model"))  # type: ignore[arg-type]
    assert any("no cold start of org/model recorded on 1 x GPU" in line for line in bare)
    assert any(
        line.startswith("can see: unknown: no earlier study on 1 x GPU kept the noise") for line in bare
    )


def test_the_design_says_what_the_output_probe_will_do_and_whether_it_has_a_floor() -> None:
    import yaml

    from tests.conftest import REPO

    data = yaml.safe_load((REPO / "experiments" / "answers-cpu.yaml").read_text())
    data["arms"][1]["engine"]["args"]["tool_call_parser"] = "hermes"
    lines = design_lines(parse_experiment(data))
    (said,) = [line for line in lines if line.startswith("answers:")]
    assert (
        "8 probe prompt(s) greedy to 16 tokens, 8 scored; against fp32, the floor: fp32 launched again"
        in said
    )
    assert "16 tool-calling request(s) a launch for bf16" in said
    assert "the questions of tests/fixtures/datasets/arith.jsonl on each arm's first launch" in said
    data["arms"][0]["launches"] = 1
    (said,) = [line for line in design_lines(parse_experiment(data)) if line.startswith("answers:")]
    assert "no floor (fp32 launched once, no A/A copy): no arm's answers will be judged" in said
