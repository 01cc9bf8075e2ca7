"""A scripted OpenAI-compatible SSE server that emits tokens on an exact schedule, on 127.0.0.1.

Ground truth for benchmark clients (``benchmarks/client_vs_peers.py``): every request is answered on a
schedule fixed in advance, so a client's TTFT and inter-token latencies can be compared with the
truth. The schedule of one request, all times on ``CLOCK_MONOTONIC`` (``time.perf_counter()``)::

    t_received                         the read that completed the request body returned
    t_received + ttft                  first token-bearing chunk
    t_received + ttft + i * gap_ms     chunk i (0-based), each carrying tokens_per_chunk tokens

where ``ttft = ttft_ms + U[0, ttft_jitter_ms)`` (seeded; the jitter spreads the streams' phases so
that not every stream emits at the same instant). Each record keeps its own ``due`` times.

The stream has ``max_tokens`` tokens (``max_completion_tokens`` for chat, as ``vllm bench serve``
sends it; the script's ``output_tokens`` when it sets one and the request asks for more), the first
``reasoning_tokens`` of them in ``delta.reasoning`` (chat), the rest in ``delta.content`` or
``text``. Options: ``role``: ``merged`` (the role rides in the first token chunk: one SSE event per
chunk, nothing else), ``with_first`` (vLLM's own behaviour: a ``{"role": "assistant", "content":
""}`` chunk written together with the first token chunk) or ``early`` (that role chunk at
``t_received``, before any token). ``stream_options.include_usage`` adds the final usage chunk
(``choices: []``), ``stream_options.continuous_usage_stats`` puts ``usage`` with the running
``completion_tokens`` on every chunk; ``data: [DONE]`` ends every stream.

The chunks are vLLM 0.32.0's, built by ``k3pipe/testing/openai_wire.py`` (which says where each shape
comes from); the last token chunk has ``finish_reason: "length"``.

Why it is built this way (accuracy at 1000 streams on 2 cores):

- A minimal HTTP/1.1 server on ``asyncio.Protocol`` (no framework): one ``send`` per event and none
  when a request arrives (the response head goes out with the first chunk), chunk JSON cached per
  kind of stream (a burst of 1000 requests must not make the running streams late), no per-event
  JSON encoding: a chunk is its request's head text and a cached body text, joined when written.
- Each stream's next chunk is a ``loop.call_at`` on an absolute grid, so a late chunk never delays
  the ones after it.
- asyncio waits in ``epoll_wait``, whose timeout is whole milliseconds (rounded up): a timer would
  fire up to 1 ms late (measured here: p50 1.1 ms, p99 2-25 ms late for a 10 ms timer). The
  selector here waits in epoll only for the whole milliseconds well before a deadline, then in
  50 us sleeps with a non-blocking poll between them; the process's timer slack is set to 1 ns
  (``prctl(PR_SET_TIMERSLACK)``) so the sleeps end on time (measured: p50 30 us, p99 60 us late).
  ``--spin-us`` adds a busy poll before each deadline (tighter, but at high event rates it keeps
  the core busy, and under SCHED_FIFO the kernel's RT throttling then stops the server for 50 ms
  of every second: measured 5 ms p99 lateness at 10,000 events/s with a 100 us spin).
- The garbage collector is off while streams run (collected on ``/_control/reset``).
- Pin it to a core of its own (``--cpu``) so that it never waits for the client under test, and
  give it ``--realtime`` priority on a shared machine, so that other work cannot preempt it.

The server records, per request, when each event was due and when it was handed to the kernel
(``sent``, stamped just before ``transport.write``), so a report can show how late the server
itself was; and whether any write found the socket's send buffer full (``buffered``: the client
did not read fast enough, so the kernel, not the server, held the bytes).

Control endpoints (JSON): ``POST /_control/script`` sets the script of the following requests;
``POST /_control/reset`` forgets the recorded requests; ``GET /_control/records`` returns them.

**Several worker processes** (``--workers N [--cpus A,B,...]``): one Python process writes at most
a few tens of thousands of events per second on time (measured on the GPU node's cores: late by
tens of ms at 80,000 events/s), so a benchmark of a sharded client at 100,000+ events/s needs the
server sharded too. Each worker is a process of its own (forked before any event loop exists), on
its CPU of ``--cpus`` (worker k on the k-th, modulo), with its own listening socket on the one port
(``SO_REUSEPORT``: the kernel spreads the connections over the workers by their address hash), its
own script, records and jitter generator (seeded with its index), and a **control port** of its own:
``/_control/*`` on the shared port would reach one worker at random, so it is refused there (409)
and the parent prints every worker's control port instead. A record says which ``worker`` served it;
connection serial numbers are unique across workers (worker k counts from k x 10,000,000). The
parent reserves the port (bound with ``SO_REUSEPORT``, never listening) until every worker listens,
and on SIGTERM/SIGINT stops its workers and waits for them.

Run: ``python k3pipe/testing/exact_server.py [--port 0] [--cpu N] [--workers N --cpus A,B]``; it prints
``{"port": P, "pid": ...}`` (with workers: and ``"workers": [{"pid", "cpu", "control_port"}, ...]``)
on one line of stdout when it listens, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import gc
import hashlib
import json
import math
import os
import random
import selectors
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

# The wire format is spelled once, in k3pipe/testing/openai_wire.py (beside the fake engine, which runs
# alone in an image); run as a script, this file has only k3pipe/testing/ on sys.path, so add the root
# of the checkout it sits in (an installed k3pipe is found either way).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from k3pipe.testing import openai_wire as wire  # noqa: E402

__all__ = ["PreciseSelector", "Script", "main", "serve", "set_realtime"]

_PR_SET_TIMERSLACK = 29
_SERIALS_PER_WORKER = 10_000_000
# Head of every streaming answer: chunked transfer, as uvicorn sends vLLM's StreamingResponse.
_SSE_HEAD = (
    f"HTTP/1.1 200 OK\r\ncontent-type: {wire.SSE_CONTENT_TYPE}\r\n"
    "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
).encode()
# data: [DONE] and the end of the chunked body
_DONE = wire.http_chunk(wire.DONE.encode()) + wire.HTTP_LAST_CHUNK
_MAX_HEAD_BYTES = 64 * 1024
# A completion_tokens no stream reaches: _Plan.of's chunk templates carry it, and prompt_tokens + _MARK,
# where the counts go (both 16 digits long, so neither is found inside the other).
_MARK = 10**15


@dataclass(frozen=True)
class Script:
    """How the server answers the streaming requests that follow. Times are in milliseconds."""

    ttft_ms: float = 20.0  # request fully received -> first token-bearing chunk
    ttft_jitter_ms: float = 0.0  # plus a uniform draw from [0, ttft_jitter_ms) per request (seeded)
    gap_ms: float = 10.0  # between consecutive token chunks
    tokens_per_chunk: int = 1  # k: tokens carried by each chunk (the last may carry fewer)
    reasoning_tokens: int = 0  # chat: the first tokens go in delta.reasoning
    role: Literal["merged", "with_first", "early"] = "merged"
    output_tokens: int | None = None  # cap on tokens per request; None: the request's max_tokens
    default_max_tokens: int = 16  # when the request gives no max_tokens

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Script:
        """A script from a JSON object; unknown keys are refused (a typo must not go unnoticed)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown script keys {unknown}; known: {sorted(known)}")
        script = cls(**data)
        if script.role not in ("merged", "with_first", "early"):
            raise ValueError(f"role must be merged, with_first or early, got {script.role!r}")
        if script.tokens_per_chunk < 1 or min(script.ttft_ms, script.ttft_jitter_ms, script.gap_ms) < 0:
            raise ValueError("tokens_per_chunk must be >= 1; ttft_ms, ttft_jitter_ms and gap_ms >= 0")
        return script


@dataclass
class _Record:
    """One streaming request as the server saw and answered it (perf_counter seconds)."""

    index: int
    connection: int  # serial number of the TCP connection it came on (reuse shows as repeats)
    path: str
    request_id: str | None  # x-request-id header (vllm bench serve sends one per request)
    prompt_key: str  # sha1 of the prompt text, 16 hex digits (to match clients that send no id)
    tokens: int
    chunks: int
    t_received: float
    t_first_byte: float  # the read that brought the request's first bytes returned
    due: list[float] = field(default_factory=list)  # per token chunk
    sent: list[float] = field(default_factory=list)  # per token chunk, just before the write
    role_sent: float | None = None  # role chunk of role 'early'
    buffered: int = 0  # writes that found data still queued in user space (client not reading)
    completed: bool = False
    worker: int = 0  # the worker process that served it (--workers)


class PreciseSelector(selectors.EpollSelector):
    """epoll whose timeouts end within microseconds instead of on whole milliseconds.

    ``epoll_wait`` takes whole milliseconds and CPython rounds up, so an asyncio timer can fire up
    to a millisecond late. Here epoll sleeps only for the whole milliseconds that end at least
    ``margin_s`` before the deadline; the rest is short sleeps (``slice_s``) with a non-blocking poll
    between them, and a busy poll for the final ``spin_s``. I/O that becomes ready meanwhile is seen
    within one slice.
    """

    def __init__(self, spin_s: float = 0.0, slice_s: float = 50e-6, margin_s: float = 1.5e-3) -> None:
        super().__init__()
        self.spin_s, self.slice_s, self.margin_s = spin_s, slice_s, margin_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0:
            return super().select(timeout)
        deadline = time.perf_counter() + timeout
        coarse_ms = math.floor((timeout - self.margin_s) * 1000.0)
        if coarse_ms >= 1:
            ready = super().select(coarse_ms / 1000.0)
            if ready:
                return ready
        while True:
            ready = super().select(0)
            if ready:
                return ready
            left = deadline - time.perf_counter()
            if left <= 0:
                return []
            if left > self.spin_s:
                time.sleep(min(self.slice_s, left - self.spin_s))


class _State:
    """What the whole server shares: the script and the records."""

    def __init__(self, model: str, worker: int = 0) -> None:
        self.model = model
        self.worker = worker
        self.script = Script()
        self.records: list[_Record] = []
        self.rng = random.Random(worker)
        self.connections = worker * _SERIALS_PER_WORKER

    def reset(self) -> None:
        self.records = []
        self.rng = random.Random(self.worker)
        gc.collect()


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: requests one after the other (keep-alive), no pipelining needed."""

    def __init__(self, state: _State, loop: asyncio.AbstractEventLoop, control: bool = True) -> None:
        self.state = state
        self.loop = loop
        self.control = control  # /_control/* served here (not on a port shared by several workers)
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.busy = False  # a response is being streamed
        self.close_after = False
        self.handle: asyncio.TimerHandle | None = None
        self.t_first_byte: float | None = None  # of the request being read
        self.serial = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.state.connections += 1
        self.serial = self.state.connections

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.transport = None

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # the read that delivered these bytes returned
        if self.t_first_byte is None:
            self.t_first_byte = now
        self.buffer += data
        if not self.busy:
            self._next_request(now)

    # request parsing

    def _next_request(self, now: float) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD_BYTES:
                self._plain(431, {"error": "request head too large"}, close=True)
            return
        head = self.buffer[:end].decode("latin-1").split("\r\n")
        try:
            method, target, _version = head[0].split(" ", 2)
        except ValueError:
            self._plain(400, {"error": f"bad request line {head[0]!r}"}, close=True)
            return
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._plain(411, {"error": "send a Content-Length body"}, close=True)
            return
        length = int(headers.get("content-length") or 0)
        if len(self.buffer) < end + 4 + length:
            return  # the body is still coming
        body = self.buffer[end + 4 : end + 4 + length]
        self.buffer = self.buffer[end + 4 + length :]
        self.t_first_byte, t_first_byte = (now if self.buffer else None), self.t_first_byte or now
        self.close_after = headers.get("connection", "").lower() == "close"
        self._route(method, target.split("?", 1)[0], headers, body, now, t_first_byte)

    def _route(
        self, method: str, path: str, headers: dict[str, str], body: bytes, now: float, t_first_byte: float
    ) -> None:
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            try:
                request = json.loads(body)
            except ValueError as exc:
                self._plain(400, wire.error_body(f"body is not JSON: {exc}", "BadRequestError", 400))
                return
            self._stream(path, headers, request, now, t_first_byte)
        elif method == "GET" and path == "/v1/models":
            model = {
                "id": self.state.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": self.state.model,
                "parent": None,
                "max_model_len": 1 << 20,
            }
            self._plain(200, {"object": "list", "data": [model]})
        elif method == "GET" and path == "/health":
            self._plain(200, None)
        elif path.startswith("/_control/") and not self.control:
            message = "this port is shared by several workers: use each worker's control port"
            self._plain(409, wire.error_body(message, "ConflictError", 409))
        elif method == "POST" and path == "/_control/script":
            try:
                self.state.script = Script.from_json(json.loads(body or b"{}"))
            except (ValueError, TypeError) as exc:
                self._plain(400, {"error": str(exc)})
                return
            self._plain(200, {"script": asdict(self.state.script)})
        elif method == "POST" and path == "/_control/reset":
            self.state.reset()
            self._plain(200, {"ok": True})
        elif method == "GET" and path == "/_control/records":
            self._plain(
                200, {"script": asdict(self.state.script), "records": [asdict(r) for r in self.state.records]}
            )
        else:
            self._plain(404, wire.error_body(f"no route {method} {path}", "NotFoundError", 404))

    def _plain(self, status: int, payload: Any, close: bool = False) -> None:
        if self.transport is None:
            return
        body = b"" if payload is None else json.dumps(payload).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        if close or self.close_after:
            self.transport.close()
        elif self.buffer:
            self._next_request(time.perf_counter())

    # the stream

    def _stream(
        self, path: str, headers: dict[str, str], request: dict[str, Any], now: float, t_first_byte: float
    ) -> None:
        script = self.state.script
        chat = path.endswith("chat/completions")
        asked = request.get("max_completion_tokens") if chat else None
        if asked is None:
            asked = request.get("max_tokens")
        tokens = int(asked) if asked is not None else script.default_max_tokens
        if script.output_tokens is not None:
            tokens = min(tokens, script.output_tokens)
        tokens = max(tokens, 1)
        options = request.get("stream_options") or {}
        prompt = _prompt_text(request, chat)
        plan = _Plan.of(
            chat,
            script,
            tokens,
            len(prompt.split()),
            bool(options.get("include_usage")),
            bool(options.get("continuous_usage_stats")),
        )
        head = _head(wire.chunk_head(chat, str(request.get("model") or self.state.model)))
        stream = _Stream(plan, head, role_with_first=chat and script.role == "with_first")
        record = _Record(
            index=len(self.state.records),
            connection=self.serial,
            path=path,
            request_id=headers.get("x-request-id"),
            prompt_key=hashlib.sha1(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:16],
            tokens=tokens,
            chunks=len(plan.bodies),
            t_received=now,
            t_first_byte=t_first_byte,
            worker=self.state.worker,
        )
        self.state.records.append(record)
        jitter = self.state.rng.uniform(0.0, script.ttft_jitter_ms) if script.ttft_jitter_ms else 0.0
        t_first = now + (script.ttft_ms + jitter) / 1000.0
        gap_s = script.gap_ms / 1000.0
        record.due = [t_first + i * gap_s for i in range(len(plan.bodies))]
        self.busy = True
        assert self.transport is not None
        if script.role == "early" and chat:
            # the response head goes out with the first chunk, except when a chunk must go at once
            stream.head_sent = True
            record.role_sent = time.perf_counter()
            self.transport.write(_SSE_HEAD + _sse(head + plan.role))
        self.handle = self.loop.call_at(record.due[0], self._emit, stream, record, 0)

    def _emit(self, stream: _Stream, record: _Record, i: int) -> None:
        transport = self.transport
        self.handle = None
        if transport is None or transport.is_closing():
            return
        data = stream.chunk(i)
        last = i == len(stream.plan.bodies) - 1
        queued = transport.get_write_buffer_size()
        record.sent.append(time.perf_counter())
        transport.write(data)
        if queued:
            record.buffered += 1
        if not last:
            self.handle = self.loop.call_at(record.due[i + 1], self._emit, stream, record, i + 1)
            return
        record.completed = True
        self.busy = False
        if self.close_after:
            transport.close()
        elif self.buffer:
            self._next_request(time.perf_counter())


@dataclass(frozen=True)
class _Plan:
    """The chunks of one kind of stream, as JSON text after each chunk's head (cached per kind).

    A chunk is ``head + body``: the head (``{"id":...,"object":...,"created":...,"model":...``) is
    the request's own, the bodies are the same for every request of the same script, token count,
    prompt size and stream options, so a burst of 1000 requests costs the server a dictionary lookup
    each, and each chunk is framed when it is written.
    """

    bodies: tuple[str, ...]  # per token chunk
    role: str  # the role-only chunk
    usage: str | None  # the final usage chunk, if asked

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(
        chat: bool, script: Script, tokens: int, prompt_tokens: int, include_usage: bool, continuous: bool
    ) -> _Plan:
        reasoning = min(script.reasoning_tokens, tokens) if chat else 0
        groups: list[tuple[str, int]] = []  # (kind, tokens), never mixing reasoning and content
        for kind in ["reasoning"] * reasoning + ["content"] * (tokens - reasoning):
            if groups and groups[-1][0] == kind and groups[-1][1] < script.tokens_per_chunk:
                groups[-1] = (kind, groups[-1][1] + 1)
            else:
                groups.append((kind, 1))

        def running(done: int) -> dict[str, Any] | None:
            return wire.usage(prompt_tokens, done) if continuous else None

        # Token chunks differ only in a few shapes and in their running usage: each shape is encoded
        # once, with _MARK for the count, and each chunk's count is put into its text (encoding every
        # chunk made a new plan several times slower: a burst of new kinds of stream would be late).
        marks = (str(prompt_tokens + _MARK), str(_MARK))
        shapes: dict[tuple[str, int, bool, str | None], str] = {}
        bodies: list[str] = []
        done = 0
        for n, (kind, count) in enumerate(groups):
            done += count
            finish = "length" if n == len(groups) - 1 else None
            merged = chat and n == 0 and script.role == "merged"
            shape = shapes.get((kind, count, merged, finish))
            if shape is None:
                text = (" r" if kind == "reasoning" else " t") * count
                if chat:
                    delta = wire.token_delta(kind, text)
                    if merged:
                        delta = {"role": "assistant", **delta}
                    choice = wire.delta_choice(delta, finish)
                else:
                    choice = wire.text_choice(text, finish)
                shape = shapes[kind, count, merged, finish] = _body(wire.chunk({}, [choice], running(_MARK)))
            bodies.append(shape.replace(marks[0], str(prompt_tokens + done)).replace(marks[1], str(done)))
        final = None
        if include_usage:
            total = wire.usage(prompt_tokens, tokens, reasoning if chat else None)
            final = _body(wire.usage_chunk({}, total, chat))
        return _Plan(bodies=tuple(bodies), role=_body(wire.role_chunk({}, running(0))), usage=final)


@dataclass
class _Stream:
    """One response being streamed: its plan, its chunks' head, whether the HTTP head went out."""

    plan: _Plan
    head: str
    role_with_first: bool
    head_sent: bool = False

    def chunk(self, i: int) -> bytes:
        """The bytes of token chunk ``i``, with what must go in the same write."""
        plan, head = self.plan, self.head
        data = _sse(head + plan.bodies[i])
        if i == 0 and self.role_with_first:
            data = _sse(head + plan.role) + data
        if not self.head_sent:
            data = _SSE_HEAD + data
            self.head_sent = True
        if i == len(plan.bodies) - 1:
            if plan.usage is not None:
                data += _sse(head + plan.usage)
            data += _DONE
        return data


def _head(head: dict[str, Any]) -> str:
    """A chunk head's JSON, still open: ``{"id":...,"model":...`` (a ``_body`` closes it)."""
    return wire.dumps(head)[:-1]


def _body(chunk: dict[str, Any]) -> str:
    """A headless chunk's JSON, to follow a ``_head``: together they are the whole chunk's JSON."""
    return "," + wire.dumps(chunk)[1:]


def _sse(payload: str) -> bytes:
    return wire.http_chunk(wire.event(payload).encode())


def _prompt_text(request: dict[str, Any], chat: bool) -> str:
    if not chat:
        prompt = request.get("prompt", "")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    messages = request.get("messages") or [{}]
    content = messages[-1].get("content", "") if isinstance(messages[-1], dict) else ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}] as vllm bench serve sends it
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def set_realtime(priority: int) -> bool:
    """Run this thread under SCHED_FIFO at ``priority`` (0: back to normal); False if refused.

    A process at normal priority that shares its core with other work is preempted for whole
    scheduler slices (measured here: 2-4 ms late at p99 beside one busy process, even at nice -20);
    under SCHED_FIFO it runs as soon as its timer fires. The kernel's RT throttling still leaves
    other work 5% of every second.
    """
    try:
        if priority > 0:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (PermissionError, OSError, AttributeError):
        return False
    return True


def _tighten_timer_slack() -> bool:
    """Ask the kernel to end this process's sleeps within 1 ns of their deadline (default: 50 us)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


async def serve(host: str, port: int, model: str, announce: bool = True) -> None:
    """Serve until SIGTERM/SIGINT; print ``{"port", "pid"}`` on one stdout line once listening."""
    loop = asyncio.get_running_loop()
    state = _State(model)
    server = await loop.create_server(lambda: _Connection(state, loop), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        bound = server.sockets[0].getsockname()[1]
        print(json.dumps({"port": bound, "pid": os.getpid()}), flush=True)
    async with server:
        await stop.wait()


async def _serve_worker(host: str, port: int, model: str, worker: int, ready_fd: int) -> None:
    """One of several workers: the shared port (SO_REUSEPORT, no control) and a control port of its own."""
    loop = asyncio.get_running_loop()
    state = _State(model, worker)
    shared = await loop.create_server(
        lambda: _Connection(state, loop, control=False), host, port, backlog=4096, reuse_port=True
    )
    control = await loop.create_server(lambda: _Connection(state, loop), host, 0)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    os.write(ready_fd, (json.dumps({"control_port": control.sockets[0].getsockname()[1]}) + "\n").encode())
    os.close(ready_fd)
    async with shared, control:
        await stop.wait()


def _run_loop(spin_us: float, main: Any) -> None:
    loop = asyncio.SelectorEventLoop(PreciseSelector(spin_s=spin_us / 1e6))
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()


def _settle(cpu: int | None, realtime: int) -> None:
    """What every serving process does first: its CPU, its priority, its timer slack, no GC."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    if realtime and not set_realtime(realtime):
        print("exact_server: SCHED_FIFO refused (not root?): normal scheduling", file=sys.stderr)
    _tighten_timer_slack()
    gc.disable()  # a collection in the middle of a burst would make every stream late


def serve_workers(args: argparse.Namespace) -> int:
    """``--workers N``: fork N serving processes on one port; announce them; stop them on a signal."""
    cpus = args.cpus or ([args.cpu] if args.cpu is not None else [])
    reserve = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserve.bind((args.host, args.port))  # holds the port; never listens, so it gets no connections
    port = reserve.getsockname()[1]
    workers: list[dict[str, Any]] = []
    pipes: list[int] = []
    for k in range(args.workers):
        cpu = cpus[k % len(cpus)] if cpus else None
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                os.close(read_fd)
                reserve.close()
                _settle(cpu, args.realtime)
                _run_loop(args.spin_us, _serve_worker(args.host, port, args.model, k, write_fd))
            except BaseException:  # a worker must never return into the parent's code
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        pipes.append(read_fd)
        workers.append({"pid": pid, "cpu": cpu})

    def stop_workers(*_: object) -> None:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w["pid"], signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_workers)
    signal.signal(signal.SIGINT, stop_workers)
    try:
        for w, fd in zip(workers, pipes, strict=True):
            with os.fdopen(fd) as ready:
                line = ready.readline()
            if not line:
                raise RuntimeError(f"exact_server: worker {w['pid']} died before listening")
            w["control_port"] = json.loads(line)["control_port"]
        reserve.close()
        print(json.dumps({"port": port, "pid": os.getpid(), "workers": workers}), flush=True)
    except BaseException:
        stop_workers()
        for w in workers:
            os.waitpid(w["pid"], 0)
        raise
    failed = 0
    for w in workers:
        while True:
            try:
                _, status = os.waitpid(w["pid"], 0)
                break
            except InterruptedError:
                continue
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Command line: ``exact_server.py [--host H] [--port P] [--cpu N] [--model NAME] [--spin-us U]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed on stdout)")
    parser.add_argument("--cpu", type=int, default=None, help="pin the server to this CPU")
    parser.add_argument("--model", default="exact", help="model id listed by /v1/models")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=0.0,
        help="busy-poll this long before each deadline (tighter, but keeps the core busy)",
    )
    parser.add_argument(
        "--realtime",
        type=int,
        default=0,
        help="SCHED_FIFO priority (1-99) so other work on the machine cannot delay "
        "the schedule; 0: normal scheduling",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="serving processes on the one port (SO_REUSEPORT), each with a control port of its own",
    )
    parser.add_argument(
        "--cpus",
        type=_cpu_list,
        default=None,
        help="with --workers: comma-separated CPUs, worker k pinned to the k-th (modulo)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1 or args.cpus:
        return serve_workers(args)
    _settle(args.cpu, args.realtime)
    _run_loop(args.spin_us, serve(args.host, args.port, args.model))
    return 0


def _cpu_list(text: str) -> list[int]:
    try:
        cpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus {text!r}: expected CPU numbers like 8,9,10") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"--cpus {text!r}: expected CPU numbers like 8,9,10")
    return cpus


if __name__ == "__main__":
    sys.exit(main())
