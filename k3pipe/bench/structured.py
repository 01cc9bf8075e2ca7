"""Structured output, checked: whether an arm's tool-call and reasoning parsers hand back what a client
can use (issue 47, item 4).

An arm served with a tool-call parser (``tool_call_parser``) or a reasoning parser (``reasoning_parser``)
gets, after its output probe, a small fixed set of tool-calling chat requests (:data:`TOOLS`, one
user message each, ``tool_choice`` "auto" so the parser, not a grammar, makes the call), half of them
streamed: the streamed path assembles tool calls from their deltas and has failed on its own in
production (empty tool calls). Each answer is checked (:func:`check_message`):

- every tool call names a tool that was offered, and its ``arguments`` parse as JSON and satisfy
  that tool's JSON schema (``jsonschema``);
- no tool-call markup is left in ``content`` (the parser did not recognise a call the model made:
  hermes' ``<tool_call>``, Kimi-K2's ``<|tool_calls_section_begin|>``, Kimi-K3's ``<|open|>tools``);
- with a reasoning parser, no reasoning markup in ``content`` (``<think>``, Kimi-K3's
  ``<|open|>think``): the reasoning belongs in the message's ``reasoning`` (vLLM 0.11 and later) or
  ``reasoning_content`` (SGLang; vLLM before).

The wire format is vLLM's (vllm/entrypoints/openai/chat_completion/protocol.py ``ChatMessage`` with
``tool_calls`` of ``{"id", "type": "function", "function": {"name", "arguments"}}``; streamed,
``DeltaMessage.tool_calls`` of ``{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}``
whose argument strings concatenate by index), which SGLang's OpenAI server shares. Failures are
counted per 1,000 requests with their Clopper-Pearson interval. With random weights a model rarely
calls a tool at all: there the check finds markup leaks and malformed calls only when they occur; on
a user's node with real weights it finds parser faults. Tested against a stand-in emitting good and
broken calls in that wire format (k3pipe/testing/scripted_tools.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
from scipy import stats

__all__ = [
    "TOOLS",
    "StructuredCall",
    "StructuredRecord",
    "check_message",
    "merge_stream",
    "read_structured",
    "run_structured",
    "structured_request",
]


TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a short Python program and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}, "timeout_s": {"type": "number", "minimum": 0}},
                "required": ["code"],
                "additionalProperties": False,
            },
        },
    },
)

PROMPTS: tuple[str, ...] = (
    "What is the weather in Paris right now? Use the weather tool.",
    "Run Python to print the sum of the first 100 integers.",
    "Is it colder in Oslo or in Helsinki today, in celsius? Check with the tool.",
    "Use Python to compute 2 to the power of 64 and print it.",
    "Tell me the temperature in Tokyo in fahrenheit, using the tool.",
    "Print the first ten prime numbers with the Python tool.",
    "Check the weather for Nairobi.",
    "Run code that prints today's weekday for 2026-12-06.",
)

TOOL_MARKUP = ("<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
               "<|open|>tools", "<|open|>call")  # fmt: skip
"""What tool-call parsers look for: in ``content``, a call the parser did not take out."""
REASONING_MARKUP = ("<think>", "</think>", "<|open|>think", "<|close|>think")
"""What reasoning parsers look for: in ``content``, reasoning the parser did not take out."""


@dataclass(frozen=True)
class StructuredCall:
    """One tool-calling request and what was wrong with its answer (``failure`` None: nothing)."""

    request: str
    stream: bool
    tool_calls: int = 0
    failure: str | None = None
    detail: str = ""


@dataclass
class StructuredRecord:
    """One launch's structured-output check."""

    tool_parser: bool
    reasoning_parser: bool
    calls: list[StructuredCall] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def failures(self) -> int:
        return sum(c.failure is not None for c in self.calls)

    def per_1000(self) -> tuple[float, float, float] | None:
        """Failures per 1,000 requests with their 95% Clopper-Pearson interval (None: none sent)."""
        n = len(self.calls)
        if not n:
            return None
        ci = stats.binomtest(self.failures, n).proportion_ci(0.95, method="exact")
        return 1000 * self.failures / n, 1000 * float(ci.low), 1000 * float(ci.high)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            if c.failure is not None:
                out[c.failure] = out.get(c.failure, 0) + 1
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "tool_parser": self.tool_parser,
            "reasoning_parser": self.reasoning_parser,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "calls": [vars(c) for c in self.calls],
        }


def read_structured(data: Mapping[str, Any]) -> StructuredRecord:
    """A :class:`StructuredRecord` from its JSON."""
    return StructuredRecord(
        tool_parser=bool(data.get("tool_parser")),
        reasoning_parser=bool(data.get("reasoning_parser")),
        calls=[StructuredCall(**c) for c in data.get("calls") or []],
        seconds=float(data.get("seconds") or 0.0),
        error=data.get("error"),
    )


def structured_request(model: str, k: int, stream: bool, max_tokens: int = 256) -> dict[str, Any]:
    """Request ``k``: prompt ``k`` of :data:`PROMPTS` (cycled) with :data:`TOOLS`, greedy."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
        "tools": list(TOOLS),
        "tool_choice": "auto",
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return body


def merge_stream(chunks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The message a streamed chat answer adds up to: ``content`` and reasoning concatenated, each
    tool call's ``id``, ``name`` and ``arguments`` by its ``index`` (arguments concatenated)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(
                    int(call.get("index", 0)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
    return {
        "content": "".join(content) or None,
        "reasoning": "".join(reasoning) or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


def check_message(
    message: Mapping[str, Any], *, reasoning_parser: bool, tools: Sequence[Mapping[str, Any]] = TOOLS
) -> tuple[str | None, str]:
    """What is wrong with one answer's message, as ``(failure kind, detail)``; ``(None, "")``: nothing
    (a plain answer without a tool call is no failure)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    content = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        name, raw = fn.get("name") or "", fn.get("arguments")
        if not name:
            return "tool call without a name", json.dumps(call)[:200]
        if name not in schemas:
            return "unknown tool", f"{name!r} was not offered ({', '.join(schemas)})"
        if not raw:
            return "tool call without arguments", f"{name}: arguments {raw!r}"
        try:
            arguments = json.loads(raw)
        except ValueError as exc:
            return "arguments not JSON", f"{name}: {exc}: {str(raw)[:120]!r}"
        try:
            jsonschema.validate(arguments, schemas[name])
        except jsonschema.ValidationError as exc:
            return "arguments break the schema", f"{name}: {exc.message}"[:200]
    leaked = next((m for m in TOOL_MARKUP if m in content), None)
    if leaked:
        return "tool-call markup in content", f"{leaked!r} in content: {content[:120]!r}"
    if reasoning_parser:
        leaked = next((m for m in REASONING_MARKUP if m in content), None)
        if leaked:
            return "reasoning in content", f"{leaked!r} in content: {content[:120]!r}"
    return None, ""


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str] | None
) -> dict[str, Any]:
    if not body["stream"]:
        answer = await client.post(url, json=body, headers=dict(headers or {}))
        if answer.status_code != 200:
            raise _Refused(f"answered {answer.status_code}: {answer.text[:200]}")
        choices = answer.json().get("choices") or [{}]
        return dict(choices[0].get("message") or {})
    chunks: list[dict[str, Any]] = []
    async with client.stream("POST", url, json=body, headers=dict(headers or {})) as answer:
        if answer.status_code != 200:
            raise _Refused(f"answered {answer.status_code}: {(await answer.aread()).decode()[:200]}")
        async for line in answer.aiter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data and data != "[DONE]":
                chunks.append(json.loads(data))
    return merge_stream(chunks)


class _Refused(Exception):
    pass


def run_structured(
    base_url: str,
    model: str,
    requests: int,
    *,
    tool_parser: bool,
    reasoning_parser: bool,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> StructuredRecord:
    """``requests`` tool-calling requests (every other one streamed), one at a time, each answer
    checked; never raises for what the engine answers (a refused request is a failure of its own
    kind, a broken connection ends the check with ``error`` set)."""
    record = StructuredRecord(tool_parser, reasoning_parser)
    url = base_url.rstrip("/") + "/chat/completions"
    t0 = time.perf_counter()

    async def go() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
            for k in range(requests):
                stream = k % 2 == 1
                rid = f"t{k:03d}"
                try:
                    message = await _one(client, url, structured_request(model, k, stream), headers)
                except _Refused as exc:
                    record.calls.append(
                        StructuredCall(rid, stream, failure="request refused", detail=str(exc))
                    )
                    continue
                except ValueError as exc:
                    record.calls.append(
                        StructuredCall(rid, stream, failure="answer not JSON", detail=str(exc)[:200])
                    )
                    continue
                failure, detail = check_message(message, reasoning_parser=reasoning_parser)
                calls = len(message.get("tool_calls") or [])
                record.calls.append(StructuredCall(rid, stream, calls, failure, detail))

    try:
        asyncio.run(go())
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.seconds = time.perf_counter() - t0
    return record
