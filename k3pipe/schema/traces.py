"""A trace: a team's traffic as a workload (issue 49), with no text in it by default.

k3pipe's trace format, version 1 (docs/traces.md), is JSON lines: a header, then one line per
request in the order they were sent::

    {"k3pipe_trace": 1, "block_tokens": 64, "source": "agentic seed=1", "text": false}
    {"t": 0.0, "session": "s0", "turn": 1, "input_tokens": 1200, "output_tokens": 90, "hash_ids": [0, 1, ...]}

- ``t``: seconds from the trace's start at which the request was sent.
- ``session`` and ``turn``: a conversation (an agent's session) and the request's place in it, from 1;
  a turn is sent after the previous turn's answer, and its prompt carries that answer. Both absent:
  a request on its own.
- ``input_tokens`` and ``output_tokens``: the prompt's tokens (the chat template counted, with the
  target model's tokenizer) and the answer's.
- ``hash_ids``: the prompt's blocks of ``block_tokens`` tokens, each an id of the block *and
  everything before it* (Mooncake's ``hash_ids``): two prompts share their first k blocks exactly
  when their first k ids are equal. The last block may be partial. Absent: nothing is shared.
- ``kind``: what the turn adds to its session (``user``, ``tool``), for the trace's shape.

Content is never in a trace unless its header says ``"text": true`` (an explicit opt-in at capture);
a replay rebuilds prompts from the ids, so that shared blocks are shared token for token.

Converters read Mooncake's JSON lines (:func:`from_mooncake`, as its traces and AIPerf's
``mooncake_trace`` define them) and OpenTelemetry GenAI spans (:func:`from_otel`, OTLP/JSON as the
collector's file exporter writes it); :func:`agentic_trace` makes the ready multi-turn trace from a
seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3pipe.core.errors import SpecError

__all__ = [
    "FORMAT_VERSION",
    "Trace",
    "TraceRequest",
    "TraceShape",
    "agentic_trace",
    "arrivals",
    "cumulative_hit_rate",
    "from_capture",
    "from_mooncake",
    "from_otel",
    "read_trace",
    "write_trace",
]

FORMAT_VERSION = 1
MOONCAKE_BLOCK_TOKENS = 512  # the block size of Mooncake's published traces (and AIPerf's default)
KINDS = ("user", "tool")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    t: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    session: str | None = None
    turn: int | None = None
    kind: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": round(self.t, 6)}
        if self.session is not None:
            out |= {"session": self.session, "turn": self.turn}
        out |= {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        if self.hash_ids:
            out["hash_ids"] = list(self.hash_ids)
        if self.kind is not None:
            out["kind"] = self.kind
        return out


@dataclass(frozen=True)
class TraceShape:
    """What a trace is like, for the report and for fidelity: its arrivals, lengths, sessions and the
    prefix-cache hit rate a cache that kept every block would reach."""

    requests: int
    sessions: int
    duration_s: float
    mean_rate_per_s: float
    input_tokens_p50: float
    input_tokens_max: int
    output_tokens_p50: float
    turns_p50: float
    turns_max: int
    theoretical_hit_rate: float  # of prompt tokens, in send order, blocks seen before
    theoretical_hit_rate_answers: float  # also the blocks a session's previous prompt and answer cover

    def lines(self) -> list[str]:
        return [
            f"{self.requests} requests over {self.duration_s:.1f} s ({self.mean_rate_per_s:.2f}/s), "
            f"{self.sessions} sessions (turns p50 {self.turns_p50:g}, max {self.turns_max})",
            f"prompt tokens p50 {self.input_tokens_p50:g}, max {self.input_tokens_max}; "
            f"output tokens p50 {self.output_tokens_p50:g}",
            f"theoretical prefix-cache hit rate {100 * self.theoretical_hit_rate:.1f}% "
            "(every block an earlier prompt held, in send order); "
            f"{100 * self.theoretical_hit_rate_answers:.1f}% with the answers cached too",
        ]


@dataclass(frozen=True)
class Trace:
    """A trace: its header's facts and its requests, in send order."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int
    source: str = ""
    text: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        return {
            "k3pipe_trace": FORMAT_VERSION,
            "block_tokens": self.block_tokens,
            "source": self.source,
            "text": self.text,
            **self.extra,
        }

    def lines(self) -> Iterator[str]:
        yield json.dumps(self.header(), sort_keys=True)
        for r in self.requests:
            yield json.dumps(r.to_json())

    @property
    def digest(self) -> str:
        """The sha256 of the trace's canonical lines (what the record keeps beside its prompts)."""
        h = hashlib.sha256()
        for line in self.lines():
            h.update(line.encode() + b"\n")
        return h.hexdigest()[:16]

    def sessions(self) -> dict[str, list[TraceRequest]]:
        out: dict[str, list[TraceRequest]] = {}
        for r in self.requests:
            if r.session is not None:
                out.setdefault(r.session, []).append(r)
        return out

    def shape(self) -> TraceShape:
        reqs = self.requests
        duration = (reqs[-1].t - reqs[0].t) if len(reqs) > 1 else 0.0
        turns = [len(v) for v in self.sessions().values()] or [1]
        return TraceShape(
            requests=len(reqs),
            sessions=len(self.sessions()),
            duration_s=duration,
            mean_rate_per_s=(len(reqs) - 1) / duration if duration > 0 else 0.0,
            input_tokens_p50=_median([r.input_tokens for r in reqs]),
            input_tokens_max=max(r.input_tokens for r in reqs),
            output_tokens_p50=_median([r.output_tokens for r in reqs]),
            turns_p50=_median(turns),
            turns_max=max(turns),
            theoretical_hit_rate=theoretical_hit_rate(self),
            theoretical_hit_rate_answers=theoretical_hit_rate(self, with_answers=True),
        )


def theoretical_hit_rate(trace: Trace, *, with_answers: bool = False) -> float:
    """The share of prompt tokens in blocks an earlier request (in send order) already had: what a
    prefix cache that never evicts could reuse. A request's last, partial block counts its tokens.

    ``with_answers``: also count the blocks of a session's turn that its previous turn's prompt and
    answer cover (the turn continues that conversation), as an engine that caches the tokens it
    generated (vLLM's and SGLang's prefix caches both do) can reuse them; Mooncake's definition,
    the default, counts only blocks an earlier prompt held."""
    curve = cumulative_hit_rate(trace, with_answers=with_answers)
    return curve[-1] if curve else 0.0


def cumulative_hit_rate(trace: Trace, *, with_answers: bool = False) -> list[float]:
    """After each request (in send order), the theoretical hit rate of the requests up to it: the
    curve whose last point is :func:`theoretical_hit_rate`."""
    size = trace.block_tokens
    seen: set[int] = set()
    last: dict[str, TraceRequest] = {}
    hit = total = 0
    out = []
    for r in trace.requests:
        total += r.input_tokens
        held = 0  # leading blocks the previous turn's prompt and answer cover
        if with_answers and r.session is not None and (p := last.get(r.session)) is not None:
            whole = p.input_tokens // size
            if r.hash_ids[:whole] == p.hash_ids[:whole]:  # it continues that conversation
                held = (p.input_tokens + p.output_tokens) // size
        for k, block in enumerate(r.hash_ids):
            if k < held or block in seen:
                hit += min(size, r.input_tokens - k * size)
        seen.update(r.hash_ids)
        if r.session is not None:
            last[r.session] = r
        out.append(hit / total)
    return out


def arrivals(trace: Trace, bin_s: float) -> list[int]:
    """Requests sent in each ``bin_s`` seconds from the trace's start (the last bin holds the last)."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, not {bin_s}")
    counts = [0] * (int(trace.requests[-1].t // bin_s) + 1)
    for r in trace.requests:
        counts[int(r.t // bin_s)] += 1
    return counts


def _median(values: list[int]) -> float:
    s = sorted(values)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# --- reading and writing -------------------------------------------------------------------------


def write_trace(trace: Trace, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in trace.lines()))


def read_trace(path: Path) -> Trace:
    """A k3pipe trace file, checked line by line.

    Raises:
        SpecError: the file is missing, not JSON lines, of another format or version, or a request
            is wrong; the message names the line, the field, the value and what to do.
    """
    try:
        raw = path.read_text()
    except OSError as exc:
        raise SpecError(f"trace {path}: cannot be read ({exc}): check workload.trace") from exc
    rows = list(_json_lines(raw, path))
    if not rows:
        raise SpecError(f"trace {path}: empty: a trace is a header line and one line per request")
    (n0, header), body = rows[0], rows[1:]
    if "k3pipe_trace" not in header:
        hint = (
            "a Mooncake trace: convert it with `k3pipe trace convert --from mooncake`"
            if "hash_ids" in header or "input_length" in header
            else "convert it with `k3pipe trace convert` (mooncake, otel)"
        )
        raise SpecError(f"trace {path}: line {n0} is not a k3pipe trace header; {hint}")
    version = header["k3pipe_trace"]
    if version != FORMAT_VERSION:
        raise SpecError(
            f"trace {path}: format version {version!r}; this k3pipe reads version {FORMAT_VERSION}"
        )
    block_tokens = header.get("block_tokens")
    if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens < 1:
        raise SpecError(f"trace {path}: header block_tokens={block_tokens!r}: give a whole number >= 1")
    if not body:
        raise SpecError(f"trace {path}: no request after the header")
    requests = [_request(n, row, path, block_tokens) for n, row in body]
    _check_order(requests, [n for n, _ in body], path)
    extra = {k: v for k, v in header.items() if k not in ("k3pipe_trace", "block_tokens", "source", "text")}
    return Trace(
        tuple(requests), block_tokens, str(header.get("source", "")), bool(header.get("text", False)), extra
    )


def _json_lines(raw: str, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(
                f"trace {path}: line {n} is not JSON ({exc.msg}): one JSON object per line"
            ) from exc
        if not isinstance(row, dict):
            raise SpecError(f"trace {path}: line {n} is {type(row).__name__}, not a JSON object")
        yield n, row


def _field_int(row: dict[str, Any], key: str, where: str, *, least: int) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SpecError(f"{where}: {key}={value!r}: give a whole number >= {least}")
    return value


def _request(n: int, row: dict[str, Any], path: Path, block_tokens: int) -> TraceRequest:
    where = f"trace {path}: line {n}"
    t = row.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise SpecError(f"{where}: t={t!r}: give the send time in seconds from the trace's start (>= 0)")
    input_tokens = _field_int(row, "input_tokens", where, least=1)
    output_tokens = _field_int(row, "output_tokens", where, least=1)
    hash_ids = row.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise SpecError(f"{where}: hash_ids must be a list of whole numbers, not {hash_ids!r}")
    if hash_ids and len(hash_ids) != math.ceil(input_tokens / block_tokens):
        raise SpecError(
            f"{where}: {len(hash_ids)} hash_ids for input_tokens={input_tokens}: with block_tokens="
            f"{block_tokens} the prompt has {math.ceil(input_tokens / block_tokens)} blocks (one id each)"
        )
    session, turn = row.get("session"), row.get("turn")
    if session is not None:
        if not isinstance(session, str) or not session:
            raise SpecError(f"{where}: session={session!r}: give the session's id as a non-empty string")
        turn = _field_int(row, "turn", where, least=1)
    elif turn is not None:
        raise SpecError(f"{where}: turn={turn!r} without a session: give the session's id too")
    kind = row.get("kind")
    if kind is not None and kind not in KINDS:
        raise SpecError(f"{where}: kind={kind!r}: one of {', '.join(KINDS)} (or leave it out)")
    return TraceRequest(float(t), input_tokens, output_tokens, tuple(hash_ids), session, turn, kind)


def _check_order(requests: list[TraceRequest], numbers: list[int], path: Path) -> None:
    last_t = -1.0
    turns: dict[str, int] = {}
    for r, n in zip(requests, numbers, strict=True):
        if r.t < last_t:
            raise SpecError(
                f"trace {path}: line {n}: t={r.t:g} is before the line above's ({last_t:g}): the requests "
                "are listed in the order they were sent"
            )
        last_t = r.t
        if r.session is not None:
            expected = turns.get(r.session, 0) + 1
            if r.turn != expected:
                raise SpecError(
                    f"trace {path}: line {n}: session {r.session!r} turn {r.turn}, expected turn {expected}: "
                    "a session's turns are numbered 1, 2, ... in the order they were sent"
                )
            turns[r.session] = expected


# --- ids of blocks ---------------------------------------------------------------------------------


class BlockIds:
    """Chained ids of blocks: the id of a block depends on its content and on everything before it,
    so equal ids mean equal prefixes. Content is a key (any hashable), never text."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Any], int] = {}

    def chain(self, keys: Iterable[Any]) -> tuple[int, ...]:
        out: list[int] = []
        parent = -1
        for key in keys:
            parent = self._ids.setdefault((parent, key), len(self._ids))
            out.append(parent)
        return tuple(out)


def _stream_blocks(segments: list[tuple[str, int]], block_tokens: int, upto: int) -> list[tuple[Any, ...]]:
    """The content keys of the blocks of the first ``upto`` tokens of a stream made of ``segments``
    (each an id and its length): a block's key lists the pieces of segments it holds."""
    keys: list[tuple[Any, ...]] = []
    pieces: list[tuple[str, int, int]] = []
    filled = 0
    pos = 0
    for seg, length in segments:
        start = 0
        while start < length and pos < upto:
            take = min(length - start, block_tokens - filled, upto - pos)
            pieces.append((seg, start, start + take))
            start += take
            filled += take
            pos += take
            if filled == block_tokens:
                keys.append(tuple(pieces))
                pieces, filled = [], 0
        if pos >= upto:
            break
    if pieces:
        keys.append(tuple(pieces))
    return keys


# --- converters ------------------------------------------------------------------------------------


def from_mooncake(path: Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """A Mooncake trace (JSON lines of ``timestamp`` in ms, ``input_length``, ``output_length``,
    ``hash_ids``; AIPerf's extension adds ``session_id``) as a k3pipe trace. Its ids are kept (they
    are Mooncake's chained block hashes at ``block_tokens`` per block) but renumbered from 0."""
    rows = list(_json_lines(_read(path), path))
    if not rows:
        raise SpecError(f"Mooncake trace {path}: empty")
    renumber: dict[int, int] = {}
    requests = []
    turns: dict[str, int] = {}
    t0: float | None = None
    for n, row in rows:
        where = f"Mooncake trace {path}: line {n}"
        stamp = row.get("timestamp", 0)
        if not isinstance(stamp, int | float) or isinstance(stamp, bool):
            raise SpecError(f"{where}: timestamp={stamp!r}: milliseconds as a number")
        t0 = stamp if t0 is None else t0
        inp = _field_int(row, "input_length", where, least=1)
        out = _field_int(row, "output_length", where, least=1)
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            raise SpecError(f"{where}: hash_ids={ids!r}: a list of whole numbers")
        blocks = math.ceil(inp / block_tokens)
        if ids and len(ids) != blocks:
            raise SpecError(
                f"{where}: {len(ids)} hash_ids for input_length={inp}: at {block_tokens} tokens a block "
                f"that is {blocks}; pass the trace's block size (--block-tokens)"
            )
        session = row.get("session_id")
        turn = None
        if session is not None:
            session = str(session)
            turn = turns[session] = turns.get(session, 0) + 1
        requests.append(
            TraceRequest(
                round((stamp - t0) / 1000.0, 6), inp, out,
                tuple(renumber.setdefault(h, len(renumber)) for h in ids), session, turn,
            )
        )  # fmt: skip
    requests.sort(key=lambda r: r.t)
    return Trace(tuple(requests), block_tokens, f"mooncake:{path.name}")


def from_capture(rows: Iterable[dict[str, Any]], source: str) -> Trace:
    """Capture-log lines (``{"k3pipe_capture": 1, "t", "session", "input_tokens", "output_tokens",
    "block_tokens", "blocks", "kind"}``, as :mod:`k3pipe.prompts.capture` writes them at the gateway
    or from a request log) as a k3pipe trace: times from the first request, a session's turns
    numbered in send order and named ``s000``, ``s001``... in order of appearance (the gateway's own
    ids stay out of the trace), the chained block hashes renumbered from 0."""
    lines = list(rows)
    if not lines:
        raise SpecError(f"capture {source}: no request captured")
    sizes = {row.get("block_tokens") for row in lines}
    if len(sizes) != 1:
        raise SpecError(
            f"capture {source}: block_tokens {sorted(map(str, sizes))}: one capture holds one block size"
        )
    (size,) = sizes
    if not isinstance(size, int) or size < 1:
        raise SpecError(f"capture {source}: block_tokens={size!r}: a whole number >= 1")
    checked = []
    for n, row in enumerate(lines, 1):
        where = f"capture {source}: request {n}"
        if row.get("k3pipe_capture") != 1:
            raise SpecError(f"{where}: k3pipe_capture={row.get('k3pipe_capture')!r}: this k3pipe reads 1")
        t = row.get("t")
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
            raise SpecError(f"{where}: t={t!r}: the send time in seconds")
        blocks = row.get("blocks")
        inp = _field_int(row, "input_tokens", where, least=1)
        if not isinstance(blocks, list) or len(blocks) != math.ceil(inp / size):
            raise SpecError(f"{where}: blocks: {math.ceil(inp / size)} hashes expected for {inp} tokens")
        checked.append((float(t), n, row, inp, _field_int(row, "output_tokens", where, least=1)))
    checked.sort(key=lambda c: (c[0], c[1]))
    t0 = checked[0][0]
    renumber: dict[str, int] = {}
    names: dict[str, str] = {}
    turns: dict[str, int] = {}
    requests = []
    for t, _, row, inp, out in checked:
        session = None  # the gateway's session ids are the team's: renamed in order of appearance
        turn = None
        if row.get("session") is not None:
            session = names.setdefault(str(row["session"]), f"s{len(names):03d}")
            turn = turns[session] = turns.get(session, 0) + 1
        kind = row.get("kind") if row.get("kind") in KINDS else None
        ids = tuple(renumber.setdefault(str(h), len(renumber)) for h in row["blocks"])
        requests.append(TraceRequest(round(t - t0, 6), inp, out, ids, session, turn, kind))
    return Trace(tuple(requests), size, f"capture:{source}")


def from_otel(path: Path, *, block_tokens: int = 64) -> Trace:
    """OpenTelemetry GenAI spans (OTLP/JSON: objects of ``resourceSpans`` per line or one document)
    as a k3pipe trace: each inference span (one with ``gen_ai.usage.input_tokens``) a request at its
    start time; ``gen_ai.conversation.id`` its session. Spans hold no content by default, so sharing
    is inferred from the sessions: a turn's prompt is the previous turn's prompt and answer, then
    its new tokens (what a chat or an agent loop sends)."""
    raw = _read(path)
    docs: list[dict[str, Any]] = []
    try:
        whole = json.loads(raw)
        docs = [whole] if isinstance(whole, dict) else []
    except json.JSONDecodeError:
        docs = [row for _, row in _json_lines(raw, path)]
    spans = [s for doc in docs for s in _otel_spans(doc)]
    calls = []
    for span in spans:
        attrs = _otel_attributes(span.get("attributes", []))
        if "gen_ai.usage.input_tokens" not in attrs:
            continue
        start = int(span.get("startTimeUnixNano", 0))
        inp, out = int(attrs["gen_ai.usage.input_tokens"]), int(attrs.get("gen_ai.usage.output_tokens", 1))
        calls.append((start, inp, max(out, 1), attrs.get("gen_ai.conversation.id")))
    if not calls:
        raise SpecError(
            f"OpenTelemetry file {path}: no GenAI inference span (one with gen_ai.usage.input_tokens); "
            "export the gateway's or the agent's spans with the GenAI semantic conventions"
        )
    calls.sort(key=lambda c: c[0])
    t0 = calls[0][0]
    ids = BlockIds()
    streams: dict[str, list[tuple[str, int]]] = {}
    turns: dict[str, int] = {}
    requests = []
    for k, (start, inp, out, conversation) in enumerate(calls):
        if conversation is None:
            segments = [(f"r{k}", inp)]
            session = turn = None
        else:
            session = str(conversation)
            turn = turns[session] = turns.get(session, 0) + 1
            segments = streams.setdefault(session, [])
            grown = sum(n for _, n in segments)
            if inp > grown:
                segments.append((f"{session}/{turn}/in", inp - grown))
        hash_ids = ids.chain(_stream_blocks(segments, block_tokens, inp))
        if conversation is not None:
            segments.append((f"{session}/{turn}/out", out))
        requests.append(TraceRequest(round((start - t0) / 1e9, 6), inp, out, hash_ids, session, turn))
    return Trace(tuple(requests), block_tokens, f"otel:{path.name}")


def _otel_spans(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for resource in doc.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            yield from scope.get("spans", [])


def _otel_attributes(attributes: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in attributes:
        value = a.get("value", {})
        for kind in ("stringValue", "intValue", "doubleValue", "boolValue"):
            if kind in value:
                out[a.get("key", "")] = value[kind]
                break
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot be read ({exc})") from exc


# --- the ready trace -------------------------------------------------------------------------------


def agentic_trace(
    seed: int = 1,
    *,
    sessions: int = 24,
    turns: tuple[int, int] = (3, 20),
    context_tokens: int = 16384,
    system_prompts: int = 3,
    system_tokens: int = 2048,
    user_tokens: tuple[int, int] = (64, 512),
    tool_tokens: tuple[int, int] = (256, 2048),
    output_tokens: tuple[int, int] = (32, 512),
    think_s: float = 2.0,
    burst_s: float = 30.0,
    bursts: int = 3,
    block_tokens: int = 64,
) -> Trace:
    """A multi-turn, agent-like trace from a seed: sessions of ``turns`` turns (uniform), each with one
    of ``system_prompts`` shared system prompts; a turn adds a user message or a tool result (two
    in three after the first turn) to the previous prompt and answer, until the context reaches
    ``context_tokens``; sessions start in ``bursts`` bursts ``burst_s`` apart, and a turn is sent
    an exponential think time (mean ``think_s``) after the previous one would have been answered
    (recorded times: a replay waits for the real answer anyway)."""
    if context_tokens <= system_tokens + user_tokens[0]:
        raise ValueError(
            f"context_tokens={context_tokens} leaves no room for a turn: a session opens with its "
            f"{system_tokens}-token system prompt and a user message of at least {user_tokens[0]} tokens; "
            f"raise context_tokens above {system_tokens + user_tokens[0]} or lower system_tokens"
        )
    rng = random.Random(seed)
    ids = BlockIds()
    starts = sorted(
        rng.randrange(bursts) * burst_s + rng.expovariate(1.0) * burst_s / 10 for _ in range(sessions)
    )
    pending: list[TraceRequest] = []
    for s, start in enumerate(starts):
        name = f"s{s:03d}"
        system = f"sys{rng.randrange(system_prompts)}"
        segments: list[tuple[str, int]] = [(system, system_tokens)]
        t = start
        for turn in range(1, rng.randint(*turns) + 1):
            kind = "user" if turn == 1 or rng.random() < 1 / 3 else "tool"
            low, high = user_tokens if kind == "user" else tool_tokens
            added = rng.randint(low, high)
            grown = sum(n for _, n in segments)
            if grown + added >= context_tokens:
                break
            segments.append((f"{name}/{turn}/{kind}", added))
            inp = grown + added
            out = rng.randint(*output_tokens)
            pending.append(
                TraceRequest(
                    round(t, 6),
                    inp,
                    out,
                    ids.chain(_stream_blocks(segments, block_tokens, inp)),
                    name,
                    turn,
                    kind,
                )
            )
            segments.append((f"{name}/{turn}/out", out))
            t += 0.02 * out + rng.expovariate(1.0 / think_s)  # its answer, then the agent's think time
    pending.sort(key=lambda r: (r.t, r.session or "", r.turn or 0))
    source = (
        f"agentic seed={seed} sessions={sessions} turns={turns[0]}-{turns[1]} context={context_tokens} "
        f"system_prompts={system_prompts}x{system_tokens}"
    )
    return Trace(tuple(pending), block_tokens, source)
