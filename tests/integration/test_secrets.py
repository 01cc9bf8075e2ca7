"""Planted secrets: distinct random secrets in every place a run can take one from, the real flow run
(`k3pipe run`, and the flow with the experiment given as text), then every store grepped for each.

The places: the endpoint's key (the variable ``endpoint.api_key_env`` names), a secret-named
``engine.env`` value (HF_TOKEN) and a secret-named engine argument (api_key), each an ``{env.NAME}``
reference (a literal is refused: test_planted_keys_through_every_refusal_path), an ``{env.NAME}``
reference under a name that says nothing about secrets, the experiment given as ``experiment_yaml``
text, and endpoints that echo the Authorization header in their error bodies (the engine's workload
requests; a gateway's health probe). The engine is
k3pipe/testing/scripted_engine.py under the process launcher: it prints its arguments and those variables raw
to its log, as engines do, and the sha256 of each, which prove what it received.

The stores: the terminal (stdout and stderr), and every file under K3PIPE_HOME: MLflow's SQLite
database and its artifacts (parquet read back as tables too), the Prefect database
(``K3PIPE_HOME/prefect``, where the command line points Prefect), the engine logs, caches; each as
bytes, and as base64 (a pickled result would be stored so).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker
from k3pipe.testing import SCRIPTED_ENGINE as ENGINE_SCRIPT
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import REPO, TINY_MODEL, free_port

pytestmark = [pytest.mark.flow]


def _secret(tag: str) -> str:
    # no well-known key shape: each must be scrubbed because it was found, not because of its look
    return f"{tag}{secrets.token_hex(14)}"


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _experiment(name: str, port: int, gateway: str, hf_token: str, api_key_arg: str) -> dict[str, Any]:
    """``hf_token`` and ``api_key_arg``: what the experiment says for them (``{env.NAME}`` references)."""
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "engine",
                "engine": {
                    "kind": "vllm",
                    "executable": [sys.executable, str(ENGINE_SCRIPT)],
                    "env": {
                        "HF_TOKEN": hf_token,
                        "SCRIPTED_REF": "{env.K3PIPE_TEST_REF}",
                        "SCRIPTED_ENGINE_ECHO": "HF_TOKEN,SCRIPTED_REF",
                        "SCRIPTED_ENGINE_FAIL_AFTER": "1",  # the probe passes, the workload's get 500s
                    },
                    "args": {"api_key": api_key_arg},
                },
                "launcher": {"kind": "process", "port": port, "startup_timeout_s": 120},
                "endpoint": {"api_key_env": "K3PIPE_TEST_ENDPOINT_KEY", "model": "scripted"},
            },
            {
                "name": "gateway",
                "engine": {"kind": "vllm"},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": gateway, "api_key_env": "K3PIPE_TEST_GATEWAY_KEY", "model": "m"},
            },
        ],
        "workloads": [
            {"name": "w", "input_tokens": 16, "output_tokens": 4, "num_requests": 2, "concurrency": 1}
        ],
    }


def _run(argv: list[str], env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """A command in its own session, output captured; its whole group ended if it overruns."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(stdin, timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{argv} overran:\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its group left behind
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


_BASE64 = re.compile(rb"[A-Za-z0-9+/=\s]+")


def _texts(path: Path) -> Iterator[bytes]:
    """The bytes of a file as stored, and what it holds when it is stored encoded: parquet (read back
    as a table), base64 (Prefect's result storage: a pickle, base64 in lines; decoded)."""
    data = path.read_bytes()
    yield data
    if data[:4] == b"PAR1":
        yield pd.read_parquet(path).to_json().encode()
    elif data and _BASE64.fullmatch(data):
        with contextlib.suppress(binascii.Error, ValueError):
            yield base64.b64decode(b"".join(data.split()))


def _forms(secret: str) -> list[bytes]:
    """The secret as bytes, and its base64 forms at each of the three alignments (inner part)."""
    raw = secret.encode()
    forms = [raw]
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + raw)
        forms.append(encoded[4:-4])  # the characters that depend on the secret alone
    return forms


def _leaks(secret_values: dict[str, str], texts: dict[str, bytes]) -> list[str]:
    return [
        f"{label} in {where}"
        for label, secret in secret_values.items()
        for where, data in texts.items()
        if any(form in data for form in _forms(secret))
    ]


def test_planted_secrets_appear_in_no_store(tmp_path: Path, clean_environ: Path) -> None:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"no tiny model at {TINY_MODEL} (make model)")
    home = clean_environ
    home.mkdir(parents=True, exist_ok=True)  # Prefect makes K3PIPE_HOME/prefect, not K3PIPE_HOME itself
    planted = {
        "endpoint key": _secret("endpt"),
        "gateway key": _secret("gatew"),
        "{env.K3PIPE_TEST_REF} value": _secret("refval"),
        "HF_TOKEN (file)": _secret("hftok"),
        "api_key arg (file)": _secret("argkey"),
        "HF_TOKEN (experiment_yaml)": _secret("inlhf"),
        "api_key arg (experiment_yaml)": _secret("inlarg"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {
        "K3PIPE_HOME": str(home),
        "PYTHONUNBUFFERED": "1",
        "K3PIPE_TEST_ENDPOINT_KEY": planted["endpoint key"],
        "K3PIPE_TEST_GATEWAY_KEY": planted["gateway key"],
        "K3PIPE_TEST_REF": planted["{env.K3PIPE_TEST_REF} value"],
        "K3PIPE_TEST_HF_FILE": planted["HF_TOKEN (file)"],
        "K3PIPE_TEST_ARG_FILE": planted["api_key arg (file)"],
        "K3PIPE_TEST_HF_INLINE": planted["HF_TOKEN (experiment_yaml)"],
        "K3PIPE_TEST_ARG_INLINE": planted["api_key arg (experiment_yaml)"],
    }
    terminal: dict[str, bytes] = {}
    # a gateway whose health probe answers 500 with the request's Authorization header in the body
    with ScriptedOpenAI(Script(status=500, echo_auth_in_error=True), model="m") as gateway:
        # 1. `k3pipe run` on a file
        exp = _experiment(
            "planted-file",
            free_port(),
            gateway.base_url,
            "{env.K3PIPE_TEST_HF_FILE}",
            "{env.K3PIPE_TEST_ARG_FILE}",
        )
        path = tmp_path / "planted.yaml"  # the user's own file, outside K3PIPE_HOME
        path.write_text(yaml.safe_dump(exp))
        cli = _run([sys.executable, "-m", "k3pipe.cli.main", "run", str(path)], env)
        terminal["k3pipe run stdout"] = cli.stdout.encode()
        terminal["k3pipe run stderr"] = cli.stderr.encode()
        (tmp_path / "k3pipe-run.out").write_text(cli.stdout + "\n----- stderr\n" + cli.stderr)
        # both arms failed, as planted: the engine's requests and the gateway's probe got 500s
        assert cli.returncode == 2, cli.stdout[-3000:] + cli.stderr[-3000:]
        assert "error: arm(s) did not finish cleanly (engine: requests failed (" in cli.stderr
        assert "; gateway: HealthError" in cli.stderr

        # 2. the flow with the experiment as text (experiment_yaml), Prefect where the CLI puts it
        inline = _experiment(
            "planted-inline",
            free_port(),
            gateway.base_url,
            "{env.K3PIPE_TEST_HF_INLINE}",
            "{env.K3PIPE_TEST_ARG_INLINE}",
        )
        code = (
            "import sys\n"
            "from k3pipe.cli.prefect_env import prepare_prefect_env\n"
            "from k3pipe.core.settings import Settings\n"
            "prepare_prefect_env(Settings())\n"
            "from k3pipe.flows.benchmark import benchmark\n"
            "benchmark(experiment_yaml=sys.stdin.read())\n"
        )
        flow = _run([sys.executable, "-c", code], env, stdin=yaml.safe_dump(inline))
        terminal["flow stdout"], terminal["flow stderr"] = flow.stdout.encode(), flow.stderr.encode()
        (tmp_path / "flow.out").write_text(flow.stdout + "\n----- stderr\n" + flow.stderr)
        assert flow.returncode == 1, flow.stdout[-3000:] + flow.stderr[-3000:]
        assert "RunFailedError: arm(s) did not finish cleanly (engine: requests failed (" in flow.stderr
        assert "; gateway: HealthError" in flow.stderr
        # the gateway got the key each time: its echo had something to echo
        auths = {r.headers.get("authorization") for r in gateway.requests}
        assert auths == {f"Bearer {planted['gateway key']}"}

    # every store: the terminal, and every file under K3PIPE_HOME
    files = {str(p.relative_to(home)): p for p in sorted(home.rglob("*")) if p.is_file()}
    stored = {f"{name} ({i})": data for name, p in files.items() for i, data in enumerate(_texts(p))}
    assert any(name.startswith("prefect/") and name.endswith(".db (0)") for name in stored), sorted(files)
    assert any(name.startswith("mlflow/mlflow.db") for name in stored), sorted(files)
    assert any(name.startswith("logs/") for name in stored), sorted(files)
    assert any(p.suffix == ".parquet" for p in files.values()), sorted(files)
    assert _leaks(planted, {**terminal, **stored}) == []

    # ... and it all happened: both flows ran both arms, recorded in MLflow
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    runs = tracker.client.search_runs([tracker.experiment_id], "tags.`k3pipe.arm` = 'engine'")
    arm_runs = [r for r in runs if not r.data.tags.get("k3pipe.workload")]
    assert sorted(r.data.tags["k3pipe.experiment"] for r in arm_runs) == ["planted-file", "planted-inline"]
    for run in arm_runs:
        where = "file" if run.data.tags["k3pipe.experiment"] == "planted-file" else "experiment_yaml"
        tag = "FILE" if where == "file" else "INLINE"
        params = run.data.params
        assert params["env.HF_TOKEN"] == f"{{env.K3PIPE_TEST_HF_{tag}}}"
        assert params["env.SCRIPTED_REF"] == "{env.K3PIPE_TEST_REF}"
        assert params["arg.api_key"] == f"{{env.K3PIPE_TEST_ARG_{tag}}}"
        assert f"--api-key '{{env.K3PIPE_TEST_ARG_{tag}}}'" in params["command"]
        recorded = json.loads(tracker.read_artifact(run.info.run_id, "experiment.json") or b"{}")
        assert recorded["arms"][0]["engine"]["env"]["HF_TOKEN"] == f"{{env.K3PIPE_TEST_HF_{tag}}}"
        assert recorded["arms"][0]["engine"]["env"]["SCRIPTED_REF"] == "{env.K3PIPE_TEST_REF}"
        # the engine got every value (their sha256 in its log), and the log holds none of them
        (log,) = [a.path for a in tracker.client.list_artifacts(run.info.run_id, "logs")]
        text = (tracker.read_artifact(run.info.run_id, log) or b"").decode()
        assert f"environment SCRIPTED_REF=*** sha256={_sha(planted['{env.K3PIPE_TEST_REF} value'])}" in text
        assert f"environment HF_TOKEN=*** sha256={_sha(planted[f'HF_TOKEN ({where})'])}" in text
        assert f"--api-key sha256={_sha(planted[f'api_key arg ({where})'])}" in text
        # the engine required the endpoint's key: the health probe passed, the two requests got the
        # echoing 500s (the arm failed on them, its records scrubbed)
        (workload,) = tracker.children(run.info.run_id)
        assert workload.data.metrics["failed"] == 2
        assert run.info.status == "FAILED"
    gateways = tracker.client.search_runs([tracker.experiment_id], "tags.`k3pipe.arm` = 'gateway'")
    assert len(gateways) == 2
    for run in gateways:
        error = run.data.tags["k3pipe.error"]
        assert error.startswith("HealthError: the endpoint at http://127.0.0.1:"), error
        assert "Bearer ***" in error
    assert '"authorization":"Bearer ***"' in terminal["k3pipe run stderr"].decode()
    assert '"authorization":"Bearer ***"' in terminal["flow stderr"].decode()

    # Prefect stored the inline experiment as written: references, no values
    (db,) = (home / "prefect").glob("*.db")
    with sqlite3.connect(db) as conn:
        parameters = [json.loads(row[0]) for row in conn.execute("select parameters from flow_run")]
    texts = [p["experiment_yaml"] for p in parameters if p.get("experiment_yaml")]
    assert len(texts) == 1
    stored_spec = yaml.safe_load(texts[0])
    assert stored_spec["arms"][0]["engine"]["env"]["HF_TOKEN"] == "{env.K3PIPE_TEST_HF_INLINE}"
    assert stored_spec["arms"][0]["engine"]["env"]["SCRIPTED_REF"] == "{env.K3PIPE_TEST_REF}"


def test_a_run_created_with_a_secret_in_its_parameters_stores_them_scrubbed(prefect_harness: None) -> None:
    """A deployment run's parameters are stored as the UI or the API sent them, before any k3pipe code
    runs: the flow's first step (k3pipe.flows.secrecy.guard) writes them back scrubbed."""
    from prefect import get_client
    from prefect.flow_engine import run_flow

    from k3pipe.flows.secrecy import guard, scrubbed_flow

    literal = _secret("uihf")

    @scrubbed_flow("secrecy-probe")
    def probe(experiment_yaml: str | None = None) -> str:
        guard()
        return "ran"

    text = yaml.safe_dump(
        _experiment("ui", 8000, "http://127.0.0.1:9/v1", literal, "{env.SOME_KEY}"), sort_keys=False
    )
    with get_client(sync_client=True) as client:
        # as the UI does: the parameters as typed, stored when the run is created
        created = client.create_flow_run(probe, parameters={"experiment_yaml": text})
        assert literal in created.parameters["experiment_yaml"]
        assert run_flow(probe, flow_run=created, parameters={"experiment_yaml": text}) == "ran"
        stored = client.read_flow_run(created.id).parameters["experiment_yaml"]
    assert literal not in stored
    engine = yaml.safe_load(stored)["arms"][0]["engine"]
    assert engine["env"]["HF_TOKEN"] == "***"
    assert engine["args"]["api_key"] == "{env.SOME_KEY}"


def _refused_experiment(name: str, engine: dict[str, Any], endpoint: dict[str, Any] | None = None) -> str:
    arm: dict[str, Any] = {"name": "a", "engine": {"kind": "vllm", **engine}, "launcher": {"kind": "process"}}
    if endpoint:
        arm |= {"launcher": {"kind": "external"}, "endpoint": endpoint}
    return yaml.safe_dump(
        {
            "name": name,
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "arms": [arm],
            "workloads": [
                {"name": "w", "input_tokens": 8, "output_tokens": 2, "num_requests": 1, "concurrency": 1}
            ],
        }
    )


def test_planted_keys_through_every_refusal_path(tmp_path: Path, clean_environ: Path) -> None:
    """Keys planted where k3pipe refuses them, each through the commands that refuse it (with --debug
    too, whose traceback reaches the terminal), a bad K3PIPE_ setting, a tracking URI with a password,
    and commands that fail after their flow started; then the whole home, every terminal and a GPU
    record collected from that home (scripts/gpu-node.sh collect) grepped for every key."""
    home = clean_environ
    home.mkdir(parents=True, exist_ok=True)
    planted = {
        "engine.env VLLM_API_KEY literal": _secret("envkey"),
        "engine.args api_key literal": _secret("argkey"),
        "engine.env key-shaped under a plain name": "nvapi-" + secrets.token_hex(16),
        "endpoint.api_key_env holding the key": _secret("pasted"),
        "K3PIPE_MLFLOW_PROBE_TIMEOUT_S holding a key": "sk-" + secrets.token_hex(16),
        "K3PIPE_STACK_AUTH holding a key": _secret("stauth"),
        "MLFLOW_TRACKING_URI password": _secret("mlpw"),
        "endpoint key of a run that fails in its flow": _secret("flowkey"),
    }
    files = {
        "env": _refused_experiment(
            "env", {"env": {"VLLM_API_KEY": planted["engine.env VLLM_API_KEY literal"]}}
        ),
        "args": _refused_experiment("args", {"args": {"api_key": planted["engine.args api_key literal"]}}),
        "shape": _refused_experiment(
            "shape", {"env": {"EXTRA": planted["engine.env key-shaped under a plain name"]}}
        ),
        "pasted": _refused_experiment(
            "pasted",
            {},
            {
                "base_url": "http://127.0.0.1:9/v1",
                "model": "m",
                "api_key_env": planted["endpoint.api_key_env holding the key"],
            },
        ),
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base |= {"K3PIPE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "k3pipe.cli.main"]
    terminal: dict[str, bytes] = {}

    def command(label: str, argv: list[str], env: dict[str, str], rc: int, says: str) -> None:
        done = _run(argv, env)
        terminal[f"{label} stdout"], terminal[f"{label} stderr"] = done.stdout.encode(), done.stderr.encode()
        output = done.stdout[-2000:] + done.stderr[-3000:]
        assert done.returncode == rc, f"{label}: rc {done.returncode}\n{output}"
        assert says in done.stderr, f"{label}: {says!r} not in\n{done.stderr[-3000:]}"

    # 1. bad spec fields, refused by every command that reads an experiment (and with --debug)
    refusals = {
        "env": "env.VLLM_API_KEY: a literal secret (",
        "args": "args.api_key: a literal secret (",
        "shape": "env.EXTRA: a literal secret (nva… (38 chars))",
        "pasted": "is not an environment variable name (it looks like a key)",
    }
    for name, text in files.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        for verb in ("render", "preflight", "run", "study"):
            command(f"{verb} {name}", [*cli, verb, str(path)], base, 2, refusals[name])
        command(f"run --debug {name}", [*cli, "--debug", "run", str(path)], base, 2, refusals[name])
    assert "write '{env.VLLM_API_KEY}' and set VLLM_API_KEY" in terminal["run env stderr"].decode()
    assert "write '{env.API_KEY}' and set API_KEY" in terminal["run args stderr"].decode()

    # 2. a bad environment: settings that cannot be parsed, a tracking server's password in its URL
    demo = REPO / "experiments" / "demo-cpu.yaml"
    command(
        "probe timeout",
        [*cli, "runs"],
        base | {"K3PIPE_MLFLOW_PROBE_TIMEOUT_S": planted["K3PIPE_MLFLOW_PROBE_TIMEOUT_S holding a key"]},
        2,
        "K3PIPE_MLFLOW_PROBE_TIMEOUT_S=sk-… (35 chars): input should be a valid number",
    )
    command(
        "stack auth",
        [*cli, "stack", "status"],
        base | {"K3PIPE_STACK_AUTH": planted["K3PIPE_STACK_AUTH holding a key"]},
        2,
        "K3PIPE_STACK_AUTH=sta… (",
    )
    tracking = f"http://alice:{planted['MLFLOW_TRACKING_URI password']}@127.0.0.1:{free_port()}"
    for verb in ("run", "runs", "study"):
        argv = [*cli, verb] + ([str(demo)] if verb != "runs" else [])
        says = "MLflow at http://***@127.0.0.1:"
        command(f"tracking {verb}", argv, base | {"MLFLOW_TRACKING_URI": tracking}, 2, says)

    # 3. commands that fail after their flow started: an endpoint that refuses connections
    gateway = tmp_path / "gone.yaml"
    gateway.write_text(
        _refused_experiment(
            "gone",
            {},
            {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m", "api_key_env": "GONE_KEY"},
        )
    )
    failing = base | {"GONE_KEY": planted["endpoint key of a run that fails in its flow"]}
    command("failing run", [*cli, "run", str(gateway)], failing, 2, "HealthError")
    command("failing run --debug", [*cli, "--debug", "run", str(gateway)], failing, 2, "HealthError")

    # 4. a GPU record collected from this home, as a sitting packs it, then unpacked
    out = tmp_path / "out"
    node_env = base | {"OUT": str(out), "K3PIPE_PIPELINE_PYTHON": sys.executable}
    node = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-node.sh"), "collect"],
        cwd=REPO, env=node_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    terminal["collect"] = (node.stdout + node.stderr).encode()
    assert node.returncode == 0, node.stdout[-3000:] + node.stderr[-3000:]
    unpacked = tmp_path / "record"
    unpacked.mkdir()
    parts = sorted(out.glob("record.tar.gz.part-*"))
    (tmp_path / "record.tar.gz").write_bytes(b"".join(p.read_bytes() for p in parts))
    subprocess.run(["tar", "-xzf", str(tmp_path / "record.tar.gz"), "-C", str(unpacked)], check=True)
    record = {str(p.relative_to(unpacked)): p for p in unpacked.rglob("*") if p.is_file()}
    assert any(name.endswith("logs/engine/k3pipe.log") for name in record), sorted(record)

    stored = {
        f"{where}:{name} ({i})": data
        for where, root in (("home", home), ("record", unpacked))
        for name, p in sorted((str(p.relative_to(root)), p) for p in root.rglob("*") if p.is_file())
        for i, data in enumerate(_texts(p))
    }
    assert any(name.startswith("home:logs/k3pipe.log") for name in stored), sorted(stored)
    log = (home / "logs" / "k3pipe.log").read_text()
    assert log.count("Traceback") >= 2  # the failures were logged, tracebacks and all
    assert _leaks(planted, {**terminal, **stored}) == []
