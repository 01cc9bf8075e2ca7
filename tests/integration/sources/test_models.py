"""fetch_model against the real modelscope client and a fake hub on 127.0.0.1, and on local dirs."""

from __future__ import annotations

import hashlib
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelscope_hub import set_default_config

import k3pipe.sources
from k3pipe.core.errors import ModelSourceError
from k3pipe.schema.specs import LocalModel, ModelScopeModel
from k3pipe.sources import ModelRecord, content_dir_name, fetch_model, model_dir
from k3pipe.testing.fakehub import FakeHub, client_pointed_at_fake_hub

MODEL_ID = "acme/tiny-llm"


def _weights(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def tiny_model_files() -> dict[str, dict[str, bytes]]:
    """Two revisions of a small model; v2 changes the weights only."""
    master = {
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}',
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
        "model.safetensors": _weights(0, 300_000),
        "README.md": b"# tiny\n",
        "extra/notes.txt": b"not needed by the engine\n",
        "extra/deep/blob.bin": _weights(1, 5_000),
    }
    return {"master": master, "v2": {**master, "model.safetensors": _weights(2, 300_000)}}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running fake hub serving MODEL_ID, with the modelscope client pointed at it."""
    with client_pointed_at_fake_hub({MODEL_ID: tiny_model_files()}, monkeypatch, tmp_path) as fake:
        yield fake


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The K3PIPE_HOME state directory of a test."""
    path = tmp_path / "k3home"  # the K3PIPE_HOME that tests/conftest.py's clean_environ sets
    path.mkdir(exist_ok=True)
    return path


FILES = tiny_model_files()["master"]


def _spec(**kw: object) -> ModelScopeModel:
    return ModelScopeModel.model_validate({"source": "modelscope", "id": MODEL_ID, **kw})


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _all_files(*roots: Path) -> list[Path]:
    return [Path(d, f) for root in roots for d, _, fs in os.walk(root) for f in fs]


def test_public_surface() -> None:
    assert k3pipe.sources.__all__ == [
        "ModelRecord",
        "changed_files",
        "content_dir_name",
        "fetch_model",
        "hub_files",
        "model_dir",
        "recorded_dir",
        "verify_dir",
    ]


def test_model_dir_layout(home: Path) -> None:
    assert model_dir(_spec(revision="v2"), home) == (home / "models" / "acme" / "tiny-llm" / "v2").resolve()
    local = LocalModel(source="local", path="{home}/made/tiny")
    assert model_dir(local, home) == (home / "made" / "tiny").resolve()


def test_download_records_files_hashes_path_and_revision(hub: FakeHub, home: Path) -> None:
    messages: list[str] = []
    rec = fetch_model(_spec(), home, progress=messages.append)

    target = home / "models" / "acme" / "tiny-llm" / "master"
    # kept by content: the files in sha256-<digest>, the revision a link to it
    assert target.is_symlink()
    assert rec.path == str(target.resolve())
    assert Path(rec.path).name == f"sha256-{rec.digest()[:16]}"
    assert Path(rec.path).is_absolute()
    assert rec.files == {p: _sha(b) for p, b in FILES.items()}
    for rel, data in FILES.items():
        assert (target / rel).read_bytes() == data
    assert rec.total_bytes == sum(len(b) for b in FILES.values())
    assert (rec.source, rec.model_id) == ("modelscope", MODEL_ID)
    # what was fetched is named by its content, never by the branch it was asked for by
    assert rec.requested_revision == "master"
    assert rec.resolved_revision == f"sha256:{rec.digest()}"
    assert rec.downloaded is True
    assert rec.duration_s > 0
    # each file fetched (the real client may GET one again: its own retries), at the requested
    # revision, and nothing but the file API was asked for
    assert {r.query["FilePath"] for r in hub.file_gets()} == set(FILES)
    assert {r.query["Revision"] for r in hub.snapshot() if "Revision" in r.query} == {"master"}
    assert all(r.status == 200 for r in hub.snapshot()), hub.snapshot()
    assert any(m.startswith("listing ") for m in messages)
    assert {f"downloaded {p}" for p in FILES} <= set(messages)


def test_other_revision_lands_in_its_own_dir(hub: FakeHub, home: Path) -> None:
    master = fetch_model(_spec(), home)
    v2 = fetch_model(_spec(revision="v2"), home)
    assert v2.path != master.path
    assert model_dir(_spec(revision="v2"), home) == Path(v2.path)
    assert v2.files["model.safetensors"] == _sha(tiny_model_files()["v2"]["model.safetensors"])
    assert v2.files["model.safetensors"] != master.files["model.safetensors"]
    assert v2.resolved_revision == f"sha256:{v2.digest()}"


def test_second_call_downloads_nothing(hub: FakeHub, home: Path) -> None:
    first = fetch_model(_spec(), home)
    hub.requests.clear()
    messages: list[str] = []
    second = fetch_model(_spec(), home, progress=messages.append)

    assert hub.file_gets() == []
    assert second.downloaded is False
    assert second.files == first.files
    assert second.digest() == first.digest()
    assert {f"verified {p}" for p in FILES} <= set(messages)
    # the hashes are checked against the hub's listing, so the hub is still asked for it (and only
    # for it; the client may retry a listing that a loaded machine answered slowly)
    assert {r.path for r in hub.snapshot()} == {f"/api/v1/models/{MODEL_ID}/repo/files"}


def test_missing_file_fetches_only_that_file(hub: FakeHub, home: Path) -> None:
    fetch_model(_spec(), home)
    target = model_dir(_spec(), home)
    (target / "extra/deep/blob.bin").unlink()
    hub.requests.clear()

    rec = fetch_model(_spec(), home)

    assert {r.query["FilePath"] for r in hub.file_gets()} == {"extra/deep/blob.bin"}
    assert rec.downloaded is True
    assert (target / "extra/deep/blob.bin").read_bytes() == FILES["extra/deep/blob.bin"]
    assert rec.files == {p: _sha(b) for p, b in FILES.items()}


def test_tampered_local_file_is_fetched_again(hub: FakeHub, home: Path) -> None:
    fetch_model(_spec(), home)
    weights = model_dir(_spec(), home) / "model.safetensors"
    weights.write_bytes(b"\0" * len(FILES["model.safetensors"]))  # same size, wrong bytes
    hub.requests.clear()

    rec = fetch_model(_spec(), home)

    # only the tampered file is fetched again; the real client may GET it more than once (its own
    # recovery and integrity retries: two GETs of it once, in a fresh-clone run on three busy workers)
    fetched = [r.query["FilePath"] for r in hub.file_gets()]
    assert set(fetched) == {"model.safetensors"}
    assert len(fetched) <= 3
    assert weights.read_bytes() == FILES["model.safetensors"]
    assert rec.files["model.safetensors"] == _sha(FILES["model.safetensors"])


def test_corrupted_download_fails_and_leaves_nothing_behind(hub: FakeHub, home: Path, tmp_path: Path) -> None:
    hub.corrupt(MODEL_ID, "model.safetensors")
    with pytest.raises(ModelSourceError) as err:
        fetch_model(_spec(), home)

    msg = str(err.value)
    served = hub.served_bytes(MODEL_ID, "master", "model.safetensors")
    for part in ("model.safetensors", MODEL_ID, "'master'", hub.url):
        assert part in msg
    assert _sha(FILES["model.safetensors"]) in msg  # expected hash, in full
    assert _sha(served)[:16] in msg  # the client reports only a prefix of the actual one
    assert isinstance(err.value.__cause__, Exception)
    # the client retried the bad file before giving up (3 attempts in modelscope-hub 0.5.1)
    assert len(hub.file_gets("model.safetensors")) >= 2
    # the good files are kept where the listing's content goes (the revision points there once a
    # fetch succeeds)
    listed = ModelRecord(
        source="modelscope", model_id=MODEL_ID, requested_revision="master", resolved_revision=None,
        path="/", files={p: _sha(b) for p, b in FILES.items()}, total_bytes=0, downloaded=False, duration_s=0,
    )  # fmt: skip
    target = home / "models" / "acme" / "tiny-llm" / content_dir_name(listed.digest())
    assert not (home / "models" / "acme" / "tiny-llm" / "master").exists()
    leftovers = [
        p
        for p in _all_files(target, home / "modelscope-cache", tmp_path / "ms-cache")
        if "model.safetensors" in p.name or p.name.endswith((".incomplete", ".parallel_tmp"))
    ]
    assert leftovers == []
    assert (target / "config.json").read_bytes() == FILES["config.json"]  # good files are kept

    # once the hub serves the right bytes, only the failed file is fetched
    hub.corrupted.clear()
    hub.requests.clear()
    rec = fetch_model(_spec(), home)
    assert {r.query["FilePath"] for r in hub.file_gets()} == {"model.safetensors"}
    assert rec.files["model.safetensors"] == _sha(FILES["model.safetensors"])


def test_unknown_model_id(hub: FakeHub, home: Path) -> None:
    spec = ModelScopeModel(source="modelscope", id="acme/no-such-model")
    with pytest.raises(ModelSourceError) as err:
        fetch_model(spec, home)
    msg = str(err.value)
    for part in ("acme/no-such-model", "'master'", hub.url, "model.id"):  # model.id: what to check
        assert part in msg
    assert hub.file_gets() == []
    assert not model_dir(spec, home).exists()


def test_unknown_model_answered_with_code_not_200(hub: FakeHub, home: Path) -> None:
    # HTTP 200 with {"Code": <not 200>}: the client sees an empty listing and would report success
    hub.code_errors.add("acme/gone")
    with pytest.raises(ModelSourceError, match=r"acme/gone.*lists no files"):
        fetch_model(ModelScopeModel(source="modelscope", id="acme/gone"), home)
    assert hub.file_gets() == []


def test_unknown_revision(hub: FakeHub, home: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"revision 'no-such-branch'.*model\.revision"):
        fetch_model(_spec(revision="no-such-branch"), home)


def test_unreachable_hub(monkeypatch: pytest.MonkeyPatch, hub: FakeHub, home: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", dead)
    set_default_config(None)
    # the client retries the listing 4 times with backoff (about 7 s) before giving up
    with pytest.raises(ModelSourceError, match=r"could not list .*acme/tiny-llm.*MODELSCOPE_ENDPOINT") as err:
        fetch_model(_spec(), home)
    assert dead in str(err.value)


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (["*.json"], {"config.json", "tokenizer.json"}),
        (["*.json", "*.safetensors"], {"config.json", "tokenizer.json", "model.safetensors"}),
        (["extra/*"], {"extra/notes.txt", "extra/deep/blob.bin"}),  # fnmatch's '*' crosses '/'
    ],
)
def test_allow_patterns(hub: FakeHub, home: Path, patterns: list[str], expected: set[str]) -> None:
    rec = fetch_model(_spec(allow_patterns=patterns), home)
    assert set(rec.files) == expected
    assert {r.query["FilePath"] for r in hub.file_gets()} == expected
    on_disk = {p.relative_to(rec.path).as_posix() for p in _all_files(Path(rec.path))}
    assert on_disk == expected

    hub.requests.clear()
    again = fetch_model(_spec(allow_patterns=patterns), home)
    assert again.downloaded is False
    assert hub.file_gets() == []


def test_allow_patterns_matching_nothing(hub: FakeHub, home: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"allow_patterns \['\*\.gguf'\] match none.*config\.json"):
        fetch_model(_spec(allow_patterns=["*.gguf"]), home)


# -- local --------------------------------------------------------------------------------------


def _make_local(root: Path) -> dict[str, bytes]:
    files = {"config.json": b"{}", "model.safetensors": b"weights", "sub/tokenizer.json": b'{"a": 1}'}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    return files


def test_local_model(home: Path) -> None:
    files = _make_local(home / "made" / "tiny")
    messages: list[str] = []
    rec = fetch_model(LocalModel(source="local", path="{home}/made/tiny"), home, progress=messages.append)
    assert rec.path == str((home / "made" / "tiny").resolve())
    assert rec.files == {p: _sha(b) for p, b in files.items()}  # .git skipped
    assert rec.total_bytes == sum(len(b) for b in files.values())
    assert (rec.source, rec.model_id, rec.resolved_revision, rec.downloaded) == ("local", None, None, False)
    assert "hashing sub/tokenizer.json" in messages


def test_local_missing_dir(home: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"model\.path '\{home\}/nowhere'.*does not exist") as err:
        fetch_model(LocalModel(source="local", path="{home}/nowhere"), home)
    assert str(home / "nowhere") in str(err.value)


def test_local_dir_without_config(home: Path) -> None:
    (home / "weights").mkdir()
    (home / "weights" / "model.safetensors").write_bytes(b"w")
    with pytest.raises(ModelSourceError, match=r"model\.path.*has no config\.json") as err:
        fetch_model(LocalModel(source="local", path=str(home / "weights")), home)
    assert str(home / "weights") in str(err.value)


# -- digest -------------------------------------------------------------------------------------


def test_digest_is_stable_and_follows_the_files(home: Path) -> None:
    root = home / "m"
    _make_local(root)
    spec = LocalModel(source="local", path=str(root))
    first, second = fetch_model(spec, home), fetch_model(spec, home)
    assert first.digest() == second.digest()
    assert len(first.digest()) == 64

    # order of the mapping does not matter, content and names do
    shuffled = ModelRecord.model_validate(
        {**first.model_dump(), "files": dict(reversed(first.files.items()))}
    )
    assert shuffled.digest() == first.digest()
    (root / "model.safetensors").write_bytes(b"other weights")
    assert fetch_model(spec, home).digest() != first.digest()
    renamed = {("renamed.json" if k == "config.json" else k): v for k, v in first.files.items()}
    assert first.model_copy(update={"files": renamed}).digest() != first.digest()


def test_record_is_frozen(home: Path) -> None:
    (home / "m").mkdir()
    (home / "m" / "config.json").write_bytes(b"{}")
    rec = fetch_model(LocalModel(source="local", path=str(home / "m")), home)
    with pytest.raises(ValueError, match="frozen"):
        rec.path = "/elsewhere"  # type: ignore[misc]


def test_a_moved_branch_is_fetched_beside_what_it_was_and_says_what_moved(hub: FakeHub, home: Path) -> None:
    """The hub's master moves (new weights): the next fetch keeps the first one's files intact in their
    own content directory, fetches only the changed file (the others linked), says what moved file by
    file, and points master at the new content."""
    first = fetch_model(_spec(), home)
    moved = {**FILES, "model.safetensors": _weights(9, 300_000)}
    hub.models[MODEL_ID]["master"] = moved
    hub.requests.clear()
    messages: list[str] = []

    second = fetch_model(_spec(), home, progress=messages.append)

    assert second.path != first.path
    assert second.resolved_revision != first.resolved_revision
    assert {r.query["FilePath"] for r in hub.file_gets()} == {"model.safetensors"}
    said = next(m for m in messages if "has moved since it was last fetched" in m)
    assert "changed: model.safetensors" in said
    assert first.path in said
    # the first fetch's files are all still there, byte for byte
    for rel, data in FILES.items():
        assert (Path(first.path) / rel).read_bytes() == data
    assert model_dir(_spec(), home) == Path(second.path)
    assert (Path(second.path) / "model.safetensors").read_bytes() == moved["model.safetensors"]
    # an unchanged file is the same inode in both (linked, not copied)
    assert (Path(first.path) / "config.json").stat().st_ino == (
        Path(second.path) / "config.json"
    ).stat().st_ino
    # each file's own commit as the listing gives it: the changed file's is new, the others kept
    assert set(first.file_revisions) == set(FILES) == set(second.file_revisions)
    assert {f for f in FILES if first.file_revisions[f] != second.file_revisions[f]} == {"model.safetensors"}


def test_a_home_from_before_content_directories_is_moved_aside_and_reused(hub: FakeHub, home: Path) -> None:
    """models/OWNER/NAME/master as a directory of its own (how k3pipe kept models before): its files
    are linked into the content directory (nothing downloaded again), and it is moved aside."""
    legacy = home / "models" / "acme" / "tiny-llm" / "master"
    for rel, data in FILES.items():
        (legacy / rel).parent.mkdir(parents=True, exist_ok=True)
        (legacy / rel).write_bytes(data)
    messages: list[str] = []
    rec = fetch_model(_spec(), home, progress=messages.append)
    assert hub.file_gets() == []
    assert legacy.is_symlink()
    assert Path(rec.path).name.startswith("sha256-")
    assert (legacy.parent / "master.before-content-dirs" / "config.json").is_file()
    assert any("moved to" in m for m in messages)
