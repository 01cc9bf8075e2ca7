"""A workload's streams spread over several client processes, under one schedule.

One Python process reads at most about 12,500 token events a second before its own queueing shows in
the stamps (docs/performance.md); an engine on a real GPU streams more. :func:`run_sharded` starts N
processes (``multiprocessing`` spawn), each with its own event loop and connection pool, running
:func:`k3pipe.bench.client.run_workload` on its :class:`~k3pipe.bench.client.Share`:

- the warm-up requests go out from process 0, at the workload's concurrency, before anything else
  (under ``warmup: steady`` in waves until the rate is steady: the others wait for it all the same);
- every process then waits for the one start time the parent sets once all are ready (and after
  ``on_measured_start``, with nothing in flight), on the system-wide monotonic clock that
  ``time.perf_counter`` reads on Linux (``CLOCK_MONOTONIC``): stamps of all processes compare;
- load ``concurrency``: process k holds its share of the ``concurrency`` slots (they add up to it) and
  a slot that frees takes the next request from one counter all processes draw from, so exactly
  ``concurrency`` are in flight while requests remain, as in one process;
- loads ``constant`` and ``poisson``: the schedule is the workload's (:func:`schedule_offsets`); request
  i goes from process ``i mod N`` at its due time, and the cap on requests in flight is one semaphore
  of all processes;
- records come back to the parent and are merged in index order; ``duration_s`` ends every process's
  sending at the same time (each always sends its first request); an abort of the parent (the
  engine lost, a signal) stops every process at once, keeping what they measured.

With one process the workload runs in the calling process exactly as before (no process is started).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from pydantic import SecretStr

from k3pipe.bench.client import Abort, Share, WorkloadResult, report_end, run_workload
from k3pipe.bench.request_records import RequestRecord
from k3pipe.core.errors import BenchmarkError
from k3pipe.core.procs import parse_cpu_list
from k3pipe.prompts.datasets import Prompt
from k3pipe.schema.specs import ClientSpec, WorkloadSpec

__all__ = ["STREAMS_PER_PROCESS", "client_layout", "run_sharded", "slot_shares"]

log = logging.getLogger(__name__)

_POLL_S = 0.005
"""How often the parent and each process look at the shared state (start, stop, results)."""
_LEAD_S = 0.05
"""The measured phase starts this long after the parent gives the start: every process is waiting."""
_REASON_BYTES = 512
_RT_PRIORITY = 10
"""SCHED_FIFO priority of a real-time client process (1-99: low, yet above every normal process)."""


STREAMS_PER_PROCESS = 128
"""Streams one client process takes by default: at ~100 tokens/s a stream (a GPU decoding), 128 of
them are ~12,800 events/s, about what one process stamps without queueing (docs/performance.md)."""


def client_layout(
    client: ClientSpec, concurrency: int, engine_cpus: Sequence[int] | None = None
) -> tuple[int, list[list[int]] | None]:
    """How many client processes send a workload of ``concurrency`` streams, and each one's CPUs
    (None: unpinned). The client's CPUs are ``client.cpus``, else those k3pipe may use less a pinned
    engine's; ``client.processes`` or one per :data:`STREAMS_PER_PROCESS` streams, at most one per
    CPU. Processes are pinned (each to its slice of the CPUs, round-robin) only when ``client.cpus``
    or the engine's CPUs were given."""
    allowed = parse_cpu_list(client.cpus) if client.cpus is not None else sorted(os.sched_getaffinity(0))
    if client.cpus is None and engine_cpus:
        allowed = [c for c in allowed if c not in set(engine_cpus)] or allowed
    auto = max(1, min(len(allowed), -(-concurrency // STREAMS_PER_PROCESS)))
    n = client.processes or auto
    if client.cpus is None and not engine_cpus:
        return n, None
    return n, [allowed[k::n] or allowed for k in range(n)]


def slot_shares(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` slots over ``processes`` as evenly as they go (the first ones get one more)."""
    base, extra = divmod(concurrency, processes)
    return [base + (1 if k < extra else 0) for k in range(processes)]


@dataclass
class _Shared:
    """What the processes of one workload share."""

    next_index: Any  # multiprocessing Value('q'): the next measured request of load 'concurrency'
    in_flight: Any  # multiprocessing BoundedSemaphore: the cap under a schedule
    arrived: Any  # Value('i'): processes waiting for the start
    begin: Any  # Value('d'): the start, perf_counter seconds
    go: Any  # Event
    stop: Any  # Event: the parent aborted
    reason: Any  # Array('c'): why
    progress: Any  # Queue of 1s, one per request done
    results: Any  # Queue of (process, result dict | error text)


def _share(k: int, n: int, workload: WorkloadSpec, shared: _Shared, total: int, realtime: bool) -> Share:
    """Process ``k``'s share of the workload (see the module's docstring)."""

    def take() -> int | None:
        with shared.next_index.get_lock():
            index = int(shared.next_index.value)
            if index >= total:
                return None
            shared.next_index.value = index + 1
            return index

    async def acquire() -> None:
        while not shared.in_flight.acquire(block=False):  # noqa: ASYNC110 - a semaphore of processes
            await asyncio.sleep(0.0002)

    async def start() -> float:
        with shared.arrived.get_lock():
            shared.arrived.value += 1
        while not shared.go.is_set() and not shared.stop.is_set():  # noqa: ASYNC110 - an Event of processes
            await asyncio.sleep(_POLL_S)
        return float(shared.begin.value) if shared.go.is_set() else time.perf_counter()

    first = workload.warmup_requests
    return Share(
        process=k,
        realtime=realtime,
        warmup=k == 0,
        slots=slot_shares(workload.concurrency, n)[k],
        take=take,
        owns=lambda i: (i - first) % n == k,
        acquire=acquire,
        release=shared.in_flight.release,
        start=start,
    )


def _process_main(
    k: int,
    n: int,
    base_url: str,
    model: str,
    secret: str | None,
    workload: dict[str, Any],
    prompts: list[dict[str, Any]],
    continuous_usage: bool,
    cpus: list[int] | None,
    realtime: bool,
    shared: _Shared,
) -> None:
    """One client process: its share of the workload, its result into ``shared.results``."""
    # a Ctrl-C reaches the whole foreground group: the parent stops its processes itself (shared.stop)
    # and keeps what they measured, which a KeyboardInterrupt here would lose
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
        except PermissionError:
            log.warning(
                "client process %d: SCHED_FIFO refused (needs CAP_SYS_NICE): runs at normal priority", k
            )
            realtime = False
    spec = WorkloadSpec.model_validate(workload)
    prompt_list = [Prompt.model_validate(p) for p in prompts]
    total = spec.warmup_requests + spec.num_requests

    async def go() -> WorkloadResult:
        abort = Abort()

        async def watch() -> None:
            # the parent's stop, or the parent gone (killed): no load is left running without it
            while not shared.stop.is_set() and os.getppid() == parent:  # noqa: ASYNC110 - of processes
                await asyncio.sleep(_POLL_S)
            reason = shared.reason.value.decode(errors="replace") if shared.stop.is_set() else ""
            abort.set(reason or "the k3pipe process that started this client process is gone")

        watcher = asyncio.create_task(watch())
        try:
            return await run_workload(
                None,
                base_url,
                model,
                SecretStr(secret) if secret is not None else None,
                spec,
                prompt_list,
                lambda done, total: shared.progress.put(1),
                continuous_usage=continuous_usage,
                abort=abort,
                share=_share(k, n, spec, shared, total, realtime),
            )
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    try:
        result = asyncio.run(go())
    except BaseException as exc:  # every failure goes back to the parent
        shared.results.put((k, f"{type(exc).__name__}: {exc}"))
        raise
    shared.results.put((k, result.model_dump()))


async def run_sharded(
    base_url: str,
    model: str,
    api_key: SecretStr | None,
    workload: WorkloadSpec,
    prompts: list[Prompt],
    processes: int,
    on_progress: Callable[[int, int], None] | None = None,
    *,
    continuous_usage: bool = True,
    on_measured_start: Callable[[], Awaitable[object]] | None = None,
    abort: Abort | None = None,
    cpus: Iterable[Iterable[int]] | None = None,
    realtime: bool = False,
) -> WorkloadResult:
    """:func:`~k3pipe.bench.client.run_workload` over ``processes`` client processes (one, with
    neither CPU sets nor real-time priority: in this process). ``cpus``: the CPU set of each process
    (``os.sched_setaffinity``), or None; ``realtime``: each process asks for SCHED_FIFO (refused
    without CAP_SYS_NICE: it then runs at normal priority and its ClientLoad says so).

    Raises:
        BenchmarkError: as run_workload; or a client process failed before it sent anything.
    """
    if processes < 1:
        raise BenchmarkError(f"client processes must be at least 1, got {processes}")
    if processes == 1 and cpus is None and not realtime:
        return await run_workload(
            None,
            base_url,
            model,
            api_key,
            workload,
            prompts,
            on_progress,
            continuous_usage=continuous_usage,
            on_measured_start=on_measured_start,
            abort=abort,
        )
    total = workload.warmup_requests + workload.num_requests
    if len(prompts) < total:
        raise BenchmarkError(
            f"workload {workload.name!r} needs {total} prompts ({workload.warmup_requests} warm-up + "
            f"{workload.num_requests} measured), got {len(prompts)}"
        )
    abort = abort or Abort()
    ctx = mp.get_context("spawn")
    shared = _Shared(
        next_index=ctx.Value(ctypes.c_longlong, workload.warmup_requests),
        in_flight=ctx.BoundedSemaphore(workload.concurrency),
        arrived=ctx.Value(ctypes.c_int, 0),
        begin=ctx.Value(ctypes.c_double, 0.0),
        go=ctx.Event(),
        stop=ctx.Event(),
        reason=ctx.Array(ctypes.c_char, _REASON_BYTES),
        progress=ctx.Queue(),
        results=ctx.Queue(),
    )
    sets = [sorted(c) for c in cpus] if cpus is not None else [None] * processes
    if len(sets) != processes:
        raise BenchmarkError(f"{len(sets)} CPU sets for {processes} client processes: give one per process")
    secret = api_key.get_secret_value() if api_key is not None else None
    payload = [p.model_dump() for p in prompts[:total]]
    procs = [
        ctx.Process(
            target=_process_main,
            args=(
                k,
                processes,
                base_url,
                model,
                secret,
                workload.model_dump(),
                payload,
                continuous_usage,
                sets[k],
                realtime,
                shared,
            ),
            name=f"k3pipe-client-{k}",
            daemon=True,
        )
        for k in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        return await _coordinate(procs, shared, workload, total, on_progress, on_measured_start, abort)
    finally:
        shared.stop.set()
        for proc in procs:
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
                proc.join()


async def _coordinate(
    procs: Sequence[BaseProcess],
    shared: _Shared,
    workload: WorkloadSpec,
    total: int,
    on_progress: Callable[[int, int], None] | None,
    on_measured_start: Callable[[], Awaitable[object]] | None,
    abort: Abort,
) -> WorkloadResult:
    done = 0
    results: dict[int, dict[str, Any] | str] = {}
    started = False

    def drain() -> None:
        nonlocal done
        with contextlib.suppress(queue.Empty):
            while True:
                shared.progress.get_nowait()
                done += 1
                if on_progress is not None:
                    on_progress(done, total)
        with contextlib.suppress(queue.Empty):
            while True:
                k, result = shared.results.get_nowait()
                results[k] = result

    while len(results) < len(procs):
        drain()
        if abort.is_set() and not shared.stop.is_set():
            shared.reason.value = (abort.reason or "aborted").encode()[: _REASON_BYTES - 1]
            shared.stop.set()
        lost = [k for k, p in enumerate(procs) if not p.is_alive() and k not in results]
        if lost:
            drain()
            lost = [k for k in lost if k not in results]
            if lost:
                why = f"client process {lost[0]} exited with status {procs[lost[0]].exitcode}"
                abort.set(why)
                shared.reason.value = why.encode()[: _REASON_BYTES - 1]
                shared.stop.set()
                results.update({k: why for k in lost})
                break
        if not started and shared.arrived.value == len(procs) and not shared.stop.is_set():
            if on_measured_start is not None:
                await on_measured_start()  # warm-up over, every process waiting: nothing in flight
            shared.begin.value = time.perf_counter() + _LEAD_S
            shared.go.set()
            started = True
        await asyncio.sleep(_POLL_S)
    drain()
    return _merge(workload, results, abort)


def _merge(workload: WorkloadSpec, results: dict[int, dict[str, Any] | str], abort: Abort) -> WorkloadResult:
    """The processes' results as one: records by index, the measured window over all of them."""
    parts = [WorkloadResult.model_validate(r) for r in results.values() if isinstance(r, dict)]
    errors = [r for r in results.values() if isinstance(r, str)]
    if not parts:
        raise BenchmarkError(f"workload {workload.name!r}: every client process failed: {errors[0]}")
    if errors and not abort.is_set():
        abort.set(errors[0])
    records: list[RequestRecord] = sorted((r for p in parts for r in p.records), key=lambda r: r.index)
    measured = [r for r in records if not r.warmup]
    reason = abort.reason or next((p.aborted for p in parts if p.aborted), None)
    warmup = next((p.warmup for p in parts if p.warmup is not None), None)  # process 0's
    if not measured:
        first = min(parts, key=lambda p: p.t_start)
        load = sorted((c for p in parts for c in p.client_load), key=lambda c: c.process)
        update = {"records": records, "aborted": reason, "client_load": load, "warmup": warmup}
        return first.model_copy(update=update)
    earliest = min((p for p in parts if any(not r.warmup for r in p.records)), key=lambda p: p.t_start)
    stopped = len(measured) < workload.num_requests and reason is None
    report_end(workload, measured, stopped)
    return WorkloadResult(
        workload=workload.name,
        records=records,
        client_load=sorted((c for p in parts for c in p.client_load), key=lambda c: c.process),
        t_start=min(r.t_send for r in measured),
        t_end=max(r.t_end for r in measured),
        started_at_unix_s=earliest.started_at_unix_s,
        requests_planned=workload.num_requests,
        stopped_by_duration=stopped,
        aborted=reason,
        warmup=warmup,
        opening_wave=workload.concurrency if workload.load == "concurrency" else None,
    )
