"""Capture: a team's requests as trace lines with no text in them (issue 49, item 1).

A request is turned into what a trace keeps, the moment it is seen: its time, its session, its prompt's
tokens counted with the target model's tokenizer and chat template (rendered as the engines render it,
:mod:`k3pipe.prompts.chat_template`), the answer's tokens, and the prompt's blocks as **chained
hashes** (sha256 over the parent block's hash and the block's token ids, 16 hex digits): two prompts
share their first k blocks exactly when their first k hashes are equal, as Mooncake's ``hash_ids``.
The text is hashed and dropped; keys, headers and metadata are never read.

Two ways in, one line format (a *capture log*, JSON lines, ``{"k3pipe_capture": 1, ...}`` on every
line), which :func:`k3pipe.schema.traces.from_capture` turns into a k3pipe trace:

- :class:`GatewayCapture`: a LiteLLM logging callback (LiteLLM's ``CustomLogger`` calls it with each
  successful call's ``kwargs``, whose ``messages``, ``standard_logging_object`` and
  ``litellm_params`` it reads, as LiteLLM 1.108 defines them). :func:`write_gateway_callback`
  writes the file LiteLLM's config names (``litellm_settings.callbacks``) and a copy of the few
  modules it needs, so it loads in the gateway's own venv (tokenizers and jinja2 come with LiteLLM).
- :func:`request_log_lines`: a plain OpenAI-format request log (JSON lines of ``timestamp``,
  ``session_id``, ``request`` (the body) and ``usage`` or ``response.usage``), the neutral input.

This module imports only the standard library, tokenizers and jinja2 (and the two k3pipe modules it
copies beside the callback): it runs inside the gateway's process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from k3pipe.core.errors import BenchmarkError
from k3pipe.prompts.chat_template import load_chat_template, render_chat

__all__ = [
    "CAPTURE_VERSION",
    "GatewayCapture",
    "PromptHasher",
    "request_log_lines",
    "write_gateway_callback",
]

CAPTURE_VERSION = 1
DEFAULT_BLOCK_TOKENS = 64
_log = logging.getLogger("k3pipe.capture")


class PromptHasher:
    """A request's prompt as the engine will see it, in tokens, and its blocks as chained hashes."""

    def __init__(self, model_dir: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        from tokenizers import Tokenizer

        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens}: give a whole number of at least 1")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise BenchmarkError(
                f"capture: {path} does not exist: point the capture at the target model's directory "
                "(its tokenizer.json and chat template count the prompts as the engine will)"
            )
        self.tokenizer = Tokenizer.from_file(str(path))
        self.template = load_chat_template(model_dir)
        self.block_tokens = block_tokens

    def token_ids(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt's token ids: chat ``messages`` rendered with the model's template (its markup
        counted, as the engine counts it), or a completion's ``prompt`` with the tokenizer's own
        special tokens."""
        messages = body.get("messages")
        if isinstance(messages, list):
            plain = [_plain_message(m) for m in messages if isinstance(m, Mapping)]
            if self.template is None:
                text = "\n".join(m["content"] for m in plain)
            else:
                text = render_chat(self.template[0], self.template[1], plain)
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("the request has neither chat messages nor a text prompt")

    def blocks(self, ids: Sequence[int]) -> list[str]:
        """The chained hash of each block of ``ids`` (the last may be partial)."""
        out: list[str] = []
        parent = ""
        for start in range(0, len(ids), self.block_tokens):
            block = ",".join(map(str, ids[start : start + self.block_tokens]))
            parent = hashlib.sha256(f"{parent}|{block}".encode()).hexdigest()[:16]
            out.append(parent)
        return out

    def line(
        self,
        *,
        t: float,
        body: Mapping[str, Any],
        output_tokens: int,
        session: str | None,
        engine_prompt_tokens: int | None = None,
    ) -> dict[str, Any]:
        """One capture-log line: no text, no key, no header."""
        ids = self.token_ids(body)
        messages = body.get("messages")
        last_role = messages[-1].get("role") if isinstance(messages, list) and messages else None
        line: dict[str, Any] = {
            "k3pipe_capture": CAPTURE_VERSION,
            "t": round(float(t), 6),
            "session": session,
            "input_tokens": len(ids),
            "output_tokens": int(output_tokens),
            "block_tokens": self.block_tokens,
            "blocks": self.blocks(ids),
            "kind": "tool" if last_role == "tool" else "user",
        }
        if engine_prompt_tokens is not None:
            line["engine_prompt_tokens"] = int(engine_prompt_tokens)
        return line


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as a template reads it: a content of parts becomes its text parts joined."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    elif content is None:
        out["content"] = ""
    return out


# --- the gateway -----------------------------------------------------------------------------------


class GatewayCapture:
    """Appends a capture-log line for each call a LiteLLM proxy answered.

    ``record`` takes LiteLLM's callback arguments: ``kwargs["messages"]`` (or ``"prompt"``) are hashed
    and dropped; the answer's tokens come from ``standard_logging_object.completion_tokens`` (the
    engine's usage as LiteLLM relays it), the time from its ``startTime``; the session from the
    request's ``litellm_session_id`` (a body field LiteLLM defines), else ``metadata.session_id``.
    A call that cannot be captured is skipped with a warning naming why, never its content, and never
    fails the gateway's request.
    """

    def __init__(self, out: Path, model_dir: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.out = out
        self.hasher = PromptHasher(model_dir, block_tokens)
        self._lock = threading.Lock()
        self.captured = 0
        self.skipped = 0
        out.parent.mkdir(parents=True, exist_ok=True)

    def record(self, kwargs: Mapping[str, Any], start_time: object = None) -> dict[str, Any] | None:
        try:
            line = self._line(kwargs, start_time)
        except Exception as exc:  # a capture never fails the gateway's request
            self.skipped += 1
            _log.warning("k3pipe capture: a call was not captured (%s)", type(exc).__name__)
            return None
        if line is None:
            self.skipped += 1
            return None
        text = json.dumps(line, sort_keys=True) + "\n"
        with self._lock, self.out.open("a", encoding="utf-8") as fh:
            fh.write(text)
        self.captured += 1
        return line

    def _line(self, kwargs: Mapping[str, Any], start_time: object) -> dict[str, Any] | None:
        logged = kwargs.get("standard_logging_object") or {}
        completion = logged.get("completion_tokens")
        if not isinstance(completion, int) or completion < 1:
            _log.warning("k3pipe capture: a call without completion tokens in its usage was skipped")
            return None
        body: dict[str, Any] = {}
        if isinstance(kwargs.get("messages"), list):
            body["messages"] = kwargs["messages"]
        elif kwargs.get("prompt") is not None:
            body["prompt"] = kwargs["prompt"]
        else:
            additional = (kwargs.get("additional_args") or {}).get("complete_input_dict") or {}
            body = {k: additional[k] for k in ("messages", "prompt") if k in additional}
        t = logged.get("startTime")
        if not isinstance(t, int | float):
            t = start_time.timestamp() if isinstance(start_time, datetime) else None
        if t is None:
            raise ValueError("no start time")
        prompt_tokens = logged.get("prompt_tokens")
        return self.hasher.line(
            t=float(t),
            body=body,
            output_tokens=completion,
            session=_session(kwargs),
            engine_prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        )


def _session(kwargs: Mapping[str, Any]) -> str | None:
    params = kwargs.get("litellm_params") or {}
    for value in (
        params.get("litellm_session_id"),
        kwargs.get("litellm_session_id"),
        (params.get("metadata") or {}).get("session_id"),
    ):
        if value:
            return str(value)
    return None


_LIB_FILES = (
    "k3pipe/__init__.py",
    "k3pipe/core/__init__.py",
    "k3pipe/core/errors.py",
    "k3pipe/core/secrets.py",
    "k3pipe/prompts/__init__.py",
    "k3pipe/prompts/chat_template.py",
    "k3pipe/prompts/capture.py",
)
CALLBACK_MODULE = "k3pipe_capture"
CALLBACK_INSTANCE = "trace_capture"

_CALLBACK = '''"""k3pipe's trace capture as a LiteLLM callback (written by `k3pipe trace gateway`).

See docs/traces.md, "Capture".

LiteLLM loads this file from its config's directory: litellm_settings.callbacks: [{module}.{instance}].
Each answered call becomes one line of {out}: token counts, times, the session and the prompt's blocks
as chained hashes of the target model's tokens; no text, no key, no header.
"""

import sys
from pathlib import Path

sys.path.insert(0, {lib!r})

from litellm.integrations.custom_logger import CustomLogger  # noqa: E402

from k3pipe.prompts.capture import GatewayCapture  # noqa: E402


class K3pipeTraceCapture(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self.capture = GatewayCapture(Path({out!r}), Path({model_dir!r}), {block_tokens})

    def log_success_event(self, kwargs, response_obj, start_time, end_time):
        self.capture.record(kwargs, start_time)

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self.capture.record(kwargs, start_time)


{instance} = K3pipeTraceCapture()
'''


def write_gateway_callback(
    config_dir: Path, *, out: Path, model_dir: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> Path:
    """Write the LiteLLM callback file into ``config_dir`` (the directory of the proxy's config, where
    LiteLLM looks for it) with a copy of the modules it imports under ``k3pipe-capture-lib/``.
    Returns the callback's file; the config names it as ``k3pipe_capture.trace_capture``."""
    PromptHasher(model_dir, block_tokens)  # the model's tokenizer and template, checked now
    root = Path(__file__).resolve().parents[2]
    lib = config_dir / "k3pipe-capture-lib"
    for name in _LIB_FILES:
        dest = lib / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / name, dest)
    path = config_dir / f"{CALLBACK_MODULE}.py"
    path.write_text(
        _CALLBACK.format(
            module=CALLBACK_MODULE,
            instance=CALLBACK_INSTANCE,
            lib=str(lib.resolve()),
            out=str(out.resolve()),
            model_dir=str(model_dir.resolve()),
            block_tokens=block_tokens,
        )
    )
    return path


# --- a request log ---------------------------------------------------------------------------------


def request_log_lines(
    path: Path, model_dir: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> Iterator[dict[str, Any]]:
    """The capture-log lines of an OpenAI-format request log: JSON lines, each with ``timestamp``
    (Unix seconds, or an ISO 8601 time), ``request`` (the body sent: ``messages`` or ``prompt``),
    the answer's ``usage`` (top-level or under ``response``; ``completion_tokens`` required) and
    optionally ``session_id``. A line that cannot be read is refused naming the line and the field."""
    hasher = PromptHasher(model_dir, block_tokens)
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BenchmarkError(f"request log {path}: cannot be read ({exc})") from None
    for n, text in enumerate(raw.splitlines(), 1):
        if not text.strip():
            continue
        where = f"request log {path}: line {n}"
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BenchmarkError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise BenchmarkError(f"{where}: a JSON object per line")
        body = row.get("request")
        if not isinstance(body, dict):
            kind = type(body).__name__
            raise BenchmarkError(f"{where}: request is {kind}: give the request's body as an object")
        usage = row.get("usage") or (row.get("response") or {}).get("usage") or {}
        completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(completion, int) or completion < 1:
            raise BenchmarkError(
                f"{where}: usage.completion_tokens={_short(completion)}: the answer's tokens, at least 1 "
                "(log the response's usage with the request)"
            )
        session = row.get("session_id")
        try:
            yield hasher.line(
                t=_seconds(row.get("timestamp"), where),
                body=body,
                output_tokens=completion,
                session=None if session is None else str(session),
                engine_prompt_tokens=usage.get("prompt_tokens"),
            )
        except ValueError as exc:
            raise BenchmarkError(f"{where}: {exc}") from None


def _seconds(value: object, where: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise BenchmarkError(
        f"{where}: timestamp={_short(value)}: Unix seconds or an ISO 8601 time (2026-12-07T10:00:00Z)"
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
