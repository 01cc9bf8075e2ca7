"""prefect.yaml on a real Prefect server, one per module: the typed run form (the parameter schema
with its descriptions and bounds, a bad value refused by the server before any flow run exists), the
nightly CPU smoke schedule (paused as deployed; turned on, it schedules runs with its own
parameters), and the work pool's concurrency limit of 1 (a second flow run waits while the first
holds the node). The flow runs go through a real process worker to `external` arms served by the
scripted OpenAI server (k3pipe/testing/scripted_openai.py), slow per token so that a run lasts seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.experiment.params import Overrides, RunRequest
from k3pipe.records.tracking import Tracker
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import PREFECT, REPO, TINY_MODEL, running_prefect_server, stop_group

# Not serial: beside the other worker its server's SQLite once answered 503 to a second flow run
# (2026-12-03): a write waited out SQLite's lock timeout, Prefect's 10 s default
# (PREFECT_SERVER_DATABASE_TIMEOUT); the server below waits 60 s, as a loaded machine may need.
pytestmark = pytest.mark.flow

# the schedule prefect.yaml gives the retest deployment
SMOKE = {
    "slug": "nightly-cpu-smoke",
    "cron": "30 2 * * *",
    "timezone": "UTC",
    "parameters": {
        "experiment": "experiments/demo-retest.yaml",
        "overrides": {"repeats": 2, "num_requests": 8},
    },
}
FORM = ("experiment", "experiment_yaml", "arms", "overrides")
RETEST_FORM = ("experiment", "experiment_yaml", "variants", "overrides")


class Api:
    """The server's REST API, as the UI and the CLI use it."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30, trust_env=False)

    def deployment(self, name: str) -> dict[str, Any]:
        response = self.http.get(f"/deployments/name/{name}")
        response.raise_for_status()
        return dict(response.json())

    def flow_runs(self, **flt: Any) -> list[dict[str, Any]]:
        response = self.http.post(
            "/flow_runs/filter", json={"flow_runs": flt, "sort": "EXPECTED_START_TIME_ASC"}
        )
        response.raise_for_status()
        return list(response.json())

    def runs_of(self, deployment: dict[str, Any]) -> list[dict[str, Any]]:
        return self.flow_runs(deployment_id={"any_": [deployment["id"]]})

    def create_run(self, deployment: dict[str, Any], parameters: dict[str, Any]) -> httpx.Response:
        return self.http.post(
            f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": parameters}
        )


def _prefect(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )  # fmt: skip
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _same_words(text: str | None) -> str:
    return " ".join((text or "").split())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One server for the module, prefect.yaml deployed to it as the README says: the `k3pipe`
    process pool with concurrency limit 1, then `prefect deploy --all` from the checkout."""
    directory = tmp_path_factory.mktemp("prefect-server")
    with running_prefect_server(
        directory,
        # a deployment's schedule is turned into flow runs within a second or two, not a minute
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS="1",
        PREFECT_SERVER_DATABASE_TIMEOUT="60",  # SQLite's wait for a lock that another write holds
    ) as prefect:
        isolated = {k: v for k, v in os.environ.items() if not k.startswith(("K3PIPE_", "MLFLOW_"))}
        env = {
            **isolated,
            **prefect,
            "K3PIPE_HOME": str(directory / "k3home"),
            "PWD": str(REPO),  # the pull step's working directory is the checkout: {{ $PWD }}
            "COLUMNS": "200",  # Prefect's CLI wraps its messages at the terminal's width
        }
        _prefect(env, "work-pool", "create", "k3pipe", "--type", "process")
        _prefect(env, "work-pool", "set-concurrency-limit", "k3pipe", "1")
        _prefect(env, "work-pool", "create", "gpu-node", "--type", "process")  # retest/gpu's pool
        _prefect(env, "--no-prompt", "deploy", "--all")
        yield {"prefect": prefect, "env": env, "api": Api(prefect["PREFECT_API_URL"]), "dir": directory}


def test_the_run_form_describes_and_bounds_every_field_and_the_server_refuses_a_bad_value(
    server: dict[str, Any],
) -> None:
    api: Api = server["api"]
    for name in ("benchmark/benchmark", "study/study", "rerun/rerun", "retest/retest", "retest/gpu"):
        assert api.deployment(name)["enforce_parameter_schema"] is True, name
    # the retest says more of its experiment (it must declare variants) and overrides (the variants')
    same = {"benchmark/benchmark": FORM, "study/study": FORM}
    same["retest/retest"] = ("experiment_yaml", "variants")
    for name, form in (
        ("benchmark/benchmark", FORM), ("study/study", FORM), ("retest/retest", RETEST_FORM)
    ):  # fmt: skip
        schema = api.deployment(name)["parameter_openapi_schema"]
        props = schema["properties"]
        assert [p for p in form if p in props] == list(form)
        assert all(props[f].get("description") for f in form), name
        for field in same[name]:  # the flows' docstrings say what the library's fields say
            assert _same_words(props[field].get("description")) == _same_words(
                RunRequest.model_fields[field].description
            ), (name, field)
        assert props["overrides"]["$ref"] == "#/definitions/Overrides"
        overrides = schema["definitions"]["Overrides"]
        assert overrides["additionalProperties"] is False
        assert set(overrides["properties"]) == set(Overrides.model_fields)
        for field, prop in overrides["properties"].items():
            assert prop["description"] == Overrides.model_fields[field].description
            assert {"type": "integer", "minimum": 1} in prop["anyOf"], field
            assert prop["default"] is None

    study = api.deployment("study/study")
    bad = {
        "overrides.repeats": ({"overrides": {"repeats": 0}}, "less than the minimum of 1"),
        "overrides.concurrency": ({"overrides": {"concurrency": "four"}}, "'four'"),
        "overrides": ({"overrides": {"repetas": 1}}, "'repetas' was unexpected"),
        "experiment": ({"experiment": 5}, "5 is not of type 'string'"),
    }
    for field, (parameters, reason) in bad.items():
        response = api.create_run(study, parameters)
        assert response.status_code == 409, response.text
        detail = response.json()["detail"]
        assert f"Validation failed for field '{field}'" in detail, detail
        assert reason in detail, detail
    # what a person types: the CLI says the same, and exits non-zero
    out = _prefect(
        server["env"], "deployment", "run", "study/study", "--param", 'overrides={"repeats": 0}', check=False
    )
    assert out.returncode != 0
    assert "Validation failed for field 'overrides.repeats'" in out.stdout + out.stderr
    assert api.runs_of(study) == []  # nothing was created, no worker was ever asked


def _wait_for(what: str, probe: Any, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := probe()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.5)
    return found


def test_the_nightly_smoke_is_deployed_paused_and_once_on_schedules_runs_with_its_parameters(
    server: dict[str, Any], tmp_path: Path
) -> None:
    api: Api = server["api"]
    assert api.deployment("study/study")["schedules"] == []
    (weekly,) = api.deployment("retest/gpu")["schedules"]
    assert (weekly["slug"], weekly["active"]) == ("weekly-gpu-retest", False)
    assert api.deployment("retest/gpu")["work_pool_name"] == "gpu-node"
    study = api.deployment("retest/retest")
    (schedule,) = study["schedules"]
    assert schedule["slug"] == SMOKE["slug"]
    assert schedule["schedule"]["cron"] == SMOKE["cron"]
    assert schedule["schedule"]["timezone"] == SMOKE["timezone"]
    assert schedule["active"] is False  # deployed paused: see prefect.yaml
    assert schedule["parameters"] == SMOKE["parameters"]
    # the smoke's parameters are a valid request: the server's schema and k3pipe's own loader
    from prefect.utilities.schema_tools import validate

    merged = {**study["parameters"], **schedule["parameters"]}
    validate(merged, study["parameter_openapi_schema"], raise_on_error=True)
    spec = RunRequest.model_validate(merged).load()
    assert {(w.repeats, w.num_requests) for w in spec.workloads} == {(2, 8)}
    assert [v.name for v in spec.variants] == ["batch1", "long-prefill-threshold"]
    assert api.runs_of(study) == []

    # turned on as prefect.yaml's note says (active: true, deploy again): runs appear, with the
    # schedule's parameters, at 02:30 UTC
    text = (REPO / "prefect.yaml").read_text()
    assert text.count("        active: false\n") == 2  # the nightly smoke and the weekly GPU retest
    variant = tmp_path / "prefect.yaml"
    variant.write_text(text.replace("        active: false\n", "        active: true\n"))
    _prefect(server["env"], "--no-prompt", "deploy", "--prefect-file", str(variant), "--name", "retest")
    runs = _wait_for("scheduled runs of the nightly smoke", lambda: api.runs_of(study))
    for run in runs:
        assert run["state_type"] == "SCHEDULED"
        assert run["auto_scheduled"] is True
        assert run["created_by"]["display_value"] == SMOKE["slug"]
        assert run["parameters"] == merged
        start = datetime.fromisoformat(run["expected_start_time"])
        assert (start.hour, start.minute, start.utcoffset()) == (2, 30, timedelta(0))
    assert len({run["expected_start_time"] for run in runs}) == len(runs)  # one a night

    # a deploy of the file as it is sets the schedule back to paused, and its runs go
    _prefect(server["env"], "--no-prompt", "deploy", "--name", "retest")
    assert api.deployment("retest/retest")["schedules"][0]["active"] is False
    _wait_for("the paused schedule's runs to go", lambda: not api.runs_of(study), timeout_s=30)


def _pool_experiment(base_url: str) -> str:
    """An experiment pasted inline (experiment_yaml): one `external` arm on the scripted server."""
    return yaml.safe_dump(
        {
            "name": "pool-test",
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "arms": [
                {
                    "name": "scripted",
                    "engine": {"kind": "vllm"},
                    "launcher": {"kind": "external"},
                    "endpoint": {"base_url": base_url, "model": "m"},
                }
            ],
            "workloads": [
                {"name": "w", "input_tokens": 32, "output_tokens": 8, "concurrency": 1, "num_requests": 2}
            ],
        }
    )


def test_a_second_run_waits_while_the_first_holds_the_pool(server: dict[str, Any], tmp_path: Path) -> None:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    api: Api = server["api"]
    pool = api.http.get("/work_pools/k3pipe").json()
    assert pool["concurrency_limit"] == 1
    env = {**os.environ, **server["prefect"], "PREFECT_WORKER_QUERY_SECONDS": "1"}
    with ScriptedOpenAI(Script(inter_token_s=0.1), model="m") as scripted:  # 0.8 s a request
        experiment = _pool_experiment(scripted.base_url)
        # two runs of two deployments on the one pool, both due now, before any worker polls
        first = api.create_run(
            api.deployment("benchmark/benchmark"),
            {"experiment_yaml": experiment, "overrides": {"num_requests": 3}},
        )
        second = api.create_run(
            api.deployment("study/study"), {"experiment_yaml": experiment, "overrides": {"repeats": 2}}
        )
        assert first.status_code == second.status_code == 201, first.text + second.text
        ids = {first.json()["id"]: "benchmark", second.json()["id"]: "study"}
        log_path = tmp_path / "worker.log"
        samples: list[dict[str, str]] = []
        with log_path.open("wb") as log:
            worker = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", "k3pipe"],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                deadline = time.monotonic() + 300
                while True:
                    runs = {r["id"]: r for r in api.flow_runs(id={"any_": list(ids)})}
                    samples.append({ids[i]: r["state_type"] for i, r in runs.items()})
                    if all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED") for r in runs.values()):
                        break
                    assert time.monotonic() < deadline, (
                        f"runs not done: {samples[-1]}\n" + log_path.read_text()[-3000:]
                    )
                    time.sleep(0.3)
            finally:
                stop_group(worker, signal.SIGINT)
    states = {ids[i]: r["state_type"] for i, r in runs.items()}
    assert states == {"benchmark": "COMPLETED", "study": "COMPLETED"}, log_path.read_text()[-4000:]
    active = ("PENDING", "RUNNING")
    both = [s for s in samples if all(v in active for v in s.values())]
    assert both == [], f"both runs held the pool at once: {both[:3]}"
    # the one waiting stays of type SCHEDULED (named Scheduled, then Late), which the worker picks up
    waiting = [s for s in samples if sorted(s.values()) == ["RUNNING", "SCHEDULED"]]
    assert waiting, f"never saw one run waiting while the other ran: {samples}"
    ordered = sorted(runs.values(), key=lambda r: r["start_time"])
    assert datetime.fromisoformat(ordered[0]["end_time"]) <= datetime.fromisoformat(ordered[1]["start_time"])

    # each run says what was changed: the overrides as params, the experiment as given inline
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    recorded = tracker.client.search_runs([tracker.experiment_id])
    by_flow: dict[str, list[Any]] = {}
    for run in recorded:
        if "k3pipe.workload" not in run.data.tags and "prefect.flow_run_id" in run.data.tags:
            by_flow.setdefault(ids[run.data.tags["prefect.flow_run_id"]], []).append(run)
    (arm,) = by_flow["benchmark"]
    assert arm.info.status == "FINISHED"
    assert arm.data.params["override.num_requests"] == "3"
    assert "override.repeats" not in arm.data.params
    assert arm.data.params["experiment_file"] == "<inline experiment_yaml>"
    (workload,) = tracker.children(arm.info.run_id)
    assert workload.data.params["workload.num_requests"] == "3"
    study_run, study_arm = sorted(by_flow["study"], key=lambda r: r.data.tags.get("k3pipe.kind") != "study")
    assert study_run.data.tags["k3pipe.kind"] == "study"
    for run in (study_run, study_arm):
        assert run.info.status == "FINISHED"
        assert run.data.params["override.repeats"] == "2"
        assert run.data.params["experiment_file"] == "<inline experiment_yaml>"
    (workload,) = tracker.children(study_arm.info.run_id)
    assert len(tracker.children(workload.info.run_id)) == 2  # the two repeats
