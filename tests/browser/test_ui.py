"""k3pipe used as a person uses it, in a real browser (Debian's Chromium through its WebDriver,
nothing downloaded at run time), against the team stack (`k3pipe stack up`: PostgreSQL, MLflow with
proxied artifacts, a Prefect server, the k3pipe work pool and a worker):

1. the Prefect UI: the deployments page lists `study`; its run form shows the typed parameters with
   their descriptions; a run started from the form with a changed field (repeats 2) completes on
   the worker;
2. the MLflow UI on the PostgreSQL-backed server: the study's parent run in the runs list, its nested
   arm, the run's page with its description and child runs, the report and a plot among its
   artifacts (served by the MLflow server, not from the worker's disk).

The arm is an `external` endpoint served by the scripted OpenAI server (k3pipe/testing/scripted_openai.py)
running in this test's process, so the worker starts no engine. Screenshots of each step go to
``$K3PIPE_UI_SHOTS`` (docs/ui when refreshing the README's pictures) or the test's tmp dir.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL
from tests.integration.test_stack import Stack, _down_and_remove, _free_ports, _stack_home

pytestmark = pytest.mark.flow

# read at import: the autouse fixture clears K3PIPE_* variables before each test
SHOTS_DIR = os.environ.get("K3PIPE_UI_SHOTS")
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack(_stack_home(), *_free_ports(3))
    try:
        out = s.cli("up", timeout=600)
        assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
        yield s
    finally:
        _down_and_remove(s)


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `make test` installs chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1500,1000",
        "--disable-gpu",
        "--no-first-run",
    ):
        options.add_argument(arg)
    options.binary_location = str(CHROMIUM)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Callable[[Any, str], Path]:
    out = Path(SHOTS_DIR or tmp_path / "ui")
    out.mkdir(parents=True, exist_ok=True)

    def shoot(driver: Any, name: str) -> Path:
        path = out / f"{name}.png"
        driver.save_screenshot(str(path))
        return path

    return shoot


def _wait(
    what: str,
    check: Callable[[], Any],
    timeout: float = 60,
    every: float = 0.5,
    seen: Callable[[], str] | None = None,
) -> Any:
    """``check()`` once it is truthy; after ``timeout`` an error that says what was awaited and,
    with ``seen``, what there was instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"; {seen()}" if seen is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(every)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc})"


def _text(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


def _property(driver: Any, label: str) -> Any:
    """The innermost schema-form property of Prefect's run form whose label reads ``label``."""
    from selenium.webdriver.common.by import By

    xpath = (
        "//div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')]"
        f"[.//span[contains(@class, 'schema-form-property__label') and normalize-space(.)='{label}']]"
    )
    found = driver.find_elements(By.XPATH, xpath)
    assert found, f"no field {label!r} on the form:\n{_text(driver)[:3000]}"
    return found[-1]


def _click_text(driver: Any, text: str, tag: str = "*") -> None:
    from selenium.webdriver.common.by import By

    element = _wait(
        f"{text!r} to click",
        lambda: next(iter(driver.find_elements(By.XPATH, f"//{tag}[normalize-space(.)='{text}']")), None),
    )
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    element.click()


def test_a_run_started_from_the_prefect_form_lands_in_mlflow_on_postgresql(  # type: ignore[no-untyped-def]
    stack: Stack, browser, shots, tmp_path: Path
) -> None:
    from mlflow import MlflowClient
    from selenium.webdriver.common.by import By

    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"no tiny model at {TINY_MODEL}: `make test` builds it")
    prefect_ui = f"http://127.0.0.1:{stack.prefect_port}"
    experiment = stack.home / "ui-study.yaml"
    with ScriptedOpenAI(Script(inter_token_s=0.005), model="m") as server:
        experiment.write_text(
            yaml.safe_dump(
                {
                    "name": "ui-study",
                    "description": "started from the Prefect UI's form in a browser",
                    "model": {"source": "local", "path": str(TINY_MODEL)},
                    "arms": [
                        {
                            "name": "scripted",
                            "engine": {"kind": "vllm"},
                            "launcher": {"kind": "external"},
                            "endpoint": {"base_url": server.base_url, "model": "m"},
                        }
                    ],
                    "workloads": [
                        {
                            "name": "in64",
                            "input_tokens": 64,
                            "output_tokens": 16,
                            "concurrency": 2,
                            "num_requests": 4,
                            "warmup_requests": 0,
                            "repeats": 1,
                            "seed": 3,
                        }
                    ],
                }
            )
        )

        # 1. the deployments page lists the study deployment; its run form is typed
        browser.get(f"{prefect_ui}/deployments")
        _wait("the deployments list", lambda: "retest" in _text(browser) and "study" in _text(browser), 90)
        shots(browser, "prefect-deployments")
        api = f"{prefect_ui}/api"
        deployment = httpx.get(f"{api}/deployments/name/study/study", timeout=10).json()
        browser.get(f"{prefect_ui}/deployments/deployment/{deployment['id']}/run")
        _wait("the run form", lambda: "Repeats (Optional)" in _text(browser), 90)
        form = _text(browser)
        assert "Run every workload this many times" in form  # the field's description
        assert "Experiment YAML file on the worker" in form
        path = _property(browser, "experiment (Optional)").find_element(By.TAG_NAME, "textarea")
        path.clear()
        path.send_keys(str(experiment))
        _property(browser, "Repeats (Optional)").find_element(
            By.XPATH, ".//button[normalize-space(.)='int']"
        ).click()
        # the field is drawn anew as an integer input
        field = _wait(
            "the repeats input",
            lambda: next(
                iter(_property(browser, "Repeats (Optional)").find_elements(By.TAG_NAME, "input")), None
            ),
        )
        field.send_keys("2")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", field)
        shots(browser, "prefect-run-form")
        _click_text(browser, "Submit", "button")

        # 2. the run completes on the worker
        def runs() -> list[dict[str, Any]]:
            return list(
                httpx.post(
                    f"{api}/flow_runs/filter",
                    json={"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}},
                    timeout=10,
                ).json()
            )

        def finished() -> dict[str, Any] | None:
            final = ("COMPLETED", "FAILED", "CRASHED")
            done = [r for r in runs() if r["state"] and r["state"]["type"] in final]
            return done[0] if done else None

        def seen() -> str:
            states = [f"{r['name']}: {(r['state'] or {}).get('name')}" for r in runs()]
            logs = stack.home / "stack" / "logs"
            return (
                f"the deployment's flow runs: {states or 'none'}\n"
                f"worker log:\n{_tail(logs / 'worker.log')}\nprefect log:\n{_tail(logs / 'prefect.log', 15)}"
            )

        run = _wait("the flow run to finish on the worker", finished, timeout=420, every=2, seen=seen)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert run["parameters"]["overrides"]["repeats"] == 2
        assert run["parameters"]["experiment"] == str(experiment)
        browser.get(f"{prefect_ui}/runs/flow-run/{run['id']}")
        _wait("the flow run page", lambda: "Completed" in _text(browser), 60)
        shots(browser, "prefect-flow-run")

    # 3. MLflow on PostgreSQL: the study's parent run, its nested arm, the report and a plot
    client = MlflowClient(stack.mlflow_url)
    exp = client.get_experiment_by_name("k3pipe")
    assert exp is not None
    assert exp.artifact_location.startswith("mlflow-artifacts:")
    (study,) = client.search_runs([exp.experiment_id], "tags.`k3pipe.kind` = 'study'")
    (arm,) = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{study.info.run_id}'")
    (workload,) = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{arm.info.run_id}'")
    repeats_run = client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{workload.info.run_id}'"
    )
    assert len(repeats_run) == 2  # the form's change reached the run
    assert study.data.params.get("override.repeats") == "2"
    served = stack.home / "stack" / "mlflow-artifacts"
    assert list(served.rglob("report.html")), "the report is not in the MLflow server's artifact store"

    runs_page = f"{stack.mlflow_url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    browser.get(runs_page)
    _wait("the study in MLflow's runs list", lambda: "study/ui-study" in _text(browser), 90)
    _close_assistant(browser)
    # the study's row opens on its nested arm (the "+" before the run's name)
    name = browser.find_element(By.XPATH, "//a[normalize-space(.)='study/ui-study']")
    name.find_element(By.XPATH, "./ancestor::div[@role='gridcell'][1]//button").click()
    _wait("the nested arm", lambda: "ui-study/scripted" in _text(browser), 30)
    shots(browser, "mlflow-runs")

    browser.get(
        f"{stack.mlflow_url}/#/experiments/{exp.experiment_id}/runs/{study.info.run_id}"
        "?workflowType=machine_learning"
    )
    _wait("the study's run page", lambda: "Child runs" in _text(browser), 90)
    _close_assistant(browser)
    page = _text(browser)
    assert "ui-study/scripted" in page  # its child run
    assert "Study of experiment" in page  # its description
    shots(browser, "mlflow-study-run")

    browser.get(
        f"{stack.mlflow_url}/#/experiments/{exp.experiment_id}/runs/{study.info.run_id}"
        "/artifacts/report/report.html?workflowType=machine_learning"
    )
    _wait("the report among the artifacts", lambda: "report.html" in _text(browser), 90)
    _close_assistant(browser)
    shots(browser, "mlflow-report")
    browser.get(f"{stack.mlflow_url}/#/experiments/{exp.experiment_id}/runs/{study.info.run_id}"
                "/artifacts/report/plots/distributions.png?workflowType=machine_learning")  # fmt: skip
    browser.refresh()  # the same page with another file chosen: the app reads the link on load
    try:
        _wait("the plot among the artifacts", lambda: "distributions.png" in _text(browser), 90)
    except AssertionError:
        shots(browser, "failed-plot")
        raise AssertionError(_text(browser)[:3000]) from None
    _close_assistant(browser)
    # the figure is shown, decoded (a broken image has no natural size)
    image = _wait(
        "the plot drawn",
        lambda: next(
            (
                i
                for i in browser.find_elements(By.TAG_NAME, "img")
                if browser.execute_script("return arguments[0].naturalWidth", i) > 200
            ),
            None,
        ),
        60,
    )
    assert image.is_displayed()
    shots(browser, "mlflow-plot")


def _close_assistant(driver: Any) -> None:
    """MLflow 3.17 opens its assistant panel on a first visit; a person closes it."""
    from selenium.webdriver.common.by import By

    time.sleep(1)
    for button in driver.find_elements(By.XPATH, "//button[@aria-label='Close']"):
        if button.is_displayed():
            button.click()
            time.sleep(0.5)
            return
