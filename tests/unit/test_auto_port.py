"""launcher.port 'auto' (issue 50: two workers of a pool on one machine launch candidates at once): a port
free on the node drawn where the launch is planned (k3pipe.planning.plan.plan_arm), which the engine's
command line, its health, metrics and base URLs and the recorded plan all carry; refused where k3pipe
does not start the engine on this machine, beside a gateway (which routes to a fixed port), and any
other value than a port number or 'auto' refused naming the field."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import parse_experiment
from k3pipe.experiment.preflight import port_taken, preflight
from k3pipe.planning.plan import ArmPlan, plan_arm
from k3pipe.schema.specs import ExperimentSpec

pytestmark = pytest.mark.unit


def _spec(launcher: dict[str, Any], **arm: Any) -> ExperimentSpec:
    return parse_experiment(
        {
            "name": "t",
            "model": {"source": "local", "path": "/m"},
            "arms": [
                {
                    "name": "a",
                    "engine": {"kind": "vllm", "executable": ["vllm", "serve"]},
                    "launcher": launcher,
                    **arm,
                }
            ],
            "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
        }
    )


def _plan(spec: ExperimentSpec, tmp_path: Path) -> ArmPlan:
    return plan_arm(spec, spec.arms[0], tmp_path, {"model": "/m"})


def _port_of(plan: ArmPlan) -> int:
    argv = plan.command.argv
    return int(argv[argv.index("--port") + 1])


@pytest.mark.parametrize("kind", ["process", "docker"])
def test_an_auto_port_is_drawn_free_where_the_launch_is_planned(kind: str, tmp_path: Path) -> None:
    launcher: dict[str, Any] = {"kind": kind, "port": "auto"}
    spec = _spec(
        launcher,
        **({"engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.22.0"}} if kind == "docker" else {}),
    )
    assert spec.arms[0].launcher.port == "auto"  # the spec keeps 'auto': each launch draws its own
    plan = _plan(spec, tmp_path)
    port = _port_of(plan)
    assert plan.launch.port == port  # the recorded plan says the port drawn
    assert plan.base_url == f"http://127.0.0.1:{port}/v1"
    assert plan.health_url == f"http://127.0.0.1:{port}/health"
    assert plan.metrics_url == f"http://127.0.0.1:{port}/metrics"
    assert not port_taken("127.0.0.1", port)
    # a port taken by the time the next launch is planned is not drawn again
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert _port_of(_plan(spec, tmp_path)) != port


def test_a_fixed_port_and_no_port_are_as_before(tmp_path: Path) -> None:
    assert _port_of(_plan(_spec({"kind": "process", "port": 8123}), tmp_path)) == 8123
    assert _port_of(_plan(_spec({"kind": "process"}), tmp_path)) == 8000  # vLLM's own


def test_preflight_checks_no_auto_port_but_a_fixed_one_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("k3pipe.experiment.preflight.port_taken", port_taken)  # the real probe
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        fixed = preflight(_spec({"kind": "process", "port": taken}), home=tmp_path, this_machine=True)
        auto = preflight(_spec({"kind": "process", "port": "auto"}), home=tmp_path, this_machine=True)
    assert [f.severity for f in fixed if f.rule == "port"] == ["error"]
    assert [f for f in auto if f.rule == "port"] == []


@pytest.mark.parametrize("value", [0, 65536, -1, "8000", "AUTO", True, 80.5])
def test_a_port_other_than_a_number_or_auto_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(SpecError) as err:
        _spec({"kind": "process", "port": value})
    text = str(err.value)
    assert "launcher.port" in text, text
    assert f"port {value!r} must be a port number from 1 to 65535, or 'auto'" in text, text


@pytest.mark.parametrize(
    ("launcher", "arm", "said"),
    [
        ({"kind": "external", "port": "auto"}, {"endpoint": {"base_url": "http://127.0.0.1:9/v1"}},
         "port 'auto' with kind 'external'"),
        ({"kind": "gpustack", "port": "auto", "server_url": "http://127.0.0.1:9", "api_key_env": "K",
          "backend": "vllm-custom", "backend_version": "v-custom"}, {},
         "port 'auto' with kind 'gpustack'"),
        ({"kind": "process", "port": "auto"},
         {"gateway": {"base_url": "http://127.0.0.1:4000/v1", "model": "m"}},
         "launcher.port is 'auto' beside gateway"),
    ],
)  # fmt: skip
def test_auto_is_refused_where_k3pipe_does_not_bind_the_engine_here(
    launcher: dict[str, Any], arm: dict[str, Any], said: str
) -> None:
    with pytest.raises(SpecError) as err:
        _spec(launcher, **arm)
    assert said in str(err.value), str(err.value)


def test_render_says_the_port_is_drawn_per_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml
    from typer.testing import CliRunner

    from k3pipe.cli import main

    monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
    exp = tmp_path / "e.yaml"
    exp.write_text(yaml.safe_dump(_spec({"kind": "process", "port": "auto"}).model_dump(mode="json")))
    result = CliRunner().invoke(main.app, ["render", str(exp)])
    assert result.exit_code == 0, result.output
    (said,) = [line for line in result.output.splitlines() if line.startswith("# launcher.port auto")]
    port = int(said.split()[3])
    assert (
        said
        == f"# launcher.port auto: {port} is free here now; each launch draws its own where it is planned"
    )
    assert f"--port {port}" in result.output
