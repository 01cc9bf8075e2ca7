"""A scripted OpenAI-compatible streaming server that speaks vLLM's wire format, on 127.0.0.1.

Ground truth for the benchmark client: each test scripts the delays, reasoning, errors and usage,
and the server records what it received and the ``time.perf_counter()`` at which it handed every
chunk to the transport (the same clock as the client's, since both live in this process).

The chunks are vLLM 0.32.0's, built by ``k3pipe/testing/openai_wire.py`` (which documents where each
shape comes from); a script varies only what a real server may vary (timing, reasoning field, usage,
errors, older vLLM's ``"usage": null``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from k3pipe.testing import openai_wire as wire
from k3pipe.testing.scripted_tools import ToolScript

__all__ = ["Received", "Script", "ScriptedOpenAI"]


@dataclass(frozen=True)
class Script:
    """How the server answers one request. Delays are in seconds."""

    status: int = 200
    error_body: Any = None  # body for status != 200; default: vLLM's ErrorResponse
    echo_auth_in_error: bool = False  # put the request's Authorization header into error bodies
    role_delay_s: float = 0.0  # before the role chunk (chat) / before anything (completions)
    first_token_delay_s: float = 0.0  # after the role chunk, before the first token chunk
    inter_token_s: float = 0.0  # between token chunks
    # token chunks are made inter_token_s apart but written this many at a time, in one write (a
    # starved API server handing over a stream in bursts); the last write takes what is left
    burst_chunks: int = 1
    reasoning_tokens: int = 0  # chat only: reasoning tokens before the content tokens
    # the delta key of reasoning text; "both": "reasoning", mirrored into "reasoning_content" on every delta
    reasoning_field: wire.ReasoningField = "reasoning"
    output_tokens: int | None = None  # reasoning + content; None: the request's max_tokens
    tokens_per_chunk: int = 1
    first_chunk_tokens: int | None = None  # tokens of the first token chunk (None: tokens_per_chunk)
    tail_delay_s: float = 0.0  # after the last token chunk, before the usage chunk and [DONE]
    continuous_usage: bool | None = None  # None: as stream_options.continuous_usage_stats asks
    refuse_continuous_usage: bool = False  # answer 400 to a request that asks for it (a strict gateway)
    empty_content_chunk: bool = False  # a {"content": ""} chunk right after the role chunk
    empty_choices_chunks: int = 0  # chunks with "choices": [] and no usage, before the tokens
    usage: bool | None = None  # None: as stream_options.include_usage asks; False: never
    usage_completion_tokens: int | None = None  # lie in usage (None: the true count)
    stream_error_after: int | None = None  # send an in-stream error after this many token chunks
    send_done: bool = True
    usage_null_in_chunks: bool = False  # completions token chunks carry "usage": null (older vLLM)


@dataclass
class Received:
    """One request as the server saw it, and when it sent each chunk (perf_counter)."""

    index: int
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    t_received: float
    sent: list[tuple[str, float]] = field(default_factory=list)

    def first_sent(self, kind: str) -> float:
        """perf_counter at which the first chunk of ``kind`` was handed to the transport."""
        return next(t for k, t in self.sent if k == kind)


ScriptSource = Script | Callable[[Received], Script]


class ScriptedOpenAI:
    """``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` answering from a script.

    Use as a context manager; the server always stops on exit. ``script`` may be changed between
    requests, or be a function of the received request. ``max_in_flight`` is the most requests that
    were being answered at once (a request counts until its last chunk before ``[DONE]``).
    ``slots``: the most requests served at once, as an engine's batch limit; a request beyond it
    waits, before its first chunk, for one to end (None: no limit). With a script's fixed service
    time S the server then serves ``slots / S`` requests a second: a capacity known in advance.
    """

    def __init__(
        self,
        script: ScriptSource | None = None,
        *,
        api_key: str | None = None,
        model: str = "scripted",
        port: int = 0,
        slots: int | None = None,
        tools: ToolScript | None = None,
        answer: Callable[[dict[str, Any]], str] | None = None,
        probe: bool = False,
    ) -> None:
        # probe: a completions request with "stream": false is answered as vLLM's CompletionResponse
        # with token_ids and prompt_logprobs (k3pipe.bench.probe), from a fixed function of the prompt
        self.probe = probe
        # a chat request with "stream": false gets one JSON answer whose content is answer(body), as
        # vLLM's ChatCompletionResponse (chat_completion/protocol.py); None: every answer streams
        self.answer = answer
        self.tools = (
            tools  # chat requests that offer tools: answered by it (k3pipe/testing/scripted_tools.py)
        )
        self.slots = slots
        self._slots: asyncio.Semaphore | None = None  # made on the server's loop, at its first request
        self.script: ScriptSource = script if script is not None else Script()
        self.api_key = api_key
        self.model = model
        self.requests: list[Received] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.prefix_cache_resets: list[int] = []  # requests received before each POST /reset_prefix_cache
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port = port  # 0: a free port, chosen when the server starts

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # lifecycle

    def __enter__(self) -> ScriptedOpenAI:
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/reset_prefix_cache", self._reset_prefix_cache, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/version", self._version, methods=["GET"]),
            ]
        )
        sock = self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="scripted-openai", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._stop()
                raise RuntimeError("the scripted OpenAI server did not start")
            time.sleep(0.005)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                assert self._server is not None
                self._server.force_exit = True
                self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()

    # routes

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _health(self, request: Request) -> Response:
        """vLLM's health route (unauthenticated, as vLLM's is): 200 while the server runs."""
        return Response(status_code=200)

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": "scripted"})

    async def _reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's dev-mode route (it caches nothing here): counted in ``prefix_cache_resets``."""
        with self._lock:
            self.prefix_cache_resets.append(len(self.requests))
        return Response(status_code=200)

    async def _metrics(self, request: Request) -> Response:
        """vLLM's TTFT and E2E histograms (their _sum and _count only), from this server's own stamps:
        a request's arrival to its first token chunk / to [DONE], over the requests that got there;
        ``vllm:generation_tokens_total`` (token-bearing chunks sent, x ``tokens_per_chunk`` of a fixed
        script) and
        ``vllm:num_requests_running`` (requests received and not yet at [DONE]); a zero
        ``vllm:num_requests_waiting``."""
        ttft, e2e = [], []
        generated = running = 0
        with self._lock:
            received = list(self.requests)
        for r in received:
            kinds = dict(reversed(r.sent))  # the first stamp of each kind
            first = min((t for k, t in r.sent if k in ("content", "reasoning", "text")), default=None)
            if first is not None:
                ttft.append(first - r.t_received)
            if "done" in kinds:
                e2e.append(kinds["done"] - r.t_received)
            else:
                running += 1
            generated += sum(1 for k, _ in r.sent if k in ("content", "reasoning", "text"))
        label = f'{{engine="0",model_name="{self.model}"}}'
        lines = []
        for name, values in (("time_to_first_token", ttft), ("e2e_request_latency", e2e)):
            lines += [
                f"# TYPE vllm:{name}_seconds histogram",
                f"vllm:{name}_seconds_sum{label} {sum(values)!r}",
                f"vllm:{name}_seconds_count{label} {float(len(values))!r}",
            ]
        per_chunk = 1 if callable(self.script) else self.script.tokens_per_chunk
        lines += [
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {float(generated * per_chunk)!r}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(running)!r}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0.0",
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _chat(self, request: Request) -> Response:
        return await self._answer(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._answer(request, "completions")

    async def _answer(self, request: Request, api: Literal["chat", "completions"]) -> Response:
        body = await request.json()
        with self._lock:
            received = Received(
                index=len(self.requests),
                path=request.url.path,
                headers={k.lower(): v for k, v in request.headers.items()},
                body=body,
                t_received=time.perf_counter(),
            )
            self.requests.append(received)
        script = self.script(received) if callable(self.script) else self.script
        auth = received.headers.get("authorization")
        echo = {"authorization": auth} if script.echo_auth_in_error else {}
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            return JSONResponse({**wire.UNAUTHORIZED, **echo}, status_code=401)
        if script.refuse_continuous_usage and "continuous_usage_stats" in (body.get("stream_options") or {}):
            return JSONResponse(
                wire.error_body(
                    "Unrecognized request argument: continuous_usage_stats", "BadRequestError", 400
                ),
                status_code=400,
            )
        if api == "completions" and body.get("stream") is False and self.probe:
            return JSONResponse(_probe_answer(body))
        if api == "chat" and body.get("stream") is False and self.answer is not None:
            text = self.answer(body)
            message = {"role": "assistant", "content": text, "reasoning": None}
            return JSONResponse(
                {"id": wire.completion_id(True), "object": "chat.completion", "created": int(time.time()),
                 "model": body.get("model"), "choices": [{"index": 0, "message": message, "logprobs": None,
                 "finish_reason": "stop", "stop_reason": None, "token_ids": None}],
                 "usage": wire.usage(10, len(text.split()))}
            )  # fmt: skip
        if api == "chat" and body.get("tools") and self.tools is not None:
            behaviour = self.tools.next()
            if body.get("stream"):
                events = self.tools.events(body, behaviour)
                return StreamingResponse(events, media_type=wire.SSE_CONTENT_TYPE)
            return JSONResponse(self.tools.response(body, behaviour))
        if script.status != 200:
            content = script.error_body
            if content is None:
                content = wire.error_body(
                    f"scripted failure {script.status}", "InternalServerError", script.status
                )
                content["error"].update(echo)
            if isinstance(content, str):
                return Response(content, status_code=script.status, media_type="text/plain")
            return JSONResponse(content, status_code=script.status)
        return StreamingResponse(self._stream(received, script, api), media_type=wire.SSE_CONTENT_TYPE)

    # the stream

    async def _stream(
        self, received: Received, script: Script, api: Literal["chat", "completions"]
    ) -> AsyncIterator[str]:
        body = received.body
        chat = api == "chat"
        head = wire.chunk_head(chat, body.get("model", self.model))
        mirror = script.reasoning_field == "both"
        total = script.output_tokens if script.output_tokens is not None else int(body["max_tokens"])
        reasoning = min(script.reasoning_tokens, total) if chat else 0
        tokens = [("reasoning", f" r{k}") for k in range(reasoning)]
        tokens += [("content", f" c{k}") for k in range(total - reasoning)]
        groups = _groups(tokens, script.tokens_per_chunk, script.first_chunk_tokens)
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        send_usage = include_usage if script.usage is None else script.usage and include_usage
        asked = bool(options.get("continuous_usage_stats"))
        continuous = (asked if script.continuous_usage is None else script.continuous_usage and asked) and (
            script.usage is not False
        )
        usage_null = not chat and script.usage_null_in_chunks
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(str(prompt).split()) + (10 if chat else 0)  # + a chat template's worth

        def running(done: int) -> dict[str, Any] | None:
            return wire.usage(prompt_tokens, done) if continuous else None

        if self.slots is not None:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.slots)
            await self._slots.acquire()
        self._enter()
        counted = True
        try:
            await asyncio.sleep(script.role_delay_s)
            if chat:
                role = wire.role_chunk(head, running(0), mirror_reasoning=mirror)
                yield self._emit(received, "role", role)
                if script.empty_content_chunk:
                    empty = wire.delta_choice({"content": ""}, mirror_reasoning=mirror)
                    yield self._emit(received, "empty", wire.chunk(head, [empty]))
            for _ in range(script.empty_choices_chunks):
                yield self._emit(received, "no_choices", wire.chunk(head, []))
            await asyncio.sleep(script.first_token_delay_s)
            if not groups:
                finish = (
                    wire.delta_choice({}, "stop", mirror_reasoning=mirror)
                    if chat
                    else wire.text_choice("", "stop")
                )
                yield self._emit(received, "finish", wire.chunk(head, [finish], usage_null=usage_null))
            done = 0
            held: list[str] = []  # token chunks made but not yet written (burst_chunks > 1)
            for n, (kind, text) in enumerate(groups):
                if n:
                    await asyncio.sleep(script.inter_token_s)
                if script.stream_error_after is not None and n == script.stream_error_after:
                    err = wire.error_body("scripted error in stream", "InternalServerError", 500)
                    yield "".join(held) + self._emit(received, "error", err)
                    held = []
                    break
                last = n == len(groups) - 1
                reason = "length" if last else None
                if chat:
                    delta = wire.token_delta(kind, text, script.reasoning_field)
                    choice = wire.delta_choice(delta, reason, mirror_reasoning=mirror)
                else:
                    choice = wire.text_choice(text, reason)
                done += len(text.split())
                token_chunk = wire.chunk(head, [choice], running(done), usage_null=usage_null)
                held.append(self._emit(received, kind, token_chunk))
                if len(held) >= script.burst_chunks or last:
                    yield "".join(held)
                    held = []
            await asyncio.sleep(script.tail_delay_s)
            if send_usage:
                completion = sum(len(g[1].split()) for g in groups)
                if script.usage_completion_tokens is not None:
                    completion = script.usage_completion_tokens
                final = wire.usage(prompt_tokens, completion, reasoning if chat else None)
                yield self._emit(received, "usage", wire.usage_chunk(head, final, chat, "vllm-scripted"))
            self._leave()
            counted = False
            if script.send_done:
                received.sent.append(("done", time.perf_counter()))
                yield wire.DONE
        finally:
            if counted:
                self._leave()
            if self._slots is not None:
                self._slots.release()

    def _emit(self, received: Received, kind: str, chunk: dict[str, Any]) -> str:
        received.sent.append((kind, time.perf_counter()))
        return wire.event(chunk)

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def _groups(tokens: list[tuple[str, str]], size: int, first: int | None = None) -> list[tuple[str, str]]:
    """Tokens joined into chunks of ``size`` (the first of ``first``), never mixing reasoning and
    content in one chunk."""
    out: list[tuple[str, str]] = []
    count = 0
    for kind, text in tokens:
        cap = first if first is not None and len(out) == 1 else size
        if out and out[-1][0] == kind and count < cap:
            out[-1] = (kind, out[-1][1] + text)
            count += 1
        else:
            out.append((kind, text))
            count = 1
    return out


def _probe_answer(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's non-streamed CompletionResponse (completion/protocol.py) for a token-id prompt: the
    continuation's ``token_ids`` (a fixed function of the prompt) and, asked for, ``prompt_logprobs``:
    one entry a prompt token, the first null, each keyed by the token's id."""
    prompt = [int(t) for t in body["prompt"]]
    seed = sum(prompt) % 997
    tokens = [(seed + 31 * k) % 1000 + 10 for k in range(int(body["max_tokens"]))]
    choice: dict[str, Any] = {"index": 0, "text": " ".join(f"t{t}" for t in tokens), "logprobs": None,
                              "finish_reason": "length", "stop_reason": None, "token_ids": tokens,
                              "prompt_logprobs": None, "prompt_token_ids": None}  # fmt: skip
    if body.get("prompt_logprobs") is not None:
        choice["prompt_logprobs"] = [None] + [
            {str(t): {"logprob": -1.0 - ((t * 7 + i) % 50) / 10, "rank": 1, "decoded_token": f"t{t}"}}
            for i, t in enumerate(prompt[1:], 1)
        ]
    return {"id": wire.completion_id(False), "object": "text_completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [choice],
            "usage": wire.usage(len(prompt), len(tokens))}  # fmt: skip
