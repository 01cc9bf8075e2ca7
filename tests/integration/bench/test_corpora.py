"""Workload datasets: random, shared-prefix, ShareGPT and documents prompts, and their PromptSet.

ShareGPT and documents use the generated fixtures in tests/fixtures/datasets
(scripts/make_dataset_fixtures.py); edge cases write their own small files under tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer

import k3pipe.prompts.corpus_tools as corpus_tools
import k3pipe.prompts.datasets as datasets
import k3pipe.prompts.documents as documents
import k3pipe.prompts.sharegpt as sharegpt
from k3pipe.bench import PromptSet, build_prompts, random_prompts, shared_prefix_prompts
from k3pipe.core.errors import BenchmarkError
from k3pipe.schema.specs import DocumentsDataset, RandomDataset, SharedPrefixDataset, ShareGPTDataset

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "datasets"
SHAREGPT = FIXTURES / "sharegpt_small.json"
DOCUMENTS = FIXTURES / "documents"


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    """Each test starts as a new process would: no ShareGPT file or documents sample kept."""
    sharegpt._FIRST_TURNS.clear()
    documents._SAMPLES.clear()
    yield
    sharegpt._FIRST_TURNS.clear()
    documents._SAMPLES.clear()


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _sharegpt(path: Path | str = SHAREGPT, min_input_tokens: int = 4) -> ShareGPTDataset:
    return ShareGPTDataset(kind="sharegpt", path=str(path), min_input_tokens=min_input_tokens)


def _documents(path: Path | str = DOCUMENTS, glob: str = "*.txt") -> DocumentsDataset:
    return DocumentsDataset(kind="documents", path=str(path), glob=glob)


def _write_sharegpt(path: Path, items: list[Any]) -> Path:
    path.write_text(json.dumps(items), encoding="utf-8")
    return path


def _first_human_turns() -> list[str]:
    out = []
    for item in json.loads(SHAREGPT.read_text(encoding="utf-8")):
        for turn in item["conversations"]:
            if turn["from"] in ("human", "user"):
                out.append(turn["value"])
                break
    return out


# --- random and shared prefix ---------------------------------------------------------------------


def test_random_delegates_and_names_itself(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    got = build_prompts(RandomDataset(), byte_level_tokenizer, 5, 64, 3, tmp_path)
    assert got.prompts == random_prompts(byte_level_tokenizer, 5, 64, 3)
    assert got.name == "random-in64-s3"
    assert (got.source, got.source_type) == ("generated:random", "generated")
    assert re.fullmatch(r"[0-9a-f]{16}", got.digest)
    assert got.profile == {
        "kind": "random",
        "seed": 3,
        "repeat": 0,
        "count": 5,
        "tokens_min": 64,
        "tokens_mean": 64.0,
        "tokens_max": 64,
    }


def test_digests_are_stable_and_differ_across_seeds_and_kinds(
    byte_level_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    def digest(dataset: Any, seed: int) -> str:
        return build_prompts(dataset, byte_level_tokenizer, 6, 128, seed, tmp_path).digest

    shared = SharedPrefixDataset(kind="shared_prefix", prefix_tokens=64, groups=2)
    for dataset in (RandomDataset(), shared, _sharegpt(), _documents()):
        assert digest(dataset, 1) == digest(dataset, 1)
        assert digest(dataset, 1) != digest(dataset, 2)
    assert digest(RandomDataset(), 1) != digest(shared, 1)


@pytest.mark.parametrize("fallback", [False, True], ids=["words", "whole-vocabulary"])
def test_shared_prefix_is_an_exact_token_prefix(
    tokenizer: Tokenizer, fallback: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if fallback:  # any ordinary token, with tail refits that must leave the prefix alone
        monkeypatch.setattr(datasets, "_MIN_WORD_TOKENS", 10**9)
    dataset = SharedPrefixDataset(kind="shared_prefix", prefix_tokens=120, groups=3)
    got = build_prompts(dataset, tokenizer, 8, 200, 5, tmp_path)
    assert got.name == "shared_prefix-p120x3-in200-s5"
    assert (got.profile["prefix_tokens"], got.profile["groups"]) == (120, 3)
    ids = [_ids(tokenizer, p.text) for p in got.prompts]
    assert all(len(i) == 200 and p.tokens == 200 for i, p in zip(ids, got.prompts, strict=True))
    assert len({p.text for p in got.prompts}) == 8
    for i, p in enumerate(got.prompts):
        prefix_ids = ids[i][:120]
        assert prefix_ids == ids[i % 3][:120]  # the group's prefix, token for token
        head = tokenizer.decode(prefix_ids)
        if tokenizer.decoder.__class__.__name__ != "WordPiece":  # its decode tidies spaces away
            assert p.text.startswith(head)
        assert _ids(tokenizer, head) == prefix_ids  # the prefix alone encodes to those very tokens
    starts = {tuple(i[:120]) for i in ids}
    assert len(starts) == 3  # three groups, three different prefixes
    # the suffixes differ right after the prefix within a group
    assert ids[0][120:130] != ids[3][120:130]


def test_shared_prefix_is_deterministic_and_prefix_stable(byte_level_tokenizer: Tokenizer) -> None:
    few = shared_prefix_prompts(byte_level_tokenizer, 2, 80, 40, 4, 9)  # fewer prompts than groups
    more = shared_prefix_prompts(byte_level_tokenizer, 6, 80, 40, 4, 9)
    assert more[:2] == few
    assert shared_prefix_prompts(byte_level_tokenizer, 6, 80, 40, 4, 10) != more
    # no prefix is a random prompt of the same seed and length (their streams are kept apart)
    prefixes = {tuple(_ids(byte_level_tokenizer, p.text)[:40]) for p in more}
    plain_prompts = random_prompts(byte_level_tokenizer, 4, 40, 9)
    plain = {tuple(_ids(byte_level_tokenizer, p.text)) for p in plain_prompts}
    assert len(prefixes) == 4
    assert prefixes.isdisjoint(plain)


def test_shared_prefix_bad_sizes(byte_level_tokenizer: Tokenizer) -> None:
    with pytest.raises(BenchmarkError, match="prefix_tokens"):
        shared_prefix_prompts(byte_level_tokenizer, 2, 50, 50, 1, 0)
    with pytest.raises(BenchmarkError, match="groups"):
        shared_prefix_prompts(byte_level_tokenizer, 2, 50, 10, 0, 0)


@pytest.mark.parametrize("kind", ["random", "shared_prefix"])
def test_random_kinds_draw_repeat_k_with_seed_plus_k(
    byte_level_tokenizer: Tokenizer, kind: str, tmp_path: Path
) -> None:
    dataset: Any = (
        RandomDataset() if kind == "random" else SharedPrefixDataset(kind="shared_prefix", prefix_tokens=20)
    )
    base = build_prompts(dataset, byte_level_tokenizer, 3, 48, 3, tmp_path)
    assert build_prompts(dataset, byte_level_tokenizer, 3, 48, 3, tmp_path, repeat=0) == base
    got = build_prompts(dataset, byte_level_tokenizer, 3, 48, 3, tmp_path, repeat=2)
    as_seed_5 = build_prompts(dataset, byte_level_tokenizer, 3, 48, 5, tmp_path)
    assert got.prompts == as_seed_5.prompts
    assert (got.name, got.digest) == (as_seed_5.name, as_seed_5.digest)
    assert got.name.endswith("-s5")
    assert (got.profile["seed"], got.profile["repeat"]) == (5, 2)
    assert {p.text for p in got.prompts}.isdisjoint(p.text for p in base.prompts)
    with pytest.raises(BenchmarkError, match="repeat must be >= 0"):
        build_prompts(dataset, byte_level_tokenizer, 3, 48, 3, tmp_path, repeat=-1)


# --- sharegpt ------------------------------------------------------------------------------------


def test_sharegpt_samples_first_human_turns(tokenizer: Tokenizer, tmp_path: Path) -> None:
    got = build_prompts(_sharegpt(), tokenizer, 40, 256, 0, tmp_path)
    firsts = _first_human_turns()
    distinct = list(dict.fromkeys(firsts))
    counts = [len(_ids(tokenizer, t)) for t in distinct]
    passed = [t for t, c in zip(distinct, counts, strict=True) if 4 <= c <= 256]
    assert len(got.prompts) == 40
    for p in got.prompts:
        assert p.text in passed
        assert p.tokens == len(_ids(tokenizer, p.text))  # the real count, not input_tokens
        assert 4 <= p.tokens <= 256
    assert got.name == "sharegpt:sharegpt_small.json"
    assert (got.source, got.source_type) == (str(SHAREGPT), "local")
    profile = got.profile
    assert profile["conversations"] == 200
    assert profile["with_human_turn"] == len(firsts)
    assert profile["distinct_first_turns"] == len(distinct)
    assert profile["passed_filter"] == len(passed)
    assert (profile["min_input_tokens"], profile["max_input_tokens"]) == (4, 256)
    assert profile["count"] == 40
    assert profile["tokens_min"] == min(p.tokens for p in got.prompts)
    assert profile["tokens_max"] == max(p.tokens for p in got.prompts)


def test_sharegpt_is_seeded_and_prefix_stable(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    a = build_prompts(_sharegpt(), byte_level_tokenizer, 10, 512, 7, tmp_path)
    b = build_prompts(_sharegpt(), byte_level_tokenizer, 20, 512, 7, tmp_path)
    c = build_prompts(_sharegpt(), byte_level_tokenizer, 10, 512, 8, tmp_path)
    assert a == build_prompts(_sharegpt(), byte_level_tokenizer, 10, 512, 7, tmp_path)
    assert b.prompts[:10] == a.prompts
    assert c.prompts != a.prompts
    assert len({p.text for p in b.prompts}) == 20  # no conversation drawn twice


def test_sharegpt_length_filter_is_inclusive(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    lengths = [3, 4, 5, 9, 10, 11]
    texts = [random_prompts(byte_level_tokenizer, 1, k, k)[0].text for k in lengths]
    items = [{"conversations": [{"from": "human", "value": t}]} for t in texts]
    path = _write_sharegpt(tmp_path / "sized.json", items)
    got = build_prompts(_sharegpt(path, min_input_tokens=4), byte_level_tokenizer, 4, 10, 0, tmp_path)
    assert sorted(p.tokens for p in got.prompts) == [4, 5, 9, 10]
    assert got.profile["passed_filter"] == 4
    with pytest.raises(BenchmarkError) as info:
        build_prompts(_sharegpt(path, min_input_tokens=4), byte_level_tokenizer, 5, 10, 0, tmp_path)
    message = str(info.value)
    assert "only 4 of its 6 conversations" in message
    assert "4 to 10 tokens" in message
    assert "3 to 11 tokens" in message  # where the first turns really are
    assert "workloads[].dataset.path" in message
    assert "num_requests" in message
    assert "min_input_tokens" in message


def test_sharegpt_bounds_that_cannot_hold(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match=r"min_input_tokens \(65\) is above the workload's input_tokens"):
        build_prompts(_sharegpt(min_input_tokens=65), byte_level_tokenizer, 1, 64, 0, tmp_path)


def test_sharegpt_too_few_in_the_fixture(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match=r"only \d+ of its 200 conversations .* needs 150 prompts"):
        build_prompts(_sharegpt(), byte_level_tokenizer, 150, 64, 0, tmp_path)


def test_sharegpt_turn_shapes(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    def conversation(*turns: tuple[str, str]) -> dict[str, Any]:
        return {"id": "x", "conversations": [{"from": who, "value": value} for who, value in turns]}

    items = [
        conversation(("system", "Be brief."), ("human", "alpha one")),
        conversation(("gpt", "Hello there."), ("user", "beta two")),
        conversation(("Human", "gamma three"), ("gpt", "ok")),
        conversation(("gpt", "only the model speaks")),
        conversation(),
        conversation(("human", "")),  # empty: 0 tokens, filtered out
        conversation(("human", "delta four"), ("human", "no")),
        conversation(("human", "alpha one")),  # the same prompt again: drawn once at most
    ]
    path = _write_sharegpt(tmp_path / "shapes.json", items)
    got = build_prompts(_sharegpt(path, min_input_tokens=1), byte_level_tokenizer, 4, 64, 0, tmp_path)
    assert sorted(p.text for p in got.prompts) == ["alpha one", "beta two", "delta four", "gamma three"]
    assert got.profile["conversations"] == 8
    assert got.profile["with_human_turn"] == 6
    assert got.profile["distinct_first_turns"] == 5
    assert got.profile["passed_filter"] == 4
    with pytest.raises(BenchmarkError, match="only 4 of its 8 conversations have a distinct first"):
        build_prompts(_sharegpt(path, min_input_tokens=1), byte_level_tokenizer, 5, 64, 0, tmp_path)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('[{"conversations": [}', r"not valid JSON: .* line 1 column"),
        ('{"conversations": []}', "holds a JSON object, not a list of conversations"),
        ('"text"', "holds a JSON string"),
        ('[{"conversations": []}, {"turns": []}]', "conversation 1 has no 'conversations' list"),
        ('[{"conversations": [{"value": "hi"}]}]', "conversation 0, turn 0 has no 'from' string"),
        ('[{"conversations": ["hi"]}]', "conversation 0, turn 0 has no 'from' string"),
        ('[{"conversations": [{"from": "human", "value": 3}]}]', "turn 0 .* has no 'value' string"),
    ],
)
def test_sharegpt_malformed_file(
    byte_level_tokenizer: Tokenizer, tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(BenchmarkError, match=expected) as info:
        build_prompts(_sharegpt(path), byte_level_tokenizer, 1, 64, 0, tmp_path)
    assert str(path) in str(info.value)


def test_sharegpt_not_utf8(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes('[{"conversations": [{"from": "human", "value": "café"}]}]'.encode("latin-1"))
    with pytest.raises(BenchmarkError, match="is not UTF-8"):
        build_prompts(_sharegpt(path), byte_level_tokenizer, 1, 64, 0, tmp_path)


def test_sharegpt_paths(
    byte_level_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    shutil.copy(SHAREGPT, home / "data" / "sg.json")
    got = build_prompts(_sharegpt("{home}/data/sg.json"), byte_level_tokenizer, 3, 64, 0, home)
    assert got.source == str(home / "data" / "sg.json")
    assert got.name == "sharegpt:sg.json"
    monkeypatch.chdir(home)
    relative = build_prompts(_sharegpt("data/../data/sg.json"), byte_level_tokenizer, 3, 64, 0, home)
    assert relative.source == str(home / "data" / "sg.json")  # absolute and normalised
    assert relative.prompts == got.prompts

    with pytest.raises(BenchmarkError) as info:
        build_prompts(_sharegpt("{home}/missing.json"), byte_level_tokenizer, 1, 64, 0, home)
    message = str(info.value)
    assert "workloads[].dataset.path '{home}/missing.json'" in message
    assert str(home / "missing.json") in message
    assert "does not exist" in message
    with pytest.raises(BenchmarkError, match="is a folder"):
        build_prompts(_sharegpt(home / "data"), byte_level_tokenizer, 1, 64, 0, home)


def test_sharegpt_repeats_take_disjoint_blocks_of_one_sample(
    byte_level_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    # Repeat k used to draw a new permutation with seed + k from the same pool, resending about
    # n * n / pool prompts of the earlier repeats (then answered from the prefix cache).
    whole = build_prompts(_sharegpt(), byte_level_tokenizer, 40, 512, 7, tmp_path)
    repeats = [
        build_prompts(_sharegpt(), byte_level_tokenizer, 10, 512, 7, tmp_path, repeat=k) for k in range(4)
    ]
    assert repeats[0] == build_prompts(_sharegpt(), byte_level_tokenizer, 10, 512, 7, tmp_path)
    assert [p for r in repeats for p in r.prompts] == whole.prompts
    assert len({p.text for p in whole.prompts}) == 40  # no prompt sent by two repeats
    for k, r in enumerate(repeats):
        assert (r.profile["seed"], r.profile["repeat"], r.profile["slice"]) == (7, k, [10 * k, 10 * k + 10])
    assert len({r.digest for r in repeats}) == 4
    assert whole.profile["slice"] == [0, 40]


def test_sharegpt_repeats_that_run_out(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    passed = build_prompts(_sharegpt(), byte_level_tokenizer, 0, 64, 0, tmp_path).profile["passed_filter"]
    n = passed // 3 + 1  # two repeats fit, the third does not
    assert len(build_prompts(_sharegpt(), byte_level_tokenizer, n, 64, 0, tmp_path, repeat=1).prompts) == n
    with pytest.raises(BenchmarkError) as info:
        build_prompts(_sharegpt(), byte_level_tokenizer, n, 64, 0, tmp_path, repeat=2)
    message = str(info.value)
    assert f"only {passed} of its 200 conversations" in message
    assert "of 4 to 64 tokens" in message
    assert f"repeat 2 needs {3 * n} in all" in message
    assert f"warmup_requests + num_requests = {n} prompts" in message
    for name in ("workloads[].dataset.path", "min_input_tokens", "input_tokens", "workloads[].repeats"):
        assert name in message


def test_sharegpt_file_is_read_once_per_process(
    byte_level_tokenizer: Tokenizer,
    metaspace_tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads: list[Path] = []
    encoded: list[int] = []
    load, count = sharegpt._load_sharegpt, sharegpt._token_counts

    def counting_load(value: str, path: Path) -> list[Any]:
        loads.append(path)
        return load(value, path)

    def counting_encode(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
        encoded.append(len(texts))
        return count(tokenizer, texts)

    monkeypatch.setattr(sharegpt, "_load_sharegpt", counting_load)
    monkeypatch.setattr(sharegpt, "_token_counts", counting_encode)
    path = tmp_path / "sg.json"
    shutil.copy(SHAREGPT, path)
    first = build_prompts(_sharegpt(path), byte_level_tokenizer, 5, 256, 0, tmp_path)
    again = [
        build_prompts(_sharegpt(path), byte_level_tokenizer, 5, 256, 0, tmp_path),
        build_prompts(_sharegpt(path), byte_level_tokenizer, 5, 256, 3, tmp_path),
        build_prompts(_sharegpt(path, min_input_tokens=9), byte_level_tokenizer, 8, 128, 4, tmp_path),
    ]
    assert (len(loads), len(encoded)) == (1, 1)
    assert again[0] == first
    # a new mtime is a new file, even with the same size
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert build_prompts(_sharegpt(path), byte_level_tokenizer, 5, 256, 0, tmp_path) == first
    assert len(loads) == 2
    items = json.loads(path.read_text(encoding="utf-8"))
    _write_sharegpt(path, items[:50])
    assert (
        build_prompts(_sharegpt(path), byte_level_tokenizer, 5, 256, 0, tmp_path).profile["conversations"]
        == 50
    )
    assert len(loads) == 3
    # another tokenizer counts tokens its own way
    build_prompts(_sharegpt(path), metaspace_tokenizer, 5, 256, 0, tmp_path)
    assert len(loads) == 4
    # a few files are kept, least recently used first out
    for k in range(3):
        _write_sharegpt(tmp_path / f"other{k}.json", items[k * 10 : k * 10 + 40])
        build_prompts(_sharegpt(tmp_path / f"other{k}.json"), byte_level_tokenizer, 1, 256, 0, tmp_path)
    assert len(loads) == 7
    build_prompts(_sharegpt(path), metaspace_tokenizer, 5, 256, 0, tmp_path)  # still kept
    assert len(loads) == 7
    build_prompts(_sharegpt(path), byte_level_tokenizer, 5, 256, 0, tmp_path)  # the oldest: dropped
    assert len(loads) == 8


# --- documents -----------------------------------------------------------------------------------


def test_documents_are_exact_windows(tokenizer: Tokenizer, tmp_path: Path) -> None:
    got = build_prompts(_documents(), tokenizer, 12, 2000, 0, tmp_path)
    assert len(got.prompts) == 12
    for p in got.prompts:
        assert p.tokens == 2000
        assert len(_ids(tokenizer, p.text)) == 2000
        assert "\ufffd" not in p.text
    assert len({p.text for p in got.prompts}) == 12
    assert got.name == "documents:documents"
    assert (got.source, got.source_type) == (str(DOCUMENTS), "local")
    lengths = {p.name: len(_ids(tokenizer, p.read_text(encoding="utf-8"))) for p in DOCUMENTS.glob("*.txt")}
    long_enough = {name for name, n in lengths.items() if n >= 2000}
    assert got.profile["files"] == 4
    assert got.profile["files_long_enough"] == len(long_enough)
    # 12 prompts over fewer documents: every long-enough document is used, each several times
    assert set(got.profile["files_used"]) == long_enough
    assert got.profile["glob"] == "*.txt"


def test_document_windows_are_document_text(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    # A byte-level tokenizer decodes exactly, so every window is a piece of one document, cut
    # between whole characters even in the document with accented and CJK words.
    texts = [p.read_text(encoding="utf-8") for p in DOCUMENTS.glob("*.txt")]
    got = build_prompts(_documents(glob="harbour*.txt"), byte_level_tokenizer, 8, 1500, 4, tmp_path)
    assert got.profile["files_used"] == ["harbour-survey.txt"]
    for p in got.prompts:
        assert any(p.text in t for t in texts)


def test_documents_are_seeded_and_prefix_stable(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    a = build_prompts(_documents(), byte_level_tokenizer, 4, 1000, 1, tmp_path)
    b = build_prompts(_documents(), byte_level_tokenizer, 9, 1000, 1, tmp_path)
    assert a == build_prompts(_documents(), byte_level_tokenizer, 4, 1000, 1, tmp_path)
    assert b.prompts[:4] == a.prompts
    assert build_prompts(_documents(), byte_level_tokenizer, 4, 1000, 2, tmp_path).prompts != a.prompts
    # another length with the same seed cuts elsewhere (no shared start for a prefix cache)
    other = build_prompts(_documents(), byte_level_tokenizer, 4, 1200, 1, tmp_path)
    assert {p.text[:200] for p in other.prompts}.isdisjoint(p.text[:200] for p in a.prompts)


def test_documents_too_short(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    longest = len(_ids(byte_level_tokenizer, (DOCUMENTS / "long-manual.txt").read_text(encoding="utf-8")))
    with pytest.raises(BenchmarkError) as info:
        build_prompts(_documents(), byte_level_tokenizer, 1, 50_000, 0, tmp_path)
    message = str(info.value)
    assert "workloads[].dataset.path" in message
    assert f"the longest, long-manual.txt, has {longest}" in message
    assert "lower input_tokens" in message


def test_documents_glob(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match=r"no document matching '\*\.md'"):
        build_prompts(_documents(glob="*.md"), byte_level_tokenizer, 1, 500, 0, tmp_path)
    with pytest.raises(BenchmarkError) as info:
        build_prompts(_documents(glob="*.rst"), byte_level_tokenizer, 1, 500, 0, tmp_path)
    message = str(info.value)
    assert "no file matches workloads[].dataset.glob '*.rst'" in message
    assert "README.md" in message
    assert "brief-note.txt" in message


def test_documents_folder_errors(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match=r"workloads\[\]\.dataset\.path .* does not exist"):
        build_prompts(_documents(tmp_path / "nope"), byte_level_tokenizer, 1, 10, 0, tmp_path)
    with pytest.raises(BenchmarkError, match="is a file"):
        build_prompts(_documents(SHAREGPT), byte_level_tokenizer, 1, 10, 0, tmp_path)
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 " * 10)
    with pytest.raises(BenchmarkError, match=r"bad\.txt is not UTF-8 text \(byte 3\)"):
        build_prompts(_documents(tmp_path), byte_level_tokenizer, 1, 10, 0, tmp_path)


def test_documents_run_out_of_windows(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    text = random_prompts(byte_level_tokenizer, 1, 30, 0)[0].text
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    got = build_prompts(_documents(tmp_path), byte_level_tokenizer, 2, 29, 0, tmp_path)
    assert len({p.text for p in got.prompts}) == 2  # the only two windows
    with pytest.raises(BenchmarkError, match="only 2 distinct windows of 29 tokens"):
        build_prompts(_documents(tmp_path), byte_level_tokenizer, 3, 29, 0, tmp_path)
    with pytest.raises(BenchmarkError) as info:  # two repeats of one prompt each take both
        build_prompts(_documents(tmp_path), byte_level_tokenizer, 1, 29, 0, tmp_path, repeat=2)
    message = str(info.value)
    assert "only 2 distinct windows of 29 tokens, and repeat 2 needs 3 in all" in message
    assert "lower workloads[].repeats or warmup_requests + num_requests or input_tokens" in message


def _starts(prompts: list[Any]) -> list[tuple[str, int]]:
    """(document, character) where each prompt starts: a byte-level tokenizer decodes exactly, so a
    window is a piece of one document, and different token starts are different characters."""
    texts = {p.name: p.read_text(encoding="utf-8") for p in DOCUMENTS.glob("*.txt")}
    out = []
    for p in prompts:
        places = [(name, text.find(p.text)) for name, text in texts.items() if p.text in text]
        assert len(places) == 1
        out.append(places[0])
    return out


def test_documents_repeats_never_share_a_start(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    # Repeat k used to cut windows with seed + k, free to start where an earlier repeat's did.
    repeats = [
        build_prompts(_documents(), byte_level_tokenizer, 6, 1000, 1, tmp_path, repeat=k) for k in range(4)
    ]
    prompts = [p for r in repeats for p in r.prompts]
    starts = _starts(prompts)
    assert len(set(starts)) == 24
    assert len({p.text for p in prompts}) == 24
    assert all(len(_ids(byte_level_tokenizer, p.text)) == 1000 for p in prompts)
    for k, r in enumerate(repeats):
        assert (r.profile["seed"], r.profile["repeat"], r.profile["slice"]) == (1, k, [6 * k, 6 * k + 6])
    assert repeats[0] == build_prompts(_documents(), byte_level_tokenizer, 6, 1000, 1, tmp_path)
    # repeat k is the k-th block of one sequence, whether or not this process made the blocks before
    documents._SAMPLES.clear()
    assert build_prompts(_documents(), byte_level_tokenizer, 6, 1000, 1, tmp_path, repeat=3) == repeats[3]
    documents._SAMPLES.clear()
    whole = build_prompts(_documents(), byte_level_tokenizer, 24, 1000, 1, tmp_path)
    assert whole.prompts == prompts


def test_documents_prompts_are_distinct_when_windows_crowd(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # long-manual.txt is about 11K tokens: windows 100 tokens shorter have 101 offsets, and sliding
    # them to word boundaries made close offsets the same window (40 asked gave 14 to 29 distinct).
    manual = (DOCUMENTS / "long-manual.txt").read_text(encoding="utf-8")
    size = len(_ids(tokenizer, manual)) - 100
    got = build_prompts(_documents(glob="long-manual.txt"), tokenizer, 40, size, 0, tmp_path)
    assert len({p.text for p in got.prompts}) == 40
    assert len({p.text[:100] for p in got.prompts}) == 40  # different starts, not only different ends
    assert all(len(_ids(tokenizer, p.text)) == size for p in got.prompts)
    # windows that had to move are still those of fitting them one by one, in another process too
    halves = [
        build_prompts(_documents(glob="long-manual.txt"), tokenizer, 20, size, 0, tmp_path, repeat=k).prompts
        for k in (0, 1)
    ]
    assert halves[0] + halves[1] == got.prompts
    monkeypatch.setattr(documents, "_BATCH_TOKENS", 1)
    documents._SAMPLES.clear()
    assert build_prompts(_documents(glob="long-manual.txt"), tokenizer, 40, size, 0, tmp_path) == got


def test_documents_without_room_for_distinct_windows(tokenizer: Tokenizer, tmp_path: Path) -> None:
    # CJK words: a byte-level tokenizer splits each character into byte tokens, and a window never
    # starts inside one, so the document has fewer starts than offsets.
    (tmp_path / "cjk.txt").write_text(
        " ".join(["港口", "測量", "報告", "東京", "海岸"] * 8), encoding="utf-8"
    )
    size = len(_ids(tokenizer, (tmp_path / "cjk.txt").read_text(encoding="utf-8"))) - 30
    with pytest.raises(BenchmarkError) as info:
        build_prompts(_documents(tmp_path), tokenizer, 31, size, 0, tmp_path)
    message = str(info.value)
    # Ran out of starts; or, with a '▁'-prepending normalizer, the starts left do not re-encode exactly.
    assert f"no free window of {size} tokens is left for prompt" in message or re.search(
        rf"could not cut a window of exactly {size} tokens for prompt \d+ at a start of its own", message
    )
    assert f"workloads[].dataset.path {str(tmp_path)!r}" in message
    assert "the workload needs 31 prompts (warmup_requests + num_requests)" in message
    assert "lower warmup_requests + num_requests or input_tokens, or add documents" in message
    with pytest.raises(BenchmarkError, match=r"repeat 1 needs 20 in all .* lower workloads\[\]\.repeats or"):
        build_prompts(_documents(tmp_path), tokenizer, 10, size, 0, tmp_path, repeat=1)


def test_document_windows_are_verified_in_capped_batches(
    byte_level_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = build_prompts(_documents(), byte_level_tokenizer, 12, 1000, 2, tmp_path)
    batches: list[int] = []
    encode = documents._encode_batch

    def counting(tokenizer: Tokenizer, texts: list[str]) -> list[Any]:
        batches.append(len(texts))
        return encode(tokenizer, texts)

    # the windows are encoded in documents, the documents themselves in corpus_tools (_token_ids)
    monkeypatch.setattr(documents, "_encode_batch", counting)
    monkeypatch.setattr(corpus_tools, "_encode_batch", counting)
    monkeypatch.setattr(corpus_tools, "_ENCODE_BATCH_CHARS", 1)  # the documents themselves: one a call
    for cap, per_call in ((3_000, 3), (1, 1)):
        monkeypatch.setattr(documents, "_BATCH_TOKENS", cap)
        documents._SAMPLES.clear()
        batches.clear()
        got = build_prompts(_documents(), byte_level_tokenizer, 12, 1000, 2, tmp_path)
        assert max(batches) == per_call  # all 12 windows were encoded in one call
        assert got == expected  # the same windows, however they were batched


# --- the set itself ------------------------------------------------------------------------------


def test_prompt_set_is_frozen_and_checks_its_fields(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    got = build_prompts(RandomDataset(), byte_level_tokenizer, 1, 8, 0, tmp_path)
    with pytest.raises(ValidationError):
        got.name = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        PromptSet(name="x", digest="d", source="s", source_type="remote", profile={}, prompts=[])  # type: ignore[arg-type]
    assert build_prompts(RandomDataset(), byte_level_tokenizer, 0, 8, 0, tmp_path).profile["count"] == 0


def test_bad_counts(byte_level_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="input_tokens"):
        build_prompts(RandomDataset(), byte_level_tokenizer, 1, 0, 0, tmp_path)
    with pytest.raises(BenchmarkError, match="number of prompts"):
        build_prompts(_sharegpt(), byte_level_tokenizer, -1, 10, 0, tmp_path)
