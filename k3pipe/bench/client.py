"""Async streaming client: a workload under a load pattern, one raw record per request.

Load patterns (``WorkloadSpec.load``): fixed concurrency, constant rate, or Poisson arrivals
(seeded). Each record keeps the time its request was due by the schedule (``t_scheduled``) next to
the time it was sent (``t_send``), so a client that falls behind its schedule (concurrency cap
reached, event loop busy) shows it as send lag instead of hiding it in shorter latencies.

The client records raw ``time.perf_counter()`` stamps and nothing derived; ``summary.py`` derives
TTFT/TPOT/ITL/E2E from them. The rules it follows (shared/docs/field-notes.md, "Measurement rules"):

- Every SSE line is stamped when the network read that completed it returns, before any JSON
  parsing, so parsing cost never shifts a timestamp.
- TTFT is time to the first *token-bearing* delta: non-empty ``content``, ``reasoning`` (vLLM's
  reasoning parser), ``reasoning_content`` (older vLLM, SGLang) or ``tool_calls``. vLLM's first chunk,
  ``delta: {"role": "assistant", "content": ""}``, carries no token and is not counted, nor are
  usage-only chunks (``choices: []``), empty strings or ``[DONE]``. Content TTFT is kept apart.
- Output tokens come from ``usage`` (``stream_options.include_usage``). With
  ``continuous_usage_stats`` (vLLM, SGLang) every chunk carries the running ``completion_tokens``,
  so each token-bearing chunk's own token count is known (``chunk_tokens``): TPOT and per-token ITL
  use it. A server that sends no usage at all gets its generated text kept (``output_text``) so the
  pipeline can re-tokenize it, a flagged fallback.
- A failed request (HTTP error status, ``error`` object in the stream, timeout, transport error, or
  a stream that ends with zero output tokens) is a record with ``error`` set, never an exception
  that loses the other records.
- The API key goes into the ``Authorization`` header only; error texts are scrubbed of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from k3pipe.bench.replay import ReplayOutcome, replay, replay_plan
from k3pipe.bench.request_records import RequestRecord
from k3pipe.bench.transport import HttpxSSE, SSEPool, SSESender, TransportError
from k3pipe.bench.warmup import WarmupReport, agree, warmup_report
from k3pipe.bench.warmup import waves as warmup_waves
from k3pipe.core.errors import BenchmarkError
from k3pipe.prompts.datasets import Prompt
from k3pipe.prompts.trace_prompts import previous_turns
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.schema.traces import Trace

__all__ = [
    "Abort",
    "ClientLoad",
    "RequestRecord",
    "Share",
    "WorkloadResult",
    "replay_trace",
    "run_workload",
    "schedule_offsets",
]

log = logging.getLogger(__name__)

# Longest error text kept in a record (bodies of 4xx/5xx answers can be whole HTML pages).
_ERROR_CHARS = 500
_DELTA_TOKEN_FIELDS = ("content", "reasoning", "reasoning_content")


class Abort:
    """Ends a workload early, from inside its event loop (a watchdog that finds the engine dead, a
    signal): no request is sent after :meth:`set`, and the requests in flight end at once as failed
    records (``error`` ``"aborted: REASON"``) with what they had received, so that nothing measured
    until then is lost."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sleepers: set[asyncio.Future[None]] = set()

    def is_set(self) -> bool:
        return self.reason is not None

    def set(self, reason: str) -> None:
        """Stop the workload (the first reason is kept)."""
        if self.reason is not None:
            return
        self.reason = reason
        for sleeper in list(self._sleepers):
            _wake(sleeper)
        for task in list(self._tasks):
            task.cancel()

    def track(self) -> None:
        """The calling task sends requests: cancel it when the workload is aborted."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def sleep(self, seconds: float) -> None:
        """Sleep as ``asyncio.sleep`` does (a timer on the loop: the same precision), or less when
        the workload is aborted meanwhile."""
        if self.reason is not None:
            return
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(seconds, _wake, wake)
        self._sleepers.add(wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._sleepers.discard(wake)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class Share:
    """The part of a workload one client process sends (:mod:`k3pipe.bench.shards` splits a workload
    over several); the default is the whole workload, as one process sends it.

    - ``process``: its number (0 for one process); ``realtime``: it runs under SCHED_FIFO (recorded);
    - ``warmup``: this process sends the warm-up requests;
    - ``slots``: its share of ``concurrency`` under load ``concurrency`` (None: all of it);
    - ``take``: the next measured request to send, from the one counter every process draws from
      (None: this process counts alone); returns None when none is left;
    - ``owns``: whether this process sends a scheduled (constant, poisson) request (None: all);
    - ``acquire``/``release``: the cap on requests in flight across processes under a schedule
      (None: this process's own ``concurrency`` slots);
    - ``start``: awaited after the warm-up, returns the ``perf_counter`` time at which the measured
      phase starts in every process (None: at once).
    """

    process: int = 0
    realtime: bool = False
    warmup: bool = True
    slots: int | None = None
    take: Callable[[], int | None] | None = None
    owns: Callable[[int], bool] | None = None
    acquire: Callable[[], Awaitable[None]] | None = None
    release: Callable[[], None] | None = None
    start: Callable[[], Awaitable[float]] | None = None

    @property
    def whole(self) -> bool:
        """This process sends the whole workload (no other process shares it)."""
        return self.start is None and self.take is None and self.owns is None


class ClientLoad(BaseModel):
    """How busy one client process was during the measured phase: a process whose CPU was saturated
    or whose event loop ran late stamped its own queueing, not the engine's timing."""

    model_config = ConfigDict(extra="forbid")

    process: int = Field(description="The client process (0 when one process sends the workload).")
    cpus: list[int] = Field(description="The CPUs it could run on (its affinity).")
    realtime: bool = Field(default=False, description="It ran under SCHED_FIFO.")
    wall_s: float = Field(description="Length of its measured phase.")
    cpu_s: float = Field(description="CPU time it used meanwhile (user + system, all its threads).")
    events: int = Field(description="Stream lines it stamped for measured requests.")
    loop_lag_ms_p99: float = Field(
        description="p99 of how late a 10 ms timer of its event loop fired (its loop's own queueing)."
    )
    loop_lag_ms_max: float = Field(description="The latest such timer.")

    @property
    def cpu_util(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class _LoopProbe:
    """Measures the event loop's lag (a 10 ms timer's lateness) and the process's CPU time."""

    PERIOD_S = 0.01

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.cpu0 = time.process_time()
        self.wall0 = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.PERIOD_S)
            self.lags.append(max(0.0, time.perf_counter() - before - self.PERIOD_S) * 1000.0)

    async def stop(self, process: int, records: Sequence[RequestRecord], realtime: bool) -> ClientLoad:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        lags = np.array(self.lags or [0.0])
        return ClientLoad(
            process=process,
            cpus=sorted(os.sched_getaffinity(0)),
            realtime=realtime,
            wall_s=time.perf_counter() - self.wall0,
            cpu_s=time.process_time() - self.cpu0,
            events=sum(len(r.chunk_times) for r in records if not r.warmup),
            loop_lag_ms_p99=float(np.percentile(lags, 99)),
            loop_lag_ms_max=float(lags.max()),
        )


class WorkloadResult(BaseModel):
    """All records of one workload run, warm-up included (flagged), and the measured window."""

    model_config = ConfigDict(extra="forbid")

    workload: str = Field(description="Workload name.")
    records: list[RequestRecord] = Field(description="One record per request, ordered by index.")
    t_start: float = Field(description="perf_counter of the first measured send.")
    t_end: float = Field(description="perf_counter of the last measured stream end.")
    started_at_unix_s: float = Field(description="Wall-clock time (time.time()) of the first measured send.")
    requests_planned: int | None = Field(
        default=None, description="Measured requests the workload asked for (num_requests)."
    )
    stopped_by_duration: bool = Field(
        default=False,
        description="duration_s ran out before every planned measured request was sent.",
    )
    aborted: str | None = Field(
        default=None,
        description=(
            "Why the workload ended before its planned requests (the engine died or froze, an "
            "interrupt); the records hold what was measured until then."
        ),
    )
    client_load: list[ClientLoad] = Field(
        default_factory=list, description="How busy each client process was (one per process)."
    )
    warmup: WarmupReport | None = Field(
        default=None,
        description=(
            "The warm-up's waves and whether it ended steady (k3pipe.bench.warmup); None from a "
            "client process that sent no warm-up."
        ),
    )
    opening_wave: int | None = Field(
        default=None,
        description=(
            "Measured requests the measured phase sent at once as it opened, with nothing in flight "
            "(load 'concurrency': its concurrency); None under a schedule ('constant', 'poisson')."
        ),
    )

    @property
    def duration_s(self) -> float:
        """Length of the measured window."""
        return self.t_end - self.t_start


async def run_workload(
    client: httpx.AsyncClient | None,
    base_url: str,
    model: str,
    api_key: SecretStr | None,
    workload: WorkloadSpec,
    prompts: list[Prompt],
    on_progress: Callable[[int, int], None] | None = None,
    *,
    continuous_usage: bool = True,
    on_measured_start: Callable[[], Awaitable[object]] | None = None,
    abort: Abort | None = None,
    share: Share | None = None,
) -> WorkloadResult:
    """Send a workload's requests, streaming, under the workload's load pattern.

    The first ``workload.warmup_requests`` prompts are warm-up requests, sent first at
    ``workload.concurrency`` whatever the load and recorded with ``warmup=True``; the next
    ``workload.num_requests`` prompts are the measured ones. ``prompts`` must hold at least that many.
    Under ``workload.warmup == "steady"`` the warm-up goes out in waves of ``concurrency`` (one wave
    in flight at a time) and stops as soon as a wave's output rate agrees with the previous wave's
    within ``workload.warmup_tolerance_pct`` (:mod:`k3pipe.bench.warmup`), or after
    ``warmup_requests // concurrency`` waves; the warm-up prompts it did not need are not sent. The
    result's ``warmup`` says what the warm-up did, under either setting.
    Measured requests go out as ``workload.load`` says: ``concurrency`` keeps ``concurrency`` in
    flight; ``constant`` and ``poisson`` send at the times of :func:`schedule_offsets` after the
    start of the measured phase, with at most ``concurrency`` in flight (a due request waits for a
    slot; ``t_scheduled`` keeps when it was due). With ``workload.duration_s`` no new measured request
    is sent once that many seconds have passed since the first measured send (the first is always
    sent; those in flight finish); the records then hold fewer than ``num_requests`` measured ones
    and ``stopped_by_duration`` is set. Requests go to
    ``{base_url}/chat/completions`` or ``{base_url}/completions`` (``base_url`` includes its path,
    e.g. ``http://127.0.0.1:8000/v1``) with ``stream``, ``stream_options.include_usage`` (and
    ``continuous_usage_stats`` unless ``continuous_usage`` is False: a server that rejects the field),
    ``max_tokens = workload.output_tokens``, ``temperature 0`` and ``ignore_eos`` when the workload
    asks for it. Each request has ``workload.request_timeout_s`` in total (it also replaces the
    client's own connect/read/write/pool timeouts for these requests).

    ``client``: None (the normal case) sends through the module's own HTTP/1.1 transport
    (:class:`k3pipe.bench.transport.SSEPool`, ``concurrency + 4`` keep-alive connections, opened for
    this call and closed at its end), which stamps ``t_send`` when the request's bytes are written; an
    ``httpx.AsyncClient`` (e.g. with a ``MockTransport``) is used as given instead, with ``t_send``
    stamped before httpx is asked to send (it must allow ``concurrency`` connections).
    ``on_progress(done, total)`` is called after each request, warm-up included.
    ``on_measured_start()`` is awaited once, after the warm-up requests have all ended and before the
    first measured one is sent, with nothing in flight (e.g. to scrape the engine's metrics at the
    exact start of the measured window).
    ``abort`` (an :class:`Abort`) ends the workload early when set: the result then holds the
    records so far (those in flight ended as failed) and ``aborted`` says why.
    ``share`` (a :class:`Share`): the part of the workload this process sends, when several client
    processes send it (:func:`k3pipe.bench.shards.run_sharded`); the result then holds its records only.

    Raises:
        BenchmarkError: fewer prompts than warm-up plus measured requests, or an invalid base URL.
            Failed requests do not raise: they are records with ``error`` set.
    """
    warmup_n, measured_n = workload.warmup_requests, workload.num_requests
    if len(prompts) < warmup_n + measured_n:
        raise BenchmarkError(
            f"workload {workload.name!r} needs {warmup_n + measured_n} prompts "
            f"({warmup_n} warm-up + {measured_n} measured), got {len(prompts)}: generate "
            "warmup_requests + num_requests prompts"
        )
    secret = api_key.get_secret_value() if api_key is not None else None
    url = base_url.rstrip("/") + ("/chat/completions" if workload.api == "chat" else "/completions")
    try:
        parsed = httpx.URL(url)
        problem = None if parsed.scheme in ("http", "https") and parsed.host else "no http(s) scheme or host"
    except httpx.InvalidURL as exc:
        problem = str(exc)
    if problem is not None:
        raise BenchmarkError(
            f"base URL {base_url!r} is not a valid URL ({problem}): give scheme, host and path, "
            "e.g. 'http://127.0.0.1:8000/v1'"
        )
    path = "/chat/completions" if workload.api == "chat" else "/completions"
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with contextlib.AsyncExitStack() as stack:
        sender: SSESender
        if client is None:
            try:
                pool = SSEPool(base_url, max_connections=workload.concurrency + 4, headers=headers)
            except ValueError as exc:
                raise BenchmarkError(f"base URL {base_url!r} cannot be used: {exc}") from None
            sender = await stack.enter_async_context(pool)
        else:
            sender = HttpxSSE(client, base_url, headers)
        return await _run(
            sender,
            url,
            path,
            secret,
            model,
            workload,
            prompts,
            on_progress,
            continuous_usage,
            on_measured_start,
            abort or Abort(),
            share or Share(),
        )


async def _run(
    sender: SSESender,
    url: str,
    path: str,
    secret: str | None,
    model: str,
    workload: WorkloadSpec,
    prompts: list[Prompt],
    on_progress: Callable[[int, int], None] | None,
    continuous_usage: bool,
    on_measured_start: Callable[[], Awaitable[object]] | None,
    abort: Abort,
    share: Share,
) -> WorkloadResult:
    warmup_n, measured_n = workload.warmup_requests, workload.num_requests
    total = warmup_n + measured_n
    progress = _Progress(total, on_progress)
    concurrency = workload.concurrency
    slots = share.slots if share.slots is not None else workload.concurrency

    # Every body is serialized before the first request: JSON-encoding a 200K-token prompt takes
    # milliseconds, which on the event loop would delay the stamps of the streams in flight.
    bodies = [_body(model, workload, prompts[i], continuous_usage) for i in range(total)]

    async def one(index: int, warmup: bool, t_scheduled: float | None = None) -> RequestRecord:
        record = await _send(
            sender,
            path,
            url,
            bodies[index],
            prompts[index],
            workload,
            index,
            warmup,
            secret,
            t_scheduled,
            abort,
        )
        progress.step()
        return record

    # A full garbage collection of a large heap stops the event loop for tens of milliseconds (75 ms
    # measured at 1000 streams), and every chunk that arrives meanwhile is stamped late. The objects
    # alive now (prompts, bodies, the process's own) are frozen out of collection for the workload,
    # the young generations collected first; not the whole heap, whose old garbage waits frozen
    # until the workload ends: a full collection before each workload cost 0.2 s of CPU in a process
    # that had run many (a test worker's: a quarter of a study test's CPU, 2026-12-07).
    gc.collect(1)
    gc.freeze()
    measured: list[RequestRecord] = []
    wall0, perf0 = time.time(), time.perf_counter()
    probe = _LoopProbe()
    warm: list[RequestRecord] = []
    report: WarmupReport | None = None
    try:
        if share.warmup and workload.warmup == "steady":
            warm = await _steady_warmup(workload, lambda i: one(i, True), abort)
            progress.total -= warmup_n - len(warm)  # the warm-up prompts it did not need
        elif share.warmup:
            warm = await _pool(range(warmup_n), concurrency, lambda i: one(i, True), abort=abort)
        if share.warmup:
            report = warmup_report(
                warm, workload.warmup, concurrency, workload.warmup_tolerance_pct, warmup_n
            )
            _log_warmup(workload.name, report)
        # the warm-up has ended: nothing of it is in flight from here on
        if on_measured_start is not None and not abort.is_set():
            await on_measured_start()
        if share.start is not None and not abort.is_set():
            begin = await share.start()  # the one start of every process, on the system-wide clock
            await abort.sleep(begin - time.perf_counter())
        wall0, perf0 = time.time(), time.perf_counter()
        if share.start is not None and not abort.is_set():
            wall0, perf0 = wall0 - (perf0 - begin), begin
        deadline = None if workload.duration_s is None else perf0 + workload.duration_s
        indices = range(warmup_n, total)
        probe.start()
        if abort.is_set():
            pass
        elif workload.load == "concurrency":
            measured = await _pool(
                indices, slots, lambda i: one(i, False), deadline, abort=abort, take=share.take
            )
        else:
            offsets = schedule_offsets(workload)
            mine = [i for i in indices if share.owns is None or share.owns(i)]
            measured = await _scheduled(
                range(0),
                [perf0 + float(offsets[i - warmup_n]) for i in mine],
                workload.concurrency,
                lambda i, due: one(i, False, due),
                deadline,
                abort=abort,
                order=mine,
                acquire=share.acquire,
                release=share.release,
            )
    finally:
        gc.unfreeze()
        load = [await probe.stop(share.process, measured, share.realtime)]
    if abort.is_set():
        log.warning(
            "workload %s aborted (%s) after %d of %d measured requests",
            workload.name,
            abort.reason,
            len(measured),
            measured_n,
        )
        if not measured:  # nothing measured: an empty window at the moment it ended
            now = time.perf_counter()
            return WorkloadResult(
                workload=workload.name,
                records=warm,
                t_start=now,
                t_end=now,
                started_at_unix_s=wall0 + (now - perf0),
                requests_planned=measured_n,
                aborted=abort.reason,
                client_load=load,
                warmup=report,
            )
    # a share's own count says nothing of the workload's: the processes' results are merged first
    stopped = share.whole and len(measured) < measured_n and not abort.is_set()
    if share.whole:
        report_end(workload, measured, stopped)
    if not measured:  # a process of several whose share was empty
        return WorkloadResult(
            workload=workload.name,
            records=warm,
            t_start=perf0,
            t_end=perf0,
            started_at_unix_s=wall0,
            requests_planned=measured_n,
            client_load=load,
            warmup=report,
        )
    t_start = min(r.t_send for r in measured)
    return WorkloadResult(
        workload=workload.name,
        records=warm + measured,
        t_start=t_start,
        t_end=max(r.t_end for r in measured),
        started_at_unix_s=wall0 + (t_start - perf0),
        requests_planned=measured_n,
        stopped_by_duration=stopped,
        aborted=abort.reason,
        client_load=load,
        warmup=report,
        opening_wave=concurrency if workload.load == "concurrency" else None,
    )


async def _steady_warmup(
    workload: WorkloadSpec, send: Callable[[int], Awaitable[RequestRecord]], abort: Abort
) -> list[RequestRecord]:
    """Warm-up waves of ``concurrency`` requests (prompts 0, 1, ... in order), each sent at once and
    ended before the next, until a wave's output rate agrees with the previous wave's within
    ``warmup_tolerance_pct``, or ``warmup_requests // concurrency`` waves have gone out."""
    c = workload.concurrency
    records: list[RequestRecord] = []
    for k in range(workload.warmup_requests // c):
        if abort.is_set():
            break
        records += await _pool(range(k * c, (k + 1) * c), c, send, abort=abort)
        last = warmup_waves(records[-2 * c :], c)[-1]  # this wave, against the one before it
        if agree(last.change_pct, workload.warmup_tolerance_pct):
            break
    return records


def _log_warmup(name: str, report: WarmupReport) -> None:
    if not report.requests_sent:
        return
    rates = ", ".join("n/a" if w.output_tps is None else f"{w.output_tps:.0f}" for w in report.waves)
    change = "n/a" if report.last_change_pct is None else f"{report.last_change_pct:+.1f}%"
    verdict = {True: "steady", False: "NOT steady", None: "too few full waves to judge"}
    log.info(
        "workload %s: warm-up (%s) sent %d of %d requests in %d wave(s); wave output rates %s tok/s; "
        "last change %s (tolerance %g%%): %s",
        name,
        report.mode,
        report.requests_sent,
        report.requests_planned,
        len(report.waves),
        rates,
        change,
        report.tolerance_pct,
        verdict[report.steady],
    )


def report_end(workload: WorkloadSpec, measured: Sequence[RequestRecord], stopped: bool) -> None:
    """Log how a workload's measured phase ended: cut short by its duration_s, and its failures."""
    if stopped:
        log.info(
            "workload %s: duration_s %s ran out after %d of %d measured requests were sent",
            workload.name,
            workload.duration_s,
            len(measured),
            workload.num_requests,
        )
    failed = [r for r in measured if not r.ok]
    if failed:
        log.warning(
            "workload %s: %d of %d measured requests failed; first error: %s",
            workload.name,
            len(failed),
            len(measured),
            failed[0].error,
        )


def _uncancel() -> None:
    """The current task goes on after a cancellation it handled (an abort), un-cancelled."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def schedule_offsets(workload: WorkloadSpec) -> np.ndarray:
    """Send times of the measured requests, in seconds after the first, for a rate-based load.

    ``constant``: ``k / rate_rps``. ``poisson``: the first at 0, then gaps drawn as
    ``numpy.random.default_rng(workload.seed).exponential(1 / rate_rps)``, so the same seed gives the
    same schedule. One entry per measured request (``num_requests``).

    Raises:
        ValueError: the load is not rate-based (``concurrency`` has no schedule).
    """
    if workload.load == "concurrency" or workload.rate_rps is None:
        raise ValueError(f"load {workload.load!r} has no send schedule: only 'constant' and 'poisson' do")
    n, mean_gap = workload.num_requests, 1.0 / workload.rate_rps
    if workload.load == "constant":
        return np.arange(n, dtype=float) * mean_gap
    gaps = np.random.default_rng(workload.seed).exponential(mean_gap, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


async def _pool(
    indices: range,
    concurrency: int,
    send: Callable[[int], Awaitable[RequestRecord]],
    deadline: float | None = None,
    abort: Abort | None = None,
    take: Callable[[], int | None] | None = None,
) -> list[RequestRecord]:
    """Run ``send`` over ``indices`` with at most ``concurrency`` in flight; records by index.

    After ``deadline`` (perf_counter) no new request starts, except the first, which always does;
    after ``abort`` is set, none does. ``take``: the next index from a counter shared with other
    processes (each draws the next request when a slot of its own frees), instead of ``indices``.
    """
    results: dict[int, RequestRecord] = {}
    todo: Iterator[int] = iter(indices) if take is None else iter(take, None)

    async def worker() -> None:
        # One worker per slot: a slot takes the next request as soon as its previous one ends, so
        # exactly `concurrency` are in flight while work remains. next() cannot interleave in asyncio.
        if abort is not None:
            abort.track()
        for index in todo:
            if deadline is not None and results and time.perf_counter() >= deadline:
                return
            if abort is not None and abort.is_set():
                return
            results[index] = await send(index)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(indices))):
            group.create_task(worker())
    return [results[i] for i in sorted(results)]


async def _scheduled(
    indices: range,
    due: Sequence[float],
    concurrency: int,
    send: Callable[[int, float], Awaitable[RequestRecord]],
    deadline: float | None = None,
    abort: Abort | None = None,
    order: Sequence[int] | None = None,
    acquire: Callable[[], Awaitable[None]] | None = None,
    release: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Start ``send(index, due)`` at each ``due`` perf_counter time, at most ``concurrency`` in flight.

    A request due while ``concurrency`` are in flight waits for a slot (its send lags its schedule).
    No request due at or after ``deadline``, or reaching its slot after it, is sent (the first always is);
    none after ``abort`` is set. ``order``: the indices of ``due`` when they are not ``indices`` (a
    process's share); ``acquire``/``release``: a slot of a cap shared with other processes.
    """
    results: dict[int, RequestRecord] = {}
    slots = asyncio.Semaphore(concurrency)
    take_slot = acquire or slots.acquire
    free_slot = release or slots.release
    abort = abort or Abort()
    chosen = list(indices) if order is None else list(order)

    async def fire(index: int, t_due: float) -> None:
        abort.track()
        try:
            results[index] = await send(index, t_due)
        finally:
            free_slot()

    async with asyncio.TaskGroup() as group:
        for n, (index, t_due) in enumerate(zip(chosen, due, strict=True)):
            if n and deadline is not None and t_due >= deadline:
                break
            wait = t_due - time.perf_counter()
            if wait > 0:
                await abort.sleep(wait)  # ends early when the workload is aborted
            # an abort ends the requests in flight at once, so a slot frees at once too
            await take_slot()
            if abort.is_set() or (n and deadline is not None and time.perf_counter() >= deadline):
                free_slot()
                break
            group.create_task(fire(index, t_due))
    return [results[i] for i in sorted(results)]


@dataclass
class _Progress:
    total: int
    callback: Callable[[int, int], None] | None
    done: int = 0

    def step(self) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total)


@dataclass
class _Stream:
    """Mutable state of one request while its stream is read."""

    t_first_delta: float | None = None
    t_first_content: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    # running usage.completion_tokens as of each token-bearing chunk (None: that chunk had no usage)
    chunk_usage: list[int | None] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    data_lines: int = 0
    error: str | None = None
    secret: str | None = None


def stream_options(continuous_usage: bool = True) -> dict[str, bool]:
    """The ``stream_options`` every benchmark request sends (the health gate's probe sends the same)."""
    return {"include_usage": True, **({"continuous_usage_stats": True} if continuous_usage else {})}


def _body(
    model: str,
    workload: WorkloadSpec,
    prompt: Prompt,
    continuous_usage: bool = True,
    conversation: list[dict[str, str]] | str | None = None,
    extra: dict[str, str] | None = None,
) -> bytes:
    """A request's JSON body; ``conversation``, when given, is sent instead of the prompt alone (the
    messages under the chat API, the whole text under completions); ``extra`` fields join it."""
    body: dict[str, Any] = {"model": model, **(extra or {})}
    if workload.api == "chat":
        body["messages"] = (
            conversation if isinstance(conversation, list) else [{"role": "user", "content": prompt.text}]
        )
    else:
        body["prompt"] = conversation if isinstance(conversation, str) else prompt.text
    body.update(
        max_tokens=workload.output_tokens,
        temperature=0,
        stream=True,
        stream_options=stream_options(continuous_usage),
    )
    if workload.ignore_eos:
        body["ignore_eos"] = True
    return json.dumps(body, ensure_ascii=False).encode()


async def _send(
    sender: SSESender,
    path: str,
    url: str,
    content: bytes,
    prompt: Prompt,
    workload: WorkloadSpec,
    index: int,
    warmup: bool,
    secret: str | None,
    t_scheduled: float | None = None,
    abort: Abort | None = None,
    answer: list[str] | None = None,
) -> RequestRecord:
    # The body is serialized before the call: JSON-encoding a 200K-token prompt is client work, not
    # TTFT. The transport stamps t_send after the request's write, so waiting for a connection and
    # opening one are not counted either; lines are stamped by the read that completed them.
    state = _Stream(secret=secret)
    status: int | None = None
    timeout_s = workload.request_timeout_s
    t_call = time.perf_counter()
    t_send: float | None = None
    t_end: float | None = None

    def on_line(line: bytes, now: float) -> bool:
        return _line(line, now, state)

    try:
        result = await sender.post_stream(path, content, on_line, timeout_s)
        status, t_send, t_end = result.status, result.t_sent, result.t_end
        if not 200 <= status < 300:  # errors, and redirects (not followed)
            text = (result.error_body or b"").decode("utf-8", "replace")
            state.error = f"HTTP {status} from {url}: {_short(text, secret)}"
        elif state.data_lines == 0 and state.error is None:
            kind = result.headers.get("content-type", "no content-type")
            state.error = f"the response ({kind}) was not an SSE stream: no 'data:' lines"
    except TimeoutError as exc:
        t_send = getattr(exc, "t_sent", None)
        state.error = f"timed out after {timeout_s} s (workload request_timeout_s)"
    except TransportError as exc:
        t_send = exc.t_sent
        state.error = f"{type(exc).__name__}: {_short(str(exc), secret) or 'no detail'}"
    except Exception as exc:  # one request's surprise must not lose the other records
        log.debug("request %d to %s raised", index, url, exc_info=True)
        state.error = f"unexpected {type(exc).__name__}: {_short(str(exc), secret) or 'no detail'}"
    except asyncio.CancelledError:
        if abort is None or not abort.is_set():
            raise
        _uncancel()  # the workload was aborted: this request ends as a record of what it received
        state.error = f"aborted: {abort.reason}"
    if t_send is None:
        t_send = t_call  # nothing was sent
    if t_end is None:
        t_end = time.perf_counter()
    if state.error is None:
        state.error = _zero_output_error(state)
    if answer is not None:
        answer.append("".join(state.text))
    return RequestRecord(
        index=index,
        warmup=warmup,
        prompt_tokens=prompt.tokens,
        t_scheduled=t_send if t_scheduled is None else t_scheduled,
        max_tokens=workload.output_tokens,
        usage_prompt_tokens=state.usage_prompt_tokens,
        usage_output_tokens=state.usage_output_tokens,
        t_send=t_send,
        t_first_delta=state.t_first_delta,
        t_first_content=state.t_first_content,
        chunk_times=state.chunk_times,
        chunk_tokens=_chunk_tokens(state.chunk_usage),
        output_text="".join(state.text) if state.usage_output_tokens is None and state.text else None,
        t_end=t_end,
        status_code=status,
        finish_reason=state.finish_reason,
        saw_done=state.saw_done,
        error=_scrub(state.error, secret),
    )


def _line(line: bytes, now: float, state: _Stream) -> bool:
    """Handle one SSE line stamped ``now``; True when the stream is over."""
    if not line.startswith(b"data:"):
        return False  # blank separators, ': keep-alive' comments, event:/id: fields
    payload = line[5:].strip()
    if not payload:
        return False
    state.data_lines += 1
    if payload == b"[DONE]":
        state.saw_done = True
        return True
    try:
        chunk = json.loads(payload)
    except ValueError:
        state.error = (
            f"malformed SSE data (not JSON): {_short(payload.decode('utf-8', 'replace'), state.secret)}"
        )
        return True
    if not isinstance(chunk, dict):
        text = _short(payload.decode("utf-8", "replace"), state.secret)
        state.error = f"unexpected SSE data (not a JSON object): {text}"
        return True
    if chunk.get("error") is not None:
        text = _short(json.dumps(chunk["error"], ensure_ascii=False), state.secret)
        state.error = f"server error in stream: {text}"
        return True
    usage = chunk.get("usage")
    running: int | None = None
    if isinstance(usage, dict):
        state.usage_prompt_tokens = _int(usage.get("prompt_tokens"), state.usage_prompt_tokens)
        running = _int(usage.get("completion_tokens"), None)
        state.usage_output_tokens = running if running is not None else state.usage_output_tokens
    any_token = content = False
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            state.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        if isinstance(delta, dict):
            has_content = _text(delta.get("content"))
            content = content or has_content
            texts = [delta[k] for k in _DELTA_TOKEN_FIELDS if _text(delta.get(k))]
            # servers that mirror reasoning into reasoning_content send the same text twice
            state.text.extend(dict.fromkeys(texts))
            calls = delta.get("tool_calls")
            if calls:
                state.text.extend(_tool_call_text(calls))
            any_token = any_token or bool(texts) or bool(calls)
        elif _text(choice.get("text")):  # /v1/completions
            any_token = content = True
            state.text.append(choice["text"])
    if any_token:
        state.chunk_times.append(now)
        state.chunk_usage.append(running)
        if state.t_first_delta is None:
            state.t_first_delta = now
    if content and state.t_first_content is None:
        state.t_first_content = now
    return False


def _tool_call_text(calls: object) -> list[str]:
    """The generated parts of tool-call deltas (function name and argument text), for re-tokenizing."""
    out: list[str] = []
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.extend(
                v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str) and v
            )
    return out


def _text(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _int(value: object, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _chunk_tokens(running: list[int | None]) -> list[int] | None:
    """Per-chunk token counts from the running completion_tokens of each token-bearing chunk."""
    if not running or any(n is None for n in running):
        return None
    counts: list[int] = []
    before = 0
    for n in running:
        assert n is not None
        counts.append(max(n - before, 0))
        before = max(before, n)
    return counts


def _zero_output_error(state: _Stream) -> str | None:
    if state.usage_output_tokens == 0 or (state.usage_output_tokens is None and not state.chunk_times):
        return (
            "the stream ended with zero output tokens "
            f"(usage.completion_tokens={state.usage_output_tokens}, token-bearing chunks=0, "
            f"finish_reason={state.finish_reason})"
        )
    if not state.chunk_times:
        return (
            f"usage reports {state.usage_output_tokens} output tokens but no chunk carried content, "
            "reasoning or tool calls: the stream was cut or the client cannot see its tokens"
        )
    return None


def _short(text: str, secret: str | None = None) -> str:
    # scrubbed before the cut: a key straddling the cut would no longer match whole afterwards
    text = _scrub(text, secret) or ""
    text = text.strip()
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + f"... [{len(text)} chars]"


def _scrub(text: str | None, secret: str | None) -> str | None:
    # A gateway may echo request headers in its error page: never let the key into a record.
    if text is None or not secret:
        return text
    return text.replace(secret, "***")


# The most connections a replay opens: a request beyond them waits for one, and that wait is lag.
_REPLAY_CONNECTIONS = 1024


async def replay_trace(
    base_url: str,
    model: str,
    api_key: SecretStr | None,
    workload: WorkloadSpec,
    trace: Trace,
    prompts: Sequence[Prompt],
    *,
    speed: float = 1.0,
    max_idle_s: float | None = None,
    thread: bool = False,
    session_field: str | None = None,
    session_tag: str = "",
    on_progress: Callable[[int, int], None] | None = None,
    abort: Abort | None = None,
) -> tuple[ReplayOutcome, list[RequestRecord], float]:
    """Send ``trace``'s requests in time (k3pipe.bench.replay: the plan, the sessions' order, a failed
    turn ending its session), each with ``max_tokens`` its ``output_tokens``, streaming as
    :func:`run_workload` does (``workload`` gives the API, the timeout and ``ignore_eos``).

    Each request sends its prompt; with ``thread``, a session's later turn sends the conversation so
    far instead: the previous turn's as sent, the engine's real answer to it (chat: an assistant
    message), then its prompt (:func:`k3pipe.prompts.trace_prompts.replay_prompts` made it the new
    part only). With ``session_field``, every request of a session carries that body field set to the
    session's name and ``session_tag`` (a gateway's session affinity).
    ``abort`` stops the replay: no request is sent after it, those in flight end as
    failed records. Returns the replay's outcome (planned, ready, sent and ended times; the sender's
    lag), one record per request sent, in trace order (a record's ``t_scheduled`` is when it was
    ready to go), and the perf_counter origin of the plan.

    Raises:
        BenchmarkError: a prompt count other than the trace's requests, or an unusable base URL.
    """
    if len(prompts) != len(trace.requests):
        raise BenchmarkError(
            f"trace replay: {len(prompts)} prompts for {len(trace.requests)} requests: one prompt per "
            "request (k3pipe.prompts.trace_prompts.trace_prompts)"
        )
    abort = abort or Abort()
    secret = api_key.get_secret_value() if api_key is not None else None
    chat = workload.api == "chat"
    path = "/chat/completions" if chat else "/completions"
    url = base_url.rstrip("/") + path
    plan = replay_plan(trace, speed, max_idle_s)
    before = previous_turns(trace) if thread else [None] * len(prompts)
    # one spec per request (its max_tokens); a request on its own or a first turn serialized before the
    # first send, a threaded turn when its previous answer is in
    specs = [workload.model_copy(update={"output_tokens": r.output_tokens}) for r in trace.requests]
    extras = [
        {session_field: f"{r.session}{session_tag}"} if session_field and r.session is not None else None
        for r in trace.requests
    ]
    bodies: list[bytes | None] = [
        _body(model, specs[i], prompts[i], extra=extras[i]) if before[i] is None else None
        for i in range(len(prompts))
    ]
    sent: dict[int, list[dict[str, str]] | str] = {}  # what a turn sent, for the turn after it
    answers: dict[int, str] = {}
    threaded = {p for p in before if p is not None}
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    try:
        pool = SSEPool(base_url, max_connections=min(len(prompts), _REPLAY_CONNECTIONS), headers=headers)
    except ValueError as exc:
        raise BenchmarkError(f"base URL {base_url!r} cannot be used: {exc}") from None
    records: dict[int, RequestRecord] = {}
    done = 0

    def conversation(i: int) -> list[dict[str, str]] | str:
        prev = before[i]
        text = prompts[i].text
        if prev is None:
            return [{"role": "user", "content": text}] if chat else text
        history = sent[prev]
        if isinstance(history, list):
            return [
                *history,
                {"role": "assistant", "content": answers[prev]},
                {"role": "user", "content": text},
            ]
        return history + answers[prev] + text

    async with pool as sender:

        async def send(i: int) -> bool:
            nonlocal done
            abort.track()
            body = bodies[i]
            if before[i] is not None or i in threaded:
                sent[i] = conversation(i)
                if body is None:
                    body = _body(model, specs[i], prompts[i], conversation=sent[i], extra=extras[i])
            assert body is not None
            answer: list[str] | None = [] if i in threaded else None
            record = await _send(
                sender, path, url, body, prompts[i], specs[i], i, False, secret, abort=abort, answer=answer
            )
            if answer is not None:
                answers[i] = answer[0]
            records[i] = record
            done += 1
            if on_progress is not None:
                on_progress(done, len(prompts))
            return record.error is None

        gc.collect(1)  # as a workload's (_run): the young generations, then all frozen
        gc.freeze()
        start = time.perf_counter()  # the replay's own origin, a few microseconds before its first read
        try:
            outcome = await replay(
                trace, plan, send, clock=time.perf_counter, sleep=abort.sleep, stopped=lambda: abort.reason
            )
        finally:
            gc.unfreeze()
    ready = {r.index: r.ready_s for r in outcome.records}
    kept = []
    for i in sorted(records):
        at = ready.get(i)
        kept.append(records[i] if at is None else records[i].model_copy(update={"t_scheduled": start + at}))
    return outcome, kept, start
