"""`run`, `study` and `retest` take the same override options and --spool, spelled once
(k3pipe.cli.main.run_options): each command gets them as Overrides' fields and the flag, after its own
arguments, and the help lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import k3pipe.cli.main as main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("command", "experiment", "choose"),
    [
        ("run", "experiments/demo-cpu.yaml", ["--arm", "vllm-cpu"]),
        ("study", "experiments/demo-study.yaml", ["--arm", "batch1"]),
        ("retest", "experiments/demo-retest.yaml", ["--variant", "batch1"]),
    ],
)
def test_each_command_gets_the_overrides_and_the_spool_flag(
    monkeypatch: pytest.MonkeyPatch, command: str, experiment: str, choose: list[str]
) -> None:
    seen: list[Any] = []

    def stop_before_prefect(settings: Any, spool: bool) -> None:
        seen.append(spool)
        raise typer.Exit(3)

    monkeypatch.setattr(main, "_tracking_ready", stop_before_prefect)
    monkeypatch.chdir(REPO)
    argv = [command, experiment, *choose, "--repeats", "2", "--requests", "5", "--output-tokens", "7"]
    result = CliRunner().invoke(main.app, [*argv, "--spool"])
    assert result.exit_code == 3, result.output
    assert seen == [True]
    result = CliRunner().invoke(main.app, argv)
    assert result.exit_code == 3, result.output
    assert seen == [True, False]


def test_an_override_reaches_the_experiment_and_a_bad_one_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests: list[Any] = []
    real = main._request

    def keep(experiment: Path, arms: list[str] | None, overrides: dict[str, int | None]) -> Any:
        requests.append(real(experiment, arms, overrides))
        raise typer.Exit(3)

    monkeypatch.setattr(main, "_request", keep)
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main.app, ["study", "experiments/demo-study.yaml", "--concurrency", "3"])
    assert result.exit_code == 3, result.output
    (request,) = requests
    assert request.overrides.changes() == {"concurrency": 3}
    assert {w.concurrency for w in request.load().workloads} == {3}
    result = CliRunner().invoke(main.app, ["run", "experiments/demo-cpu.yaml", "--repeats", "0"])
    assert result.exit_code == 2
    assert "--repeats" in result.output


def test_the_help_of_each_lists_the_options_after_its_own() -> None:
    for command, own in (("run", "--arm"), ("study", "--arm"), ("retest", "--variant")):
        text = CliRunner().invoke(main.app, [command, "--help"], terminal_width=200).output
        names = ["--repeats", "--requests", "--concurrency", "--input-tokens", "--output-tokens", "--spool"]
        where = [text.index(name) for name in [own, *names]]
        assert where == sorted(where), (command, text)
