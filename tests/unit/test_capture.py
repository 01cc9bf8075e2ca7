"""Capture (issue 49, item 1; k3pipe/prompts/capture.py): a request becomes a trace line with no text,
its prompt counted with the target model's tokenizer and chat template and its blocks hashed in a
chain; an OpenAI-format request log and the gateway callback's input (LiteLLM's callback arguments,
as LiteLLM 1.108 passes them) give the same lines; the capture log converts to a trace whose sessions
are renamed. The real gateway end to end: tests/engine/test_trace_capture.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import types
from datetime import UTC, datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from k3pipe.cli.main import app
from k3pipe.core.errors import BenchmarkError, SpecError
from k3pipe.prompts.capture import GatewayCapture, PromptHasher, request_log_lines, write_gateway_callback
from k3pipe.prompts.chat_template import render_chat
from k3pipe.schema.traces import from_capture, read_trace

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SECRET_TEXT = "the launch code is sk-capture-secret-0123456789"


@pytest.fixture
def model_dir(tmp_path: Path, byte_level_tokenizer: Tokenizer) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    byte_level_tokenizer.save(str(model / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a careful agent. " * 12}]
    for k in range(turns):
        if k:
            messages.append({"role": "assistant", "content": f"answer number {k} " * 3})
        messages.append({"role": "user", "content": f"question {k}: {SECRET_TEXT}"})
    return messages


def test_a_prompt_is_counted_with_the_template_and_hashed_in_a_chain(
    model_dir: Path, byte_level_tokenizer: Tokenizer
) -> None:
    hasher = PromptHasher(model_dir, block_tokens=8)
    one, two = _conversation(1), _conversation(2)
    ids = hasher.token_ids({"messages": one})
    rendered = render_chat(CHATML, {"bos_token": "<s>", "eos_token": "</s>"}, one)
    assert ids == byte_level_tokenizer.encode(rendered, add_special_tokens=False).ids
    first, second = hasher.blocks(ids), hasher.blocks(hasher.token_ids({"messages": two}))
    assert len(first) == -(-len(ids) // 8)  # the last block partial
    shared = len(ids) // 8 - 1  # turn 1's whole blocks, but the one holding its generation prompt
    assert second[:shared] == first[:shared]
    assert second[len(first) :] != first[len(first) :]
    # a chain: the same block content after another prefix is another hash
    assert hasher.blocks([1, 2, 3, 4, 5, 6, 7, 8]) != hasher.blocks([0] * 8 + [1, 2, 3, 4, 5, 6, 7, 8])[1:]
    # parts of a content are read as the template reads text; a completion's prompt as it is
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "you"}]}
    ]
    assert hasher.token_ids({"messages": parts}) == hasher.token_ids(
        {"messages": [{"role": "user", "content": "hello you"}]}
    )
    assert hasher.token_ids({"prompt": "plain words"}) == byte_level_tokenizer.encode("plain words").ids
    with pytest.raises(ValueError, match="neither chat messages nor a text prompt"):
        hasher.token_ids({"input": "x"})
    with pytest.raises(BenchmarkError, match=r"tokenizer.json does not exist: point the capture"):
        PromptHasher(model_dir.parent)


def test_a_request_log_converts_to_a_trace_with_no_text_and_renamed_sessions(
    tmp_path: Path, model_dir: Path
) -> None:
    t0 = 1_765_000_000.0
    rows = []
    for s, session in enumerate(("alice@team.example", "bob@team.example")):
        for turn in (1, 2, 3):
            rows.append({
                "timestamp": _iso(t0 + 10 * s + 2 * turn),
                "session_id": session,
                "request": {"model": "kimi", "messages": _conversation(turn), "max_tokens": 64},
                "response": {"usage": {"prompt_tokens": 1, "completion_tokens": 20 + turn}},
            })  # fmt: skip
    rows.append(
        {
            "timestamp": t0 + 1,
            "request": {"prompt": "a request on its own"},
            "usage": {"completion_tokens": 3},
        }
    )
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))

    lines = list(request_log_lines(log, model_dir, block_tokens=8))
    assert [line["output_tokens"] for line in lines] == [21, 22, 23, 21, 22, 23, 3]
    trace = from_capture(lines, log.name)
    assert trace.block_tokens == 8
    assert [(r.t, r.session, r.turn) for r in trace.requests] == [
        (0.0, None, None), (1.0, "s000", 1), (3.0, "s000", 2), (5.0, "s000", 3),
        (11.0, "s001", 1), (13.0, "s001", 2), (15.0, "s001", 3),
    ]  # fmt: skip
    first, second = trace.requests[1], trace.requests[2]
    whole = first.input_tokens // 8 - 1
    assert second.hash_ids[:whole] == first.hash_ids[:whole]  # the conversation so far
    assert trace.requests[4].hash_ids[:5] == first.hash_ids[:5]  # both sessions' system prompt
    assert trace.shape().theoretical_hit_rate > 0.5

    # through the command: nothing of the text, the session ids or the key in the trace
    dest = tmp_path / "trace.jsonl"
    runner = CliRunner()
    done = runner.invoke(
        app,
        ["trace", "convert", str(log), str(dest), "--from", "openai-log", "--model-dir", str(model_dir),
         "--block-tokens", "8"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert read_trace(dest) == trace
    text = dest.read_text()
    for needle in ("sk-capture-secret", "careful agent", "alice", "team.example", "kimi"):
        assert needle not in text
    missing = runner.invoke(app, ["trace", "convert", str(log), str(dest), "--from", "openai-log"])
    assert missing.exit_code != 0
    assert "--from openai-log needs --model-dir" in missing.output


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"timestamp": 1, "request": {"prompt": "x"}},
         r"line 1: usage.completion_tokens=None: the answer's tokens"),
        ({"timestamp": "yesterday", "request": {"prompt": "x"}, "usage": {"completion_tokens": 2}},
         r"line 1: timestamp='yesterday': Unix seconds or an ISO 8601 time"),
        ({"timestamp": 1, "request": "x", "usage": {"completion_tokens": 2}}, r"line 1: request is str"),
        ({"timestamp": 1, "request": {"input": "x"}, "usage": {"completion_tokens": 2}},
         r"line 1: the request has neither chat messages nor a text prompt"),
    ],
)  # fmt: skip
def test_a_bad_request_log_line_is_refused_naming_its_line_and_field(
    tmp_path: Path, model_dir: Path, row: dict[str, object], expected: str
) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(row) + "\n")
    with pytest.raises(BenchmarkError, match=expected):
        list(request_log_lines(log, model_dir))


def test_a_capture_log_that_mixes_block_sizes_or_versions_is_refused() -> None:
    line = {"k3pipe_capture": 1, "t": 0, "input_tokens": 9, "output_tokens": 2, "block_tokens": 8,
            "blocks": ["a", "b"]}  # fmt: skip
    assert from_capture([line], "c").requests[0].hash_ids == (0, 1)
    with pytest.raises(SpecError, match=r"block_tokens \['16', '8'\]: one capture holds one block size"):
        from_capture([line, {**line, "block_tokens": 16}], "c")
    with pytest.raises(SpecError, match="request 1: k3pipe_capture=2: this k3pipe reads 1"):
        from_capture([{**line, "k3pipe_capture": 2}], "c")
    with pytest.raises(SpecError, match="request 1: blocks: 2 hashes expected for 9 tokens"):
        from_capture([{**line, "blocks": ["a"]}], "c")
    with pytest.raises(SpecError, match="no request captured"):
        from_capture([], "c")


def _litellm_kwargs(messages: list[dict[str, str]], session: str | None, completion: int | None) -> dict:
    """The arguments LiteLLM 1.108 hands a success callback, in the parts the capture reads, beside
    parts it must leave alone (the key's hash, the headers)."""
    return {
        "messages": messages,
        "litellm_params": {
            "litellm_session_id": session,
            "metadata": {"user_api_key_hash": "hash-of-the-key", "headers": {"authorization": "Bearer sk-x"}},
        },
        "standard_logging_object": {
            "startTime": 1_765_000_000.5,
            "prompt_tokens": 99,
            "completion_tokens": completion,
            "messages": messages,
        },
    }


def test_the_gateway_callback_appends_a_line_per_answered_call(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "capture" / "log.jsonl"
    capture = GatewayCapture(out, model_dir, block_tokens=8)
    line = capture.record(_litellm_kwargs(_conversation(2), "team-session-1", 17))
    assert line is not None
    assert line["session"] == "team-session-1"
    assert line["output_tokens"] == 17
    assert line["engine_prompt_tokens"] == 99
    assert line["t"] == 1_765_000_000.5
    assert line["input_tokens"] == len(PromptHasher(model_dir).token_ids({"messages": _conversation(2)}))
    # without usage, or with what cannot be read: skipped, and the gateway's request is not failed
    assert capture.record(_litellm_kwargs(_conversation(1), None, None)) is None
    assert (
        capture.record({"messages": "not a list", "standard_logging_object": {"completion_tokens": 3}})
        is None
    )
    assert (capture.captured, capture.skipped) == (1, 2)
    text = out.read_text()
    assert len(text.splitlines()) == 1
    for needle in ("sk-capture-secret", "careful agent", "hash-of-the-key", "sk-x", "authorization"):
        assert needle not in text


def test_the_written_callback_loads_as_litellm_loads_it(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "gateway"
    config_dir.mkdir()
    out = tmp_path / "captured.jsonl"
    path = write_gateway_callback(config_dir, out=out, model_dir=model_dir, block_tokens=8)
    assert path == config_dir / "k3pipe_capture.py"
    assert (config_dir / "k3pipe-capture-lib" / "k3pipe" / "prompts" / "capture.py").is_file()
    # LiteLLM's base class, as its module path names it (the real one: tests/engine/test_trace_capture.py)
    fake = types.ModuleType("litellm.integrations.custom_logger")

    class CustomLogger:
        def __init__(self) -> None:
            self.base_ready = True

    fake.CustomLogger = CustomLogger  # type: ignore[attr-defined]
    for name in ("litellm", "litellm.integrations"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "litellm.integrations.custom_logger", fake)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the file puts its lib first; undone after
    spec = importlib.util.spec_from_file_location("k3pipe_capture", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    handler = module.trace_capture
    assert isinstance(handler, CustomLogger)
    kwargs = _litellm_kwargs(_conversation(1), "s", 5)
    asyncio.run(handler.async_log_success_event(kwargs, None, datetime.now(UTC), datetime.now(UTC)))
    handler.log_success_event(kwargs, None, datetime.now(UTC), datetime.now(UTC))
    assert [json.loads(x)["output_tokens"] for x in out.read_text().splitlines()] == [5, 5]
    with pytest.raises(BenchmarkError, match=r"tokenizer\.json does not exist"):
        write_gateway_callback(config_dir, out=out, model_dir=tmp_path)
