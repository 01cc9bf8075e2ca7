"""The SSE transport (k3pipe.bench.transport) against servers started here.

Async code runs under ``asyncio.run`` inside plain tests. Three kinds of server:

- the scripted vLLM-style server (uvicorn/Starlette, its own thread), which stamps every chunk with
  ``perf_counter`` just before handing it to its transport: ground truth for the line stamps;
- tiny servers on asyncio streams in the test's own loop (``RawServer``), which write exactly the
  bytes a test wants (one byte at a time, close mid-stream, hold a stream open, TLS);
- no server at all: the connection's protocol fed by hand, for every split of a response.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx
import pytest

from k3pipe.bench import transport as tr
from k3pipe.bench.transport import (
    ConnectError,
    ConnectionClosedError,
    HttpxSSE,
    ProtocolError,
    SSEPool,
    StreamResult,
    StreamTimeout,
    TransportError,
)
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI

pytestmark = pytest.mark.serial

BODY = json.dumps(
    {
        "model": "scripted",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
).encode()


class Lines:
    """An ``on_line`` that keeps (line, stamp) and ends the stream at ``data: [DONE]``."""

    def __init__(self) -> None:
        self.got: list[tuple[bytes, float]] = []
        self.first = asyncio.Event()

    def __call__(self, line: bytes, t: float) -> bool:
        self.got.append((line, t))
        self.first.set()
        return line == b"data: [DONE]"

    @property
    def lines(self) -> list[bytes]:
        return [line for line, _ in self.got]


# --- a tiny server on asyncio streams ---

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Runs ``handler(reader, writer)`` for each connection; counts connections and their closes."""

    def __init__(
        self, handler: Handler, *, ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.handler = handler
        self.host = host
        self.ssl_context = ssl_context
        self.connections = 0
        self.closed = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, self.host, 0, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.handler(reader, writer)
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a cancelled handler returns: asyncio's stream server logs cancelled ones as errors
        finally:
            self._tasks.discard(task)
            self.closed += 1
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes] | None:
    """One request: (request line, lower-cased headers, body), or None at end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    first, *rest = head[:-4].split(b"\r\n")
    headers = {}
    for line in rest:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return first, headers, body


async def peer_closed(reader: asyncio.StreamReader) -> None:
    """Wait until the client closes (EOF or reset)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


def chunk(data: bytes, extension: bytes = b"", upper: bool = False) -> bytes:
    """One chunk of chunked transfer-encoding."""
    size = b"%X" % len(data) if upper else b"%x" % len(data)
    return size + extension + b"\r\n" + data + b"\r\n"


def chunked(*pieces: bytes) -> bytes:
    """A whole chunked body, terminator included."""
    return b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


async def sse_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with the three EVENTS, keep-alive."""
    while await read_request(reader) is not None:
        writer.write(SSE_HEAD + chunked(*EVENTS))
        await writer.drain()


# --- the scripted vLLM-style server ---


def test_vllm_stream_end_to_end_with_exact_stamps() -> None:
    script = Script(role_delay_s=0.03, first_token_delay_s=0.03, inter_token_s=0.03, tail_delay_s=0.03)
    with ScriptedOpenAI(script, api_key="sk-test") as server:

        async def go() -> tuple[StreamResult, Lines]:
            on_line = Lines()
            async with SSEPool(server.base_url, headers={"Authorization": "Bearer sk-test"}) as pool:
                result = await pool.post_stream("/chat/completions", BODY, on_line, 10)
            return result, on_line

        result, on_line = asyncio.run(go())
    (received,) = server.requests
    assert received.path == "/v1/chat/completions"
    assert received.headers["authorization"] == "Bearer sk-test"
    assert received.headers["content-type"] == "application/json"
    assert received.headers["accept"] == "text/event-stream"
    assert received.body["max_tokens"] == 4
    assert result.status == 200
    assert result.headers["content-type"].startswith("text/event-stream")
    assert result.error_body is None
    assert result.reused is False
    # (not "t_sent <= t_received": the server thread may take the GIL between write and stamp)
    assert result.t_sent < received.first_sent("role")
    assert result.t_written == result.t_sent  # a small request goes to the kernel at once
    data = [(line, t) for line, t in on_line.got if line]
    assert all(line.startswith(b"data: ") for line, _ in data)
    kinds = [kind for kind, _ in received.sent]
    assert kinds == ["role", "content", "content", "content", "content", "usage", "done"]
    assert len(data) == len(received.sent)
    chunks = [json.loads(line[6:]) for line, _ in data[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:5]] == [" c0", " c1", " c2", " c3"]
    assert data[-1][0] == b"data: [DONE]"
    assert result.t_end == data[-1][1]
    # each line is stamped after the server sent its chunk, and before the next one (the scripted
    # delays separate every chunk but usage -> [DONE], which go out back to back)
    for k, ((_, t), (_, sent)) in enumerate(zip(data, received.sent, strict=True)):
        assert t >= sent
        if kinds[k] != "usage" and k + 1 < len(received.sent):
            assert t < received.sent[k + 1][1]
    # SSE blank lines between events reach on_line too, stamped with their event
    assert on_line.lines.count(b"") == len(data) - 1


def test_error_status_json_and_text_bodies() -> None:
    with ScriptedOpenAI() as server:

        async def go() -> list[tuple[StreamResult, Lines]]:
            out = []
            async with SSEPool(server.base_url, max_connections=1) as pool:
                for script in (Script(status=500), Script(status=503, error_body="<html>down</html>")):
                    server.script = script
                    on_line = Lines()
                    out.append((await pool.post_stream("/chat/completions", BODY, on_line, 10), on_line))
            return out

        (json_result, json_lines), (html_result, html_lines) = asyncio.run(go())
    assert json_result.status == 500
    assert json_result.error_body is not None
    assert json.loads(json_result.error_body)["error"]["message"] == "scripted failure 500"
    assert html_result.status == 503
    assert html_result.error_body == b"<html>down</html>"
    assert html_result.reused  # an error with a Content-Length leaves the connection usable
    assert json_lines.got == html_lines.got == []


def test_html_error_page_chunked_is_collected_and_capped() -> None:
    page = b"<html><body>" + b"x" * 200_000 + b"</body></html>"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\n")
            if request[0].startswith(b"POST /small"):
                writer.write(
                    b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"<html>", b"bad gateway</html>")
                )
            else:
                writer.write(b"Content-Length: %d\r\n\r\n" % len(page) + page)
            await writer.drain()

    async def go() -> tuple[StreamResult, StreamResult]:
        async with RawServer(handler) as srv, SSEPool(srv.url) as pool:
            small = await pool.post_stream("/small", b"{}", Lines(), 5)
            big = await pool.post_stream("/big", b"{}", Lines(), 5)
            return small, big

    small, big = asyncio.run(go())
    assert (small.status, small.error_body) == (502, b"<html>bad gateway</html>")
    assert small.headers["content-type"] == "text/html"
    assert big.error_body is not None
    assert len(big.error_body) == 64 * 1024
    assert big.error_body.startswith(b"<html><body>xxx")


# --- framing, byte by byte, over a socket ---


def test_chunked_one_byte_per_write_with_extensions_and_trailers() -> None:
    body = (
        chunk(b"data:", b";ext=1")  # a chunk ends inside a line
        + chunk(b' {"k": 1}\n', b'; a=b; c="d"')
        + chunk(b"\n")
        + chunk(b"data: [DONE]\n\n")
        + b"0\r\nX-Trailer: yes\r\n\r\n"
    )
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Thing: a\r\n  folded\r\n\r\n" + body

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            for i in range(len(response)):
                writer.write(response[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.0005)

    async def go() -> tuple[list[StreamResult], list[Lines], int]:
        results, lines = [], []
        # one connection: the second request waits for the first's terminator (trickling in after
        # [DONE] ended the first call) rather than opening another
        async with RawServer(handler) as srv, SSEPool(srv.url, max_connections=1) as pool:
            for _ in range(2):
                on_line = Lines()
                results.append(await pool.post_stream("/v1/x", b"{}", on_line, 10))
                lines.append(on_line)
            return results, lines, srv.connections

    results, lines, connections = asyncio.run(go())
    for on_line in lines:
        assert on_line.lines == [b'data: {"k": 1}', b"", b"data: [DONE]"]
        stamps = [t for _, t in on_line.got]
        assert stamps == sorted(stamps)
    assert results[0].headers["x-thing"] == "a folded"
    assert [r.reused for r in results] == [False, True]  # drained to the terminator, then reused
    assert connections == 1


def test_content_length_and_read_until_close_bodies() -> None:
    events = b"data: 1\r\n\r\ndata: 2\n\ndata: 3"  # CRLF lines; the last line unterminated

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            if request[0].startswith(b"POST /length"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(events) + events)
                await writer.drain()
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
                for piece in (events[:5], events[5:17], events[17:]):
                    await asyncio.sleep(0.01)
                    writer.write(piece)
                    await writer.drain()
                return  # closing the connection ends the body

    async def go() -> tuple[list[StreamResult], list[Lines], int]:
        results, lines = [], []
        async with RawServer(handler) as srv, SSEPool(srv.url, max_connections=1) as pool:
            for path in ("/length", "/length", "/close", "/length"):
                on_line = Lines()
                results.append(await pool.post_stream(path, b"{}", on_line, 10))
                lines.append(on_line)
            return results, lines, srv.connections

    results, lines, connections = asyncio.run(go())
    for on_line in lines:
        assert on_line.lines == [b"data: 1", b"", b"data: 2", b"", b"data: 3"]
    assert [r.reused for r in results] == [False, True, True, False]
    assert connections == 2  # a body read to the close cannot leave its connection usable


# --- connection reuse and limits ---


def test_keep_alive_reuse_and_connection_close() -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + chunked(*EVENTS))
        await writer.drain()
        await peer_closed(reader)

    async def go(handler: Handler) -> tuple[list[StreamResult], int, int]:
        async with RawServer(handler) as srv, SSEPool(srv.url) as pool:
            results = [await pool.post_stream("/", b"{}", Lines(), 5) for _ in range(3)]
            await asyncio.sleep(0.05)
            return results, srv.connections, pool.connections

    results, connections, open_now = asyncio.run(go(sse_forever))
    assert [r.reused for r in results] == [False, True, True]
    assert connections == 1
    assert open_now == 1
    assert all(r.t_connect_s < results[0].t_connect_s for r in results[1:])

    results, connections, open_now = asyncio.run(go(closing))
    assert [r.reused for r in results] == [False, False, False]
    assert connections == 3
    assert open_now == 0


def test_a_stale_idle_connection_is_replaced_once() -> None:
    """The server drops a kept-alive connection as the next request arrives (its keep-alive timeout
    racing the request): that request is sent again, once, on a new connection."""

    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunked(*EVENTS))  # keep-alive promised...
        await writer.drain()
        await read_request(reader)  # ...but the next request gets a close, not an answer

    async def go() -> tuple[StreamResult, StreamResult, int]:
        async with RawServer(one_per_connection) as srv, SSEPool(srv.url) as pool:
            first = await pool.post_stream("/", b"{}", Lines(), 5)
            second = await pool.post_stream("/", b"{}", Lines(), 5)
            return first, second, srv.connections

    first, second, connections = asyncio.run(go())
    assert first.reused is False
    assert second.status == 200
    assert second.reused is False
    assert connections == 2


def test_drain_after_done_holds_the_slot_then_reuses() -> None:
    """[DONE] ends the call at once; the terminator comes later; the next request waits for it."""

    async def late_terminator(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(SSE_HEAD + chunk(EVENTS[2]))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def go() -> tuple[StreamResult, StreamResult, int]:
        async with RawServer(late_terminator) as srv, SSEPool(srv.url, max_connections=1) as pool:
            first = await pool.post_stream("/", b"{}", Lines(), 5)
            second = await pool.post_stream("/", b"{}", Lines(), 5)
            return first, second, srv.connections

    first, second, connections = asyncio.run(go())
    assert second.reused
    assert connections == 1
    assert second.wait_s >= 0.05  # the drain, before t_sent: not server time
    assert second.t_sent - first.t_end >= 0.05


def test_drain_timeout_drops_the_connection() -> None:
    async def no_terminator(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(EVENTS[2]))
        await writer.drain()
        await peer_closed(reader)

    async def go() -> tuple[list[StreamResult], int, int]:
        async with (
            RawServer(no_terminator) as srv,
            SSEPool(srv.url, max_connections=1, drain_timeout_s=0.05) as pool,
        ):
            results = [await pool.post_stream("/", b"{}", Lines(), 5) for _ in range(2)]
            await asyncio.sleep(0.1)
            return results, srv.connections, srv.closed

    results, connections, closed = asyncio.run(go())
    assert [r.reused for r in results] == [False, False]
    assert connections == 2
    assert closed == 2


def test_max_connections_is_respected_and_waiting_comes_before_t_sent() -> None:
    release = asyncio.Event()

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(SSE_HEAD + chunk(EVENTS[0]))  # part of the stream, then wait
            await writer.drain()
            await release.wait()
            writer.write(chunk(EVENTS[2]) + b"0\r\n\r\n")
            await writer.drain()

    async def go() -> tuple[list[StreamResult], int, int]:
        nonlocal release
        release = asyncio.Event()
        async with RawServer(held) as srv, SSEPool(srv.url, max_connections=3) as pool:
            firsts = [Lines() for _ in range(3)]
            tasks = [asyncio.create_task(pool.post_stream("/", b"{}", f, 5)) for f in firsts]
            for f in firsts:
                await asyncio.wait_for(f.first.wait(), 5)
            extra = asyncio.create_task(pool.post_stream("/", b"{}", Lines(), 5))
            await asyncio.sleep(0.1)
            assert not extra.done()
            during = srv.connections
            release.set()
            results = [*await asyncio.gather(*tasks), await extra]
            return results, during, srv.connections

    results, during, connections = asyncio.run(go())
    assert during == 3
    assert connections == 3
    *three, fourth = results
    assert fourth.reused
    assert fourth.wait_s >= 0.1
    assert fourth.t_connect_s >= fourth.wait_s
    assert fourth.t_sent >= min(r.t_end for r in three)


# --- failures ---


def test_connection_refused_names_the_url() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once it is closed

    async def go() -> None:
        async with SSEPool(f"http://127.0.0.1:{port}/v1") as pool:
            await pool.post_stream("/chat/completions", b"{}", Lines(), 5)

    with pytest.raises(ConnectError, match=rf"http://127\.0\.0\.1:{port}/v1/chat/completions") as info:
        asyncio.run(go())
    assert info.value.t_sent is None  # nothing was sent


def test_close_mid_stream_is_a_transport_error_and_the_pool_recovers() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None
        if request[0].startswith(b"POST /cut"):
            writer.write(SSE_HEAD + chunk(EVENTS[0]) + b"40\r\ndata: {")
            await writer.drain()
            return
        writer.write(SSE_HEAD + chunked(*EVENTS))
        await writer.drain()
        await peer_closed(reader)

    async def go() -> tuple[Lines, TransportError, StreamResult, int]:
        on_line = Lines()
        async with RawServer(cut) as srv, SSEPool(srv.url) as pool:
            with pytest.raises(ConnectionClosedError) as info:
                await pool.post_stream("/cut", b"{}", on_line, 5)
            after = await pool.post_stream("/ok", b"{}", Lines(), 5)
            return on_line, info.value, after, pool.connections

    on_line, error, after, open_now = asyncio.run(go())
    assert on_line.lines == [b'data: {"n": 1}', b""]
    assert "/cut" in str(error)
    assert "closed the connection after" in str(error)
    assert error.t_sent is not None
    assert after.status == 200
    assert after.reused is False
    assert open_now == 1


def test_malformed_responses_are_protocol_errors() -> None:
    answers = {
        b"/garbage": b"SSH-2.0-OpenSSH_9.0\r\n\r\n",
        b"/size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"/length": b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
    }

    async def bad(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None
        writer.write(answers[request[0].split()[1]])
        await writer.drain()
        await peer_closed(reader)

    async def go() -> list[str]:
        messages = []
        async with RawServer(bad) as srv, SSEPool(srv.url) as pool:
            for path in answers:
                with pytest.raises(ProtocolError) as info:
                    await pool.post_stream(path.decode(), b"{}", Lines(), 5)
                messages.append(str(info.value))
            assert pool.connections == 0
        return messages

    garbage, size, length = asyncio.run(go())
    assert "not an HTTP/1.x status line" in garbage
    assert "/garbage" in garbage
    assert "bad chunk size" in size
    assert "bad Content-Length" in length


def test_timeout_discards_the_connection() -> None:
    closed = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        await writer.drain()
        await peer_closed(reader)
        closed.set()

    async def go() -> tuple[float, int, TimeoutError, float]:
        nonlocal closed
        closed = asyncio.Event()
        async with RawServer(stall) as srv, SSEPool(srv.url) as pool:
            t0 = time.perf_counter()
            with pytest.raises(TimeoutError, match=r"/slow: no complete response within 0.2 s") as info:
                await pool.post_stream("/slow", b"{}", Lines(), 0.2)
            took = time.perf_counter() - t0
            await asyncio.wait_for(closed.wait(), 2)
            return took, pool.connections, info.value, t0

    took, open_now, error, t0 = asyncio.run(go())
    assert isinstance(error, StreamTimeout)
    assert error.t_sent is not None
    assert t0 < error.t_sent < t0 + 0.1
    assert 0.15 < took < 1.0
    assert open_now == 0


def test_cancellation_closes_the_connection_and_the_pool_recovers() -> None:
    closed = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request is not None
        if request[0].startswith(b"POST /ok"):
            writer.write(SSE_HEAD + chunked(*EVENTS))
            await writer.drain()
            await peer_closed(reader)
            return
        writer.write(SSE_HEAD + chunk(EVENTS[0]))
        await writer.drain()
        await peer_closed(reader)
        closed.set()

    async def go() -> tuple[StreamResult, int]:
        nonlocal closed
        closed = asyncio.Event()
        async with RawServer(endless) as srv, SSEPool(srv.url, max_connections=1) as pool:
            on_line = Lines()
            task = asyncio.create_task(pool.post_stream("/endless", b"{}", on_line, 30))
            await asyncio.wait_for(on_line.first.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(closed.wait(), 2)  # the server saw the connection closed
            assert pool.connections == 0
            after = await asyncio.wait_for(pool.post_stream("/ok", b"{}", Lines(), 5), 5)
            return after, srv.connections

    after, connections = asyncio.run(go())
    assert after.status == 200  # the slot came back (max_connections=1)
    assert connections == 2


def test_on_line_exceptions_reach_the_caller() -> None:
    def explode(line: bytes, t: float) -> bool:
        raise RuntimeError("boom")

    async def go() -> int:
        async with RawServer(sse_forever) as srv, SSEPool(srv.url) as pool:
            with pytest.raises(RuntimeError, match="boom"):
                await pool.post_stream("/", b"{}", explode, 5)
            return pool.connections

    assert asyncio.run(go()) == 0


# --- TLS ---


def _self_signed(tmp_path: Path) -> tuple[Path, Path, bytes]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "k3pipe test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(pem)
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file, pem


def test_https_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert_file, key_file, pem = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert_file, key_file)
    trusting = ssl.create_default_context(cadata=pem.decode())

    async def go() -> tuple[list[StreamResult], list[Lines], int, str]:
        # the refused handshake below makes asyncio's server log an error: not this test's concern
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        results, lines = [], []
        async with RawServer(sse_forever, ssl_context=server_ctx) as srv:
            async with SSEPool(srv.url, ssl=trusting) as pool:
                for _ in range(2):
                    on_line = Lines()
                    results.append(await pool.post_stream("/v1/chat/completions", b"{}", on_line, 5))
                    lines.append(on_line)
            async with SSEPool(srv.url) as default_trust:  # the system's CAs do not know this cert
                with pytest.raises(ConnectError) as info:
                    await default_trust.post_stream("/v1/chat/completions", b"{}", Lines(), 5)
            return results, lines, srv.connections, str(info.value)

    results, lines, connections, refused = asyncio.run(go())
    assert [r.status for r in results] == [200, 200]
    assert [r.reused for r in results] == [False, True]
    assert lines[0].lines == [b'data: {"n": 1}', b"", b'data: {"n": 2}', b"", b"data: [DONE]"]
    assert "https://127.0.0.1:" in refused
    assert "CERTIFICATE_VERIFY_FAILED" in refused or "certificate" in refused.lower()
    assert connections == 1


# --- every split of a response, fed by hand ---


class _FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


CHUNKED_RESPONSE = (
    b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunk(b"data: a", b";x=y")
    + chunk(b"\r\n\r\n: comment\n", upper=True)
    + chunk(b"data: bb\r\n\r\ndata: c\r\n", b'; q="1;2"', upper=True)
    + chunk(b"\n")
    + chunk(b"data: [DONE]\n\n")
    + chunk(b"data: after done, drained\n\n")
    + b"0\r\nTrailer-One: 1\r\nTrailer-Two: 2\r\n\r\n"
)
CHUNKED_LINES = [b"data: a", b"", b": comment", b"data: bb", b"", b"data: c", b"", b"data: [DONE]"]


@dataclass
class Fed:
    lines: list[bytes]
    answered: bool  # the caller got its result (no exception)
    phase: int
    keep_alive: bool


def _feed(pieces: list[bytes]) -> Fed:
    """Feed a response to a connection by hand, in these pieces."""

    async def go() -> Fed:
        pool = SSEPool("http://test.invalid")
        conn = tr._Conn(pool)
        conn.connection_made(_FakeTransport())
        on_line = Lines()
        waiter, _ = conn.send(b"POST / HTTP/1.1\r\n\r\n", on_line, "http://test.invalid/")
        for piece in pieces:
            conn.data_received(piece)
        answered = waiter.done() and waiter.exception() is None
        return Fed(on_line.lines, answered, conn.phase, conn.keep_alive)

    return asyncio.run(go())


def test_every_two_way_split_of_a_chunked_response() -> None:
    async def go() -> None:
        for cut in range(1, len(CHUNKED_RESPONSE)):
            pool = SSEPool("http://test.invalid")
            conn = tr._Conn(pool)
            conn.connection_made(_FakeTransport())
            on_line = Lines()
            waiter, _ = conn.send(b"x", on_line, "http://test.invalid/")
            conn.data_received(CHUNKED_RESPONSE[:cut])
            conn.data_received(CHUNKED_RESPONSE[cut:])
            assert on_line.lines == CHUNKED_LINES, cut
            assert waiter.done(), cut
            assert waiter.exception() is None, cut
            assert conn.phase == tr._DONE, cut
            assert conn.reusable(), cut
            assert conn.status == 200
            assert conn.headers["content-type"] == "text/event-stream"

    asyncio.run(go())


def test_one_byte_reads_and_bare_lf_framing() -> None:
    fed = _feed([CHUNKED_RESPONSE[i : i + 1] for i in range(len(CHUNKED_RESPONSE))])
    assert fed == Fed(CHUNKED_LINES, answered=True, phase=tr._DONE, keep_alive=True)
    lenient = b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n8\ndata: x\n\n0\n\n"
    assert _feed([lenient]) == Fed([b"data: x"], answered=True, phase=tr._DONE, keep_alive=True)


def test_bytes_after_a_response_make_the_connection_unusable() -> None:
    fed = _feed([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiEXTRA"])
    assert fed.answered
    assert not fed.keep_alive


def test_http10_and_204() -> None:
    fed = _feed([b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"])
    assert fed.answered
    assert not fed.keep_alive
    fed = _feed([b"HTTP/1.1 204 No Content\r\n\r\n"])
    assert fed == Fed([], answered=True, phase=tr._DONE, keep_alive=True)


def test_an_unterminated_last_line_and_a_huge_line_split_across_reads() -> None:
    line = b"data: " + b"x" * 300_000
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(line) + 2 + 7)
    body = line + b"\n\ndata: z"
    pieces = [head] + [body[i : i + 65536] for i in range(0, len(body), 65536)]
    assert _feed(pieces) == Fed([line, b"", b"data: z"], answered=True, phase=tr._DONE, keep_alive=True)


# --- construction, and the httpx adapter ---


def test_base_urls() -> None:
    assert SSEPool("http://[::1]:8000/v1/").url == "http://[::1]:8000/v1"
    assert SSEPool("https://example.com:443").url == "https://example.com"
    assert SSEPool("http://h/v1")._head_fields.startswith(b"Host: h\r\n")
    assert b"Host: [::1]:8000\r\n" in SSEPool("http://[::1]:8000")._head_fields
    for bad in ("ftp://h/", "http:///v1", "http://u:p@h/", "http://h:99999/", "http://h/?q=1"):
        with pytest.raises(ValueError, match="base URL"):
            SSEPool(bad)
    with pytest.raises(ValueError, match="set by the transport"):
        SSEPool("http://h", headers={"Content-Length": "3"})
    with pytest.raises(ValueError, match="not a valid"):
        SSEPool("http://h", headers={"X-A": "b\r\nX-Injected: 1"})
    custom = SSEPool("http://h", headers={"accept": "*/*", "Authorization": "Bearer k"})._head_fields
    assert b"accept: */*\r\n" in custom
    assert b"Accept: text/event-stream" not in custom
    assert b"Authorization: Bearer k\r\n" in custom


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")

    async def go() -> tuple[StreamResult, str]:
        try:
            srv = await RawServer(sse_forever, host="::1").__aenter__()
        except OSError:
            pytest.skip("cannot listen on ::1")
        try:
            async with SSEPool(srv.url) as pool:
                return await pool.post_stream("/v1/x", b"{}", Lines(), 5), srv.url
        finally:
            await srv.__aexit__(None, None, None)

    result, url = asyncio.run(go())
    assert result.status == 200
    assert url.startswith("http://[::1]:")


def test_httpx_adapter_same_contract() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/bad"):
            return httpx.Response(400, json={"error": "no"})
        assert request.headers["authorization"] == "Bearer k"
        assert request.headers["accept"] == "text/event-stream"
        return httpx.Response(200, content=b"data: 1\r\n\r\ndata: [DONE]\n\ndata: never\n\n")

    async def go() -> tuple[StreamResult, Lines, StreamResult]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            sender = HttpxSSE(client, "http://engine.test/v1/", {"Authorization": "Bearer k"})
            on_line = Lines()
            ok = await sender.post_stream("/chat/completions", b"{}", on_line, 5)
            bad = await sender.post_stream("/bad", b"{}", Lines(), 5)
            return ok, on_line, bad

    ok, on_line, bad = asyncio.run(go())
    assert ok.status == 200
    assert on_line.lines == [b"data: 1", b"", b"data: [DONE]"]
    assert ok.t_end == on_line.got[-1][1]
    assert bad.status == 400
    assert bad.error_body == b'{"error":"no"}'
