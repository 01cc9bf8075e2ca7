"""A minimal HTTP/1.1 client for POST requests that answer with a Server-Sent Events stream.

Why not httpx: on the 2-core bench machine (docs/performance-results.md) the client on httpx + h11
cost 240-480 us of CPU per SSE event, and its ``t_send`` stamp came tens of milliseconds before the
request reached the server at 100 streams (pool and connection set-up on the event loop). This
module speaks just the part of HTTP/1.1 a streaming benchmark needs, on an ``asyncio`` protocol;
there is no proxy support (as httpx with ``trust_env=False``), no redirects, no compression.

- :class:`SSEPool` keeps keep-alive connections to one origin (``http``/``https``; IPv4, IPv6 or a
  host name), at most ``max_connections`` of them, and reuses idle ones last-in first-out. A request
  takes an idle connection, or opens a new one while under the cap, or waits for one to be freed.
- :meth:`SSEPool.post_stream` writes the whole request (head and body) with one ``transport.write``
  and stamps ``t_sent`` right after that write returns, i.e. when the bytes are in the kernel.
  Waiting for a free connection (the cap reached) and opening one (TCP, TLS) happen *before* that
  stamp: they are reported as ``wait_s`` / ``t_connect_s`` and never counted as server time.
- The response is parsed incrementally as reads arrive: status line and headers (split anywhere
  across reads; interim 1xx answers skipped), then the body framed by chunked transfer-encoding
  (sizes, extensions, trailers, split anywhere), Content-Length, or the connection's close. Every
  complete line of a 2xx body (split on ``\\n``, a trailing ``\\r`` removed; blank lines included)
  goes to ``on_line(line, t)``, where ``t`` is one ``time.perf_counter()`` taken as the read that
  completed the line returns (the top of ``buffer_updated``), before any parsing.
- Per read the parser works on the received ``bytes`` with offsets (``bytes.find`` and slices, no
  per-byte Python loops). Only unconsumed framing bytes (a partial chunk-size line or head, bounded)
  are carried into the next read; body bytes are consumed as they arrive, and a line split across
  reads is assembled in a ``bytearray``.

When ``on_line`` returns True (``data: [DONE]``), the call completes at once (``t_end`` is that read's
stamp) and the connection keeps reading the rest of the response in the background (normally just the
chunked terminator, often in the same read), then returns to the pool. It keeps its slot while it
drains, so the pool never holds more than ``max_connections`` sockets (a request that finds no idle
connection meanwhile opens another while under the cap, or waits for the drain, before its
``t_sent``); a response still not complete after ``drain_timeout_s`` has its connection closed.
Give the pool a few connections more than the requests kept in flight (``concurrency + 4``).

A connection goes back to the pool after a complete response unless the server sent
``Connection: close`` (or answered HTTP/1.0 without keep-alive), the body was read to the close, or
anything went wrong. A request on a reused connection that the server had closed meanwhile (its
keep-alive timeout: the connection dies before a single response byte) is sent again once on a new
connection, with new stamps.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl as _ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol
from urllib.parse import urlsplit

import httpx

__all__ = [
    "ConnectError",
    "ConnectionClosedError",
    "HttpxSSE",
    "ProtocolError",
    "SSEPool",
    "SSESender",
    "StreamResult",
    "StreamTimeout",
    "TransportError",
]

OnLine = Callable[[bytes, float], bool]

# Limits on what a server may make this client hold.
_MAX_HEAD = 64 * 1024  # status line + headers (and, separately, trailers)
_MAX_SIZE_LINE = 4096  # one chunk-size line with its extensions
_MAX_LINE = 32 * 1024 * 1024  # one SSE line
_ERROR_BODY = 64 * 1024  # kept of a non-2xx body
_READ_BUFFER = 32 * 1024  # one connection's receive buffer (a read takes at most this much)

# connection phases
_IDLE, _HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH, _EOF, _DONE, _DEAD = range(10)
# what a response's body is for
_SSE, _ERROR, _DRAIN = range(3)

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

_perf = time.perf_counter


class TransportError(Exception):
    """A request failed below HTTP semantics: no connection, a broken connection or malformed HTTP.

    ``t_sent``: when the request was written (as :attr:`StreamResult.t_sent`), None if it never was.
    """

    t_sent: float | None = None


class StreamTimeout(TimeoutError):
    """``timeout_s`` ran out; ``t_sent`` as in :class:`TransportError`."""

    def __init__(self, message: str, t_sent: float | None) -> None:
        super().__init__(message)
        self.t_sent = t_sent


class ConnectError(TransportError):
    """The connection could not be opened (refused, no route, DNS, TLS handshake, connect timeout)."""


class ConnectionClosedError(TransportError):
    """The connection closed or was reset before the response was complete."""

    def __init__(self, message: str, *, response_started: bool) -> None:
        super().__init__(message)
        self.response_started = response_started


class ProtocolError(TransportError):
    """The server's answer is not valid HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class StreamResult:
    """How one streamed request went. Stamps are ``time.perf_counter()`` seconds.

    ``t_connect_s`` is the time from the call to just before the request's write: waiting for a free
    connection (``wait_s`` of it) plus opening one (TCP connect, TLS handshake) when no idle one was
    there. ``t_sent`` is taken right after the one ``transport.write`` of the whole request returned;
    ``t_written`` is when the last byte of the request was in the kernel (the same as ``t_sent``
    unless the body was larger than the socket could take at once; None if the response ended first).
    ``t_end`` is the stamp of the read that completed the response, or that ``on_line`` ended.
    """

    status: int
    headers: dict[str, str]
    t_connect_s: float
    t_sent: float
    t_end: float
    error_body: bytes | None
    reused: bool
    wait_s: float = 0.0
    t_written: float | None = None


class SSESender(Protocol):
    """What a benchmark client needs: :class:`SSEPool`, or :class:`HttpxSSE` over an httpx client."""

    async def post_stream(self, path: str, body: bytes, on_line: OnLine, timeout_s: float) -> StreamResult:
        """POST ``body`` to ``path`` (appended to the base URL's path) and stream the answer."""
        ...


class SSEPool:
    """Keep-alive HTTP/1.1 connections to the origin of ``base_url``, for streamed POST requests.

    ``base_url``: ``http://`` or ``https://``, a host (name, IPv4, or IPv6 in brackets), an optional
    port, and an optional path prefixed to every request's ``path`` (``http://h:8000/v1`` plus
    ``/chat/completions`` -> ``/v1/chat/completions``). ``headers`` go into every request (e.g.
    ``Authorization``); they may replace the defaults ``Content-Type: application/json``,
    ``Accept: text/event-stream`` and ``User-Agent``, not ``Host``, ``Content-Length`` or
    ``Transfer-Encoding``. ``ssl``: the context for https (default: ``ssl.create_default_context()``).
    ``connect_timeout_s`` bounds opening one connection (TCP and TLS; :class:`ConnectError` when it
    runs out), ``drain_timeout_s`` reading the rest of a response after ``on_line`` ended it.
    Use as ``async with`` or call :meth:`aclose`; one pool belongs to one event loop.

    Raises:
        ValueError: an unusable base URL or header.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 100,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 30.0,
        ssl: _ssl.SSLContext | None = None,
        drain_timeout_s: float = 2.0,
    ) -> None:
        parts = urlsplit(base_url)
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"base URL {base_url!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URL {base_url!r}: needs an http:// or https:// scheme and a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"base URL {base_url!r}: credentials in the URL are not supported")
        if parts.query or parts.fragment:
            raise ValueError(f"base URL {base_url!r}: a query or fragment is not supported")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port if port is not None else (443 if tls else 80)
        bracketed = f"[{self._host}]" if ":" in self._host else self._host
        default_port = self._port == (443 if tls else 80)
        authority = bracketed if default_port else f"{bracketed}:{self._port}"
        self._prefix = parts.path.rstrip("/")
        self.url = f"{parts.scheme}://{authority}{self._prefix}"
        self._ssl: _ssl.SSLContext | None = None
        if tls:
            self._ssl = ssl if ssl is not None else _ssl.create_default_context()
        self.max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._drain_timeout_s = drain_timeout_s

        fields = {
            "host": ("Host", authority),
            "content-type": ("Content-Type", "application/json"),
            "accept": ("Accept", "text/event-stream"),
            "user-agent": ("User-Agent", "k3pipe"),
        }
        for name, value in (headers or {}).items():
            key = name.strip().lower()
            if not key or any(c in name + value for c in "\r\n\0") or ":" in name:
                raise ValueError(f"header {name!r} is not a valid HTTP header name/value")
            if key in ("host", "content-length", "transfer-encoding"):
                raise ValueError(f"header {name!r} is set by the transport itself")
            fields[key] = (name.strip(), value.strip())
        self._head_fields = "".join(f"{n}: {v}\r\n" for n, v in fields.values()).encode("latin-1")

        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Conn] = []  # a stack: the most recently used is the least likely stale
        self._all: set[_Conn] = set()
        self._closed = False

    # --- public ---

    async def post_stream(self, path: str, body: bytes, on_line: OnLine, timeout_s: float) -> StreamResult:
        """POST ``body`` (JSON) to ``path`` and stream the answer line by line into ``on_line``.

        For a 2xx answer ``on_line(line, t)`` gets every line of the body (see the module's doc) until
        it returns True or the body ends (an unterminated last line is passed at the end too); for any
        other status the body (its first 64 KiB) comes back as ``error_body`` and ``on_line`` is never
        called. ``timeout_s`` bounds the whole call: waiting for a connection, connecting, sending and
        the response.

        Raises:
            ConnectError: the connection could not be opened.
            ConnectionClosedError: the connection closed or reset before the response was complete.
            ProtocolError: the answer is not HTTP/1.1.
            StreamTimeout: ``timeout_s`` ran out (a ``TimeoutError``).
            Exception: whatever ``on_line`` raised.
            In every case (and on cancellation) the connection is closed, never reused. The
            ``TransportError`` and ``StreamTimeout`` raised carry ``t_sent`` (None: nothing was sent).
        """
        if self._closed:
            raise TransportError(f"{self.url}{path}: the connection pool is closed")
        payload = b"".join(
            (
                b"POST ",
                (self._prefix + path).encode("ascii"),
                b" HTTP/1.1\r\n",
                self._head_fields,
                b"Content-Length: ",
                str(len(body)).encode("ascii"),
                b"\r\n\r\n",
                body,
            )
        )
        sent: list[float] = []  # the write's stamp, for the errors
        timer = asyncio.timeout(timeout_s)
        try:
            async with timer:
                return await self._request(path, payload, on_line, sent)
        except TimeoutError:
            if timer.expired():
                message = f"{self.url}{path}: no complete response within {timeout_s:g} s"
                raise StreamTimeout(message, sent[-1] if sent else None) from None
            raise
        except TransportError as exc:
            exc.t_sent = sent[-1] if sent else None
            raise

    async def aclose(self) -> None:
        """Close every connection (requests in flight fail with :class:`ConnectionClosedError`)."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._all):
            conn.fail(
                ConnectionClosedError(f"{conn.where}: the connection pool was closed", response_started=True)
            )
        self._all.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost callbacks run

    async def __aenter__(self) -> SSEPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def connections(self) -> int:
        """Open connections (in use, draining or idle)."""
        return len(self._all)

    # --- internals ---

    async def _request(self, path: str, payload: bytes, on_line: OnLine, sent: list[float]) -> StreamResult:
        t_call = _perf()
        for attempt in (0, 1):
            await self._slots.acquire()
            t_slot = _perf()
            conn: _Conn | None = None
            try:
                reused = False
                while self._idle:
                    candidate = self._idle.pop()
                    if candidate.usable():
                        conn, reused = candidate, True
                        break
                    self._forget(candidate)
                    candidate.abort()
                if conn is None:
                    conn = await self._open(path)
                conn.held = True
                t_before = _perf()
                waiter, t_sent = conn.send(payload, on_line, self.url + path)
                sent.append(t_sent)
                try:
                    t_end = await waiter
                except ConnectionClosedError as exc:
                    if attempt == 0 and reused and not exc.response_started:
                        self._give_back(conn, keep=False)
                        continue  # the server had closed this idle connection: once more, fresh
                    raise
            except BaseException:
                if conn is not None and conn.held:
                    self._give_back(conn, keep=False)
                elif conn is None:
                    self._slots.release()
                raise
            result = StreamResult(
                status=conn.status,
                headers=conn.headers,
                t_connect_s=t_before - t_call,
                t_sent=t_sent,
                t_end=t_end,
                error_body=bytes(conn.error_body) if conn.sink == _ERROR else None,
                reused=reused,
                wait_s=t_slot - t_call,
                t_written=conn.t_written,
            )
            if conn.phase in (_DONE, _DEAD):
                self._give_back(conn, keep=True)
            else:
                conn.start_drain(self._drain_timeout_s)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    async def _open(self, path: str) -> _Conn:
        loop = asyncio.get_running_loop()
        where = f"{self.url}{path}"
        timer = asyncio.timeout(self._connect_timeout_s)
        try:
            async with timer:
                _, conn = await loop.create_connection(
                    lambda: _Conn(self),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError:
            if timer.expired():
                raise ConnectError(
                    f"cannot connect to {where}: no connection within {self._connect_timeout_s:g} s"
                ) from None
            raise ConnectError(f"cannot connect to {where}: timed out") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {where}: {exc.strerror or exc}") from exc
        if self._closed:
            conn.abort()
            raise TransportError(f"{where}: the connection pool is closed")
        self._all.add(conn)
        return conn

    def _give_back(self, conn: _Conn, *, keep: bool) -> None:
        """End ``conn``'s use by a request: idle again if it can be, closed otherwise; free its slot."""
        if not conn.held:
            return
        conn.held = False
        conn.draining = False
        if conn.drain_timer is not None:
            conn.drain_timer.cancel()
            conn.drain_timer = None
        if keep and not self._closed and conn.reusable():
            conn.reset()
            self._idle.append(conn)
        else:
            self._forget(conn)
            if conn.phase == _DONE:
                conn.close()  # a complete answer on a connection not to be reused: a polite close
            else:
                conn.abort()
        self._slots.release()

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)


class _Conn(asyncio.BufferedProtocol):
    """One connection and the parser of the response on it.

    A ``BufferedProtocol``: the transport receives into this connection's own buffer (a plain
    ``Protocol`` has asyncio allocate, then shrink, a 256 KiB object per read: in a bare read loop
    here ~28 us per read against ~16 us; within the noise once the parsing is added).
    """

    def __init__(self, pool: SSEPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.held = False  # a request (or a drain) holds this connection and a pool slot
        self.draining = False  # the caller has its answer; the rest of the response is being read
        self.drain_timer: asyncio.TimerHandle | None = None
        self.phase = _IDLE
        self.sink = _SSE
        self.where = pool.url
        self.waiter: asyncio.Future[float] | None = None
        self.on_line: OnLine | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.error_body = bytearray()
        self.t_written: float | None = None
        self._rest = b""  # unconsumed framing bytes carried to the next read
        self._partial = bytearray()  # an SSE line not yet complete
        self._remaining = 0  # bytes left in the current chunk / Content-Length body
        self._got = 0  # bytes of the current response received
        self._view = memoryview(bytearray(_READ_BUFFER))

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a socket that refuses it still works
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # pause_writing when anything is buffered, resume_writing once all of it is in the kernel
        transport.set_write_buffer_limits(high=0, low=0)

    def resume_writing(self) -> None:
        if self.t_written is None and self.waiter is not None:
            self.t_written = _perf()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        now = _perf()  # the stamp of every line this read completes, before any parsing
        self._received(self._view[:nbytes].tobytes(), now)

    def data_received(self, data: bytes) -> None:
        """The same as a read into the buffer (for a caller feeding bytes by hand)."""
        self._received(data, _perf())

    def _received(self, data: bytes, now: float) -> None:
        if self.phase in (_IDLE, _DONE, _DEAD):
            if self.phase != _DEAD:  # bytes nobody asked for: this connection cannot be trusted
                self.keep_alive = False
                self.phase = _DEAD
                if self.transport is not None:
                    self.transport.abort()
            return
        self._got += len(data)
        if self._rest:
            data = self._rest + data
            self._rest = b""
        try:
            self._parse(data, now)
        except _Malformed as exc:
            self.fail(ProtocolError(f"{self.where}: malformed HTTP response: {exc}"))
        except Exception as exc:  # raised by on_line: the caller's error, handed back to it
            self.fail(exc)
        if self.draining and self.phase == _DONE:
            self.pool._give_back(self, keep=True)

    def eof_received(self) -> bool | None:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        phase = self.phase
        if phase == _EOF:  # a body delimited by the close: it is complete now
            self.keep_alive = False
            try:
                self._complete(_perf())
            except Exception as error:  # raised by on_line
                self.fail(error)
        elif phase in (_HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH):
            started = self._got > 0
            what = "reset" if isinstance(exc, ConnectionResetError) else "closed"
            detail = f" ({exc})" if exc is not None and what != "reset" else ""
            when = f"after {self._got} bytes of the response" if started else "before any response"
            self.fail(
                ConnectionClosedError(
                    f"{self.where}: the server {what} the connection {when}{detail}",
                    response_started=started,
                )
            )
        self.phase = _DEAD
        if self.draining:
            self.pool._give_back(self, keep=False)

    # --- used by the pool ---

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def reusable(self) -> bool:
        assert self.transport is not None
        return (
            self.phase == _DONE
            and self.keep_alive
            and self.usable()
            and not self._rest
            and not self.transport.get_write_buffer_size()  # an answer that came before all the request
        )

    def send(self, payload: bytes, on_line: OnLine, where: str) -> tuple[asyncio.Future[float], float]:
        assert self.transport is not None
        assert self.phase == _IDLE
        self.waiter = waiter = asyncio.get_running_loop().create_future()
        self.on_line = on_line
        self.where = where
        self.phase = _HEAD
        self.sink = _SSE
        self.t_written = None
        self.transport.write(payload)
        t_sent = _perf()
        if not self.transport.get_write_buffer_size():
            self.t_written = t_sent
        return waiter, t_sent

    def start_drain(self, timeout_s: float) -> None:
        """The caller has its result; read the rest of the response, then go back to the pool."""
        self.draining = True
        self.drain_timer = asyncio.get_running_loop().call_later(timeout_s, self._drain_expired)

    def reset(self) -> None:
        self.phase = _IDLE
        self.waiter = None
        self.on_line = None
        self.status = 0
        self.headers = {}
        self.error_body = bytearray()
        self._partial.clear()
        self._got = 0

    def abort(self) -> None:
        """Drop the connection at once (a reset): after a failure, a timeout or a cancellation."""
        self.phase = _DEAD
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close the connection after anything still buffered is written."""
        self.phase = _DEAD
        if self.transport is not None:
            self.transport.close()

    # --- parsing ---

    def _parse(self, buf: bytes, now: float) -> None:
        pos, end = 0, len(buf)
        while pos < end:
            phase = self.phase
            if phase in (_DATA, _LENGTH):
                n = min(self._remaining, end - pos)
                self._body(buf, pos, pos + n, now)
                if self.phase == _DEAD:
                    return
                pos += n
                self._remaining -= n
                if not self._remaining:
                    if phase == _DATA:
                        self.phase = _CRLF
                    else:
                        self._complete(now)
            elif phase == _SIZE:
                cut = buf.find(b"\n", pos)
                if cut < 0:
                    if end - pos > _MAX_SIZE_LINE:
                        raise _Malformed("chunk-size line too long")
                    break
                size = buf[pos:cut].split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size):
                    raise _Malformed(f"bad chunk size {bytes(buf[pos:cut])[:40]!r}")
                pos = cut + 1
                self._remaining = int(size, 16)
                self.phase = _DATA if self._remaining else _TRAILER
            elif phase == _CRLF:
                two = buf[pos : pos + 2]
                if two == b"\r\n":
                    pos += 2
                elif two[:1] == b"\n":
                    pos += 1
                elif two == b"\r":  # the \n is in the next read
                    break
                else:
                    raise _Malformed(f"chunk data not followed by CRLF: {bytes(two)!r}")
                self.phase = _SIZE
            elif phase == _EOF:
                self._body(buf, pos, end, now)
                if self.phase == _DEAD:
                    return
                pos = end
            elif phase == _HEAD:
                pos = self._head(buf, pos, end, now)
                if pos < 0:
                    pos = -pos - 1
                    break
            elif phase == _TRAILER:
                cut = buf.find(b"\n", pos)
                if cut < 0:
                    if end - pos > _MAX_HEAD:
                        raise _Malformed("trailer too long")
                    break
                blank = cut == pos or (cut == pos + 1 and buf[pos] == 13)
                pos = cut + 1
                if blank:
                    self._complete(now)
            elif phase == _DONE:  # bytes after the response: nothing else was asked for
                self.keep_alive = False
                return
            else:  # _DEAD (failed or aborted in this very read), _IDLE
                return
        if pos < end:
            rest = buf[pos:]
            if len(rest) > _MAX_HEAD + _MAX_SIZE_LINE:
                raise _Malformed("too many bytes without framing")
            self._rest = rest

    def _head(self, buf: bytes, pos: int, end: int, now: float) -> int:
        """Parse a response head at ``pos``; the position after it, or ``-pos - 1`` if incomplete."""
        a = buf.find(b"\n\r\n", pos)
        b = buf.find(b"\n\n", pos)
        if a < 0 and b < 0:
            if end - pos > _MAX_HEAD:
                raise _Malformed(f"no end of the response head within {_MAX_HEAD} bytes")
            return -pos - 1
        cut, after = (a, a + 3) if b < 0 or (0 <= a < b) else (b, b + 2)
        lines = buf[pos:cut].split(b"\n")
        status_line = lines[0].rstrip(b"\r")
        parts = status_line.split(b" ", 2)
        version = parts[0]
        if not version.startswith(b"HTTP/1.") or len(parts) < 2:
            raise _Malformed(f"not an HTTP/1.x status line: {bytes(status_line)[:80]!r}")
        code = parts[1]
        if len(code) != 3 or not code.isdigit():
            raise _Malformed(f"bad status code in {bytes(status_line)[:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        last = ""
        for raw in lines[1:]:
            line = raw.rstrip(b"\r")
            if line[:1] in (b" ", b"\t") and last:  # obsolete line folding
                headers[last] += " " + line.strip().decode("latin-1")
                continue
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise _Malformed(f"bad header line {bytes(line)[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
            last = key
        if 100 <= status < 200:
            if status == 101:
                raise _Malformed("101 Switching Protocols was not asked for")
            return after  # an interim answer (103 Early Hints): the real head follows
        self.status = status
        self.headers = headers
        tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
        self.keep_alive = "keep-alive" in tokens if version == b"HTTP/1.0" else "close" not in tokens
        self.sink = _SSE if 200 <= status < 300 else _ERROR
        te = headers.get("transfer-encoding")
        cl = headers.get("content-length")
        if status in (204, 304):
            self.phase = _LENGTH
            self._remaining = 0
        elif te is not None:
            if te.lower().rsplit(",", 1)[-1].strip() == "chunked":
                self.phase = _SIZE
            else:
                self.phase = _EOF
            if cl is not None:
                self.keep_alive = False  # both framings: answer this one, trust nothing after it
        elif cl is not None:
            values = {v.strip() for v in cl.split(",")}
            length = values.pop() if len(values) == 1 else ""
            if not (length.isascii() and length.isdigit()):
                raise _Malformed(f"bad Content-Length {cl!r}")
            self.phase = _LENGTH
            self._remaining = int(length)
        else:
            self.phase = _EOF
        if self.phase == _EOF:
            self.keep_alive = False
        elif self.phase == _LENGTH and not self._remaining:
            self._complete(now)
        return after

    def _body(self, buf: bytes, start: int, end: int, now: float) -> None:
        sink = self.sink
        if sink == _SSE:
            cut = buf.find(b"\n", start, end)
            partial = self._partial
            if cut < 0:
                partial += buf[start:end]
                if len(partial) > _MAX_LINE:
                    raise _Malformed(f"an SSE line longer than {_MAX_LINE} bytes")
                return
            if partial:
                partial += buf[start:cut]
                line = bytes(partial)
                partial.clear()
            else:
                line = buf[start:cut]
            on_line = self.on_line
            assert on_line is not None
            while True:
                if line[-1:] == b"\r":
                    line = line[:-1]
                if on_line(line, now):
                    self._finish(now)
                    return
                start = cut + 1
                cut = buf.find(b"\n", start, end)
                if cut < 0:
                    break
                line = buf[start:cut]
            if start < end:
                partial += buf[start:end]
        elif sink == _ERROR:
            room = _ERROR_BODY - len(self.error_body)
            self.error_body += buf[start : start + min(room, end - start)]
            if end - start > room:  # enough of it: answer now, drop the rest with the connection
                self.keep_alive = False
                self._finish(now)
                self.abort()
        # _DRAIN: the caller has its answer; only the framing matters

    def _complete(self, now: float) -> None:
        """The response is complete."""
        self.phase = _DONE
        if self.sink == _SSE and self._partial:
            line = bytes(self._partial).rstrip(b"\r")
            self._partial.clear()
            assert self.on_line is not None
            self.on_line(line, now)
        self._finish(now)

    def _finish(self, now: float) -> None:
        """The caller's answer is ready; the rest of the response, if any, is only drained."""
        self.sink = _DRAIN if self.sink == _SSE else self.sink
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(now)

    def fail(self, exc: Exception) -> None:
        """Hand ``exc`` to the waiting caller (if any) and close the connection."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.keep_alive = False
        self.abort()

    def _drain_expired(self) -> None:
        self.drain_timer = None
        self.pool._give_back(self, keep=False)


class _Malformed(Exception):
    pass


class HttpxSSE:
    """:meth:`SSEPool.post_stream` over an ``httpx.AsyncClient`` (e.g. one with a ``MockTransport``).

    Same contract, less exact: ``t_sent`` is stamped just before httpx is asked to send (httpx does not
    say when the bytes went out), lines are stamped when ``aiter_bytes`` yields, and the connection's
    fate is httpx's. ``t_connect_s`` and ``wait_s`` are 0; ``reused`` is False.
    """

    def __init__(self, client: httpx.AsyncClient, base_url: str, headers: Mapping[str, str] | None = None):
        self._client = client
        self.url = base_url.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}

    async def post_stream(self, path: str, body: bytes, on_line: OnLine, timeout_s: float) -> StreamResult:
        url = self.url + path
        timer = asyncio.timeout(timeout_s)
        t_sent: float | None = None
        try:
            async with timer:
                t_sent = _perf()
                async with self._client.stream(
                    "POST", url, content=body, headers=self._headers, timeout=timeout_s
                ) as response:
                    status = response.status_code
                    headers = {k.lower(): v for k, v in response.headers.items()}
                    if not 200 <= status < 300:
                        error = (await response.aread())[:_ERROR_BODY]
                        return StreamResult(status, headers, 0.0, t_sent, _perf(), error, False)
                    buffer = b""
                    async for piece in response.aiter_bytes():
                        now = _perf()
                        buffer += piece
                        start = 0
                        while (cut := buffer.find(b"\n", start)) >= 0:
                            line, start = buffer[start:cut], cut + 1
                            if on_line(line[:-1] if line[-1:] == b"\r" else line, now):
                                return StreamResult(status, headers, 0.0, t_sent, now, None, False)
                        buffer = buffer[start:]
                    now = _perf()
                    if buffer:
                        on_line(buffer.rstrip(b"\r"), now)
                    return StreamResult(status, headers, 0.0, t_sent, now, None, False)
        except TimeoutError:
            if timer.expired():
                raise StreamTimeout(f"{url}: no complete response within {timeout_s:g} s", t_sent) from None
            raise
        except httpx.TimeoutException as exc:
            raise StreamTimeout(f"{url}: {type(exc).__name__}: {exc or 'no detail'}", t_sent) from exc
        except httpx.HTTPError as exc:
            kind = ConnectError if isinstance(exc, httpx.ConnectError) else TransportError
            failure = kind(f"{url}: {type(exc).__name__}: {exc or 'no detail'}")
            failure.t_sent = t_sent
            raise failure from exc
