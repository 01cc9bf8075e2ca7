"""The run record as a value and restoring a run from it (a real SQLite MLflow store; no engine): the
record round-trips, the prompts come back verified, a changed model file refuses the rerun unless
drift is allowed, and a tampered prompts artifact refuses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3pipe.bench import load_tokenizer
from k3pipe.core.errors import RerunError, SpecError
from k3pipe.core.layout import RECORD_FILE
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.rerun import arm_run, read_record, restore
from k3pipe.planning.plan import plan_arm
from k3pipe.prompts.draw import prepare_prompts
from k3pipe.records.recorder import ArmRecorder
from k3pipe.records.runrecord import prompts_digest
from k3pipe.records.tracking import Tracker
from k3pipe.sources import fetch_model
from tests.conftest import TINY_MODEL


def _experiment(model_dir: Path, args: dict | None = None) -> dict:
    return {
        "name": "rerun-test",
        "model": {"source": "local", "path": str(model_dir)},
        "arms": [
            {
                "name": "gateway",
                "engine": {"kind": "vllm", "args": args or {}},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "tiny"},
            }
        ],
        "workloads": [
            {"name": "w1", "input_tokens": 32, "output_tokens": 4, "concurrency": 1, "num_requests": 3,
             "warmup_requests": 1, "seed": 5},
            {"name": "w2", "input_tokens": 48, "output_tokens": 4, "concurrency": 1, "num_requests": 2,
             "warmup_requests": 0, "seed": 6, "repeats": 2},
        ],
    }  # fmt: skip


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Tracker, str, Path, dict]:
    """An arm run recorded as the flow records it (plan, prompts, finish), on a copy of the tiny model."""
    return _record(tmp_path)


def _record(tmp_path: Path, args: dict | None = None) -> tuple[Tracker, str, Path, dict]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    model_dir = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model_dir)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
    spec = parse_experiment(_experiment(model_dir, args))
    home = tmp_path / "home"
    models = {"model": fetch_model(spec.model, home)}
    prompts = prepare_prompts(spec.workloads, model_dir, home)
    recorder = ArmRecorder(tracker, plan_arm(spec, spec.arms[0], home))
    recorder.log_plan(spec, "experiments/rerun-test.yaml", models)
    recorder.log_prompts(spec.workloads, prompts)
    recorder.finish("FINISHED")
    return tracker, recorder.run_id, home, {k: [prompts_digest(p) for p in v] for k, v in prompts.items()}


def test_the_record_holds_the_inputs_and_restores_them(recorded: tuple[Tracker, str, Path, dict]) -> None:
    tracker, run_id, home, digests = recorded
    record = read_record(tracker, run_id)
    assert record.arm == "gateway"
    assert record.experiment_name == "rerun-test"
    assert record.models["model"].files  # every file with its sha256
    assert {(p.workload, p.repeat) for p in record.prompts} == {("w1", 0), ("w2", 0), ("w2", 1)}
    assert record.prompts_of("w2", 1).count == 2  # type: ignore[union-attr]
    assert record.k3pipe_commit
    said: list[str] = []
    inputs = restore(tracker, run_id[:12], home, progress=said.append)
    assert inputs.run_id == run_id
    assert inputs.drift == []
    assert [a.name for a in inputs.spec.arms] == ["gateway"]
    assert inputs.models["model"].digest() == record.models["model"].digest()
    # the very prompts that were recorded, repeat by repeat
    assert {k: [prompts_digest(p) for p in v] for k, v in inputs.prompts.items()} == digests
    assert digests["w2"][0] != digests["w2"][1]  # each repeat draws its own
    assert any("digests verified" in line for line in said)


def test_a_workload_run_id_finds_its_arm(recorded: tuple[Tracker, str, Path, dict]) -> None:
    tracker, run_id, _home, _ = recorded
    child = tracker.start_run("gateway/w1", tags={"k3pipe.workload": "w1"}, parent_id=run_id)
    assert arm_run(tracker, child).info.run_id == run_id


def test_a_changed_model_file_refuses_the_rerun(recorded: tuple[Tracker, str, Path, dict]) -> None:
    tracker, run_id, home, _ = recorded
    record = read_record(tracker, run_id)
    model_dir = Path(record.models["model"].path)
    with (model_dir / "config.json").open("a") as f:
        f.write("\n")
    with pytest.raises(RerunError) as caught:
        restore(tracker, run_id, home)
    message = str(caught.value)
    assert "changed: config.json" in message
    assert "--allow-drift" in message
    assert f"provenance/model.json of run {run_id}" in message
    inputs = restore(tracker, run_id, home, allow_drift=True)
    assert len(inputs.drift) == 1
    assert "changed: config.json" in inputs.drift[0]


def test_a_missing_model_directory_says_what_is_needed(recorded: tuple[Tracker, str, Path, dict]) -> None:
    tracker, run_id, home, _ = recorded
    shutil.rmtree(read_record(tracker, run_id).models["model"].path)
    with pytest.raises(RerunError, match=r"model: the recorded model cannot be had again: .*does not exist"):
        restore(tracker, run_id, home)


def test_tampered_prompts_refuse_the_rerun(recorded: tuple[Tracker, str, Path, dict], tmp_path: Path) -> None:
    tracker, run_id, home, _ = recorded
    record = read_record(tracker, run_id)
    ref = record.prompts_of("w1", 0)
    assert ref is not None
    local = Path(tracker.client.download_artifacts(run_id, ref.artifact, str(tmp_path)))
    data = json.loads(local.read_text())
    data["prompts"][0]["text"] = data["prompts"][0]["text"][::-1]
    tracker.log_dict(run_id, data, ref.artifact)
    with pytest.raises(RerunError, match="do not match their recorded sha256"):
        restore(tracker, run_id, home)


def test_a_run_without_a_record_cannot_be_rerun(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
    run_id = tracker.start_run("old/arm")
    with pytest.raises(RerunError, match=f"has no {RECORD_FILE}"):
        restore(tracker, run_id, tmp_path)


def test_the_tokenizer_is_the_recorded_models(recorded: tuple[Tracker, str, Path, dict]) -> None:
    """The restored model directory serves the tokenizer the prompts were counted with."""
    tracker, run_id, home, _ = recorded
    inputs = restore(tracker, run_id, home)
    tok = load_tokenizer(Path(inputs.models["model"].path))
    first = inputs.prompts["w1"][0].prompts[0]
    assert len(tok.encode(first.text, add_special_tokens=False).ids) == first.tokens


def test_a_draft_model_the_engine_loads_itself_refuses_an_exact_rerun(tmp_path: Path) -> None:
    spec_config = {"model": "org/draft-1b", "method": "eagle", "num_speculative_tokens": 2}
    tracker, run_id, home, _ = _record(tmp_path, {"speculative_config": spec_config})
    record = read_record(tracker, run_id)
    assert record.unpinned_models == ["engine.args.speculative_config.model=org/draft-1b"]
    with pytest.raises(RerunError, match=r"speculative_config\.model=org/draft-1b was loaded by the engine"):
        restore(tracker, run_id, home)
    inputs = restore(tracker, run_id, home, allow_drift=True)
    (drift,) = inputs.drift
    assert drift.startswith("engine.args.speculative_config.model=org/draft-1b was loaded by the engine")


def test_a_draft_model_k3pipe_fetched_is_pinned(tmp_path: Path) -> None:
    tracker, run_id, home, _ = _record(
        tmp_path, {"speculative_config": {"model": "{model}", "method": "eagle", "num_speculative_tokens": 2}}
    )
    assert read_record(tracker, run_id).unpinned_models == []
    assert restore(tracker, run_id, home).drift == []


def test_a_secret_written_in_the_experiment_refuses_a_rerun_and_a_reference_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A literal key in an experiment is refused when it is parsed now; a record made before that
    rule holds '***' in its place, and a rerun of it (which would start the engine with '***') is
    refused naming the field and the '{env.NAME}' way. A reference is restored as written."""
    import k3pipe.schema.arms

    with pytest.raises(SpecError, match=r"args\.api_key: a literal secret"):
        parse_experiment(_experiment(tmp_path, {"api_key": "literal-key-0123456789"}))
    with monkeypatch.context() as older:  # a record of a k3pipe without the refusal
        older.setattr(k3pipe.schema.arms, "_refuse_literal_secret", lambda *_args: None)
        tracker, run_id, home, _ = _record(tmp_path / "literal", args={"api_key": "literal-key-0123456789"})
    with pytest.raises(RerunError, match=r"engine\.args\.api_key.*\{env\.NAME\}"):
        restore(tracker, run_id, home)
    assert "literal-key-0123456789" not in (read_record(tracker, run_id).model_dump_json())
    tracker, run_id, home, _ = _record(tmp_path / "reference", args={"api_key": "{env.RERUN_TEST_KEY}"})
    inputs = restore(tracker, run_id, home)
    assert inputs.spec.arms[0].engine.args == {"api_key": "{env.RERUN_TEST_KEY}"}


def test_a_rerun_after_the_hub_moved_uses_the_kept_files_or_names_what_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model from a (fake) ModelScope hub, recorded by content. The hub's master then moves (new
    weights): the rerun still finds the recorded files, kept in their own content directory, and asks
    the hub for nothing; with that directory gone it says which file moved and fetches nothing."""
    from k3pipe.testing.fakehub import client_pointed_at_fake_hub

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    files = {
        p.relative_to(TINY_MODEL).as_posix(): p.read_bytes() for p in TINY_MODEL.rglob("*") if p.is_file()
    }
    weights = next(f for f in files if f.endswith(".safetensors"))
    with client_pointed_at_fake_hub({"acme/tiny": {"master": dict(files)}}, monkeypatch, tmp_path) as hub:
        data = _experiment(tmp_path)
        data["model"] = {"source": "modelscope", "id": "acme/tiny", "revision": "master"}
        spec = parse_experiment(data)
        home = tmp_path / "home"
        tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
        models = {"model": fetch_model(spec.model, home)}
        assert models["model"].resolved_revision == f"sha256:{models['model'].digest()}"
        prompts = prepare_prompts(spec.workloads, Path(models["model"].path), home)
        recorder = ArmRecorder(tracker, plan_arm(spec, spec.arms[0], home))
        recorder.log_plan(spec, "experiments/rerun-test.yaml", models)
        recorder.log_prompts(spec.workloads, prompts)
        recorder.finish("FINISHED")

        moved = bytearray(files[weights])
        moved[-1] ^= 0xFF
        hub.models["acme/tiny"]["master"] = {**files, weights: bytes(moved)}
        hub.requests.clear()
        again = restore(tracker, recorder.run_id, home)
        assert again.drift == []
        assert again.models["model"].path == models["model"].path
        assert hub.snapshot() == []  # the recorded files were on this machine: the hub was not asked

        shutil.rmtree(models["model"].path)
        with pytest.raises(RerunError) as info:
            restore(tracker, recorder.run_id, home)
        message = str(info.value)
        assert "acme/tiny@master has moved since the recorded run" in message
        assert f"changed: {weights}" in message
        assert "nothing was fetched" in message
        assert hub.file_gets() == []  # only the listing was asked for
