"""The measured session of one workload repeat: the client's requests with the engine's /metrics
scraped beside them, the GPU memory sampled, and the two views reconciled; interruptible by SIGINT
and SIGTERM at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import SecretStr

from k3pipe.bench.client import Abort, WorkloadResult, replay_trace
from k3pipe.bench.replay import ReplayOutcome, ReplayRecord, fidelity, replay_plan
from k3pipe.bench.shards import client_layout, run_sharded
from k3pipe.bench.summary import WorkloadSummary, retokenize, summarize
from k3pipe.bench.watch import EngineWatch, Liveness
from k3pipe.core.http import tls
from k3pipe.engines import get_engine
from k3pipe.machine.metrics import (
    Discrepancy,
    MetricsScraper,
    Scrape,
    bracketing_scrapes,
    engine_side_summary,
    reconcile,
)
from k3pipe.machine.node import GpuMemorySample, GpuMemorySampler
from k3pipe.planning.plan import ArmPlan
from k3pipe.prompts.corpora import PromptSet
from k3pipe.prompts.datasets import load_tokenizer
from k3pipe.prompts.draw import workload_prompts
from k3pipe.schema.specs import WorkloadSpec

__all__ = ["WorkloadOutcome", "benchmark_workload", "deliver", "watch_target"]

Progress = Callable[[str], None]
T = TypeVar("T")


@dataclass(frozen=True)
class WorkloadOutcome:
    """One run of a workload (one repeat): the prompts used, the client's records and summary, and
    the engine's own view of the measured window."""

    result: WorkloadResult
    summary: WorkloadSummary
    scrapes: list[Scrape] = field(default_factory=list)
    engine_metrics: dict[str, float] = field(default_factory=dict)
    discrepancies: list[Discrepancy] = field(default_factory=list)
    prompts: PromptSet | None = None
    repeat: int = 0
    seed: int = 0
    gpu_memory: list[GpuMemorySample] = field(default_factory=list)
    """GPU memory in use, sampled every metrics_interval_s during the run (none without nvidia-smi)."""
    engine_lost: str | None = None
    """Why the watch ended the workload early (the engine died or froze); None if it did not."""
    interrupted: int | None = None
    """The signal (SIGINT, SIGTERM) that ended the workload early: the caller records what was
    measured, then lets the signal go on (:func:`deliver`)."""
    replay: dict[str, float] = field(default_factory=dict)
    """A trace replay's fidelity (:func:`k3pipe.bench.replay.fidelity`); empty for other workloads."""
    replay_records: tuple[ReplayRecord, ...] = ()
    """A trace replay's requests: planned, ready, sent and ended times, or why one was skipped."""

    def metrics(self) -> dict[str, float]:
        """The client summary's metrics, the engine-side ones and a replay's fidelity, flat."""
        return {**self.summary.metrics(), **self.engine_metrics, **self.replay}


def watch_target(plan: ArmPlan, api_key: SecretStr | None) -> tuple[str, SecretStr | None]:
    """What the engine watch probes, and with which key: the engine's watch URL (one its HTTP server
    answers while the model is busy: SGLang's /v1/models, since its /health waits for a generation)
    with the key; else its health URL without one (vLLM's /health answers at once unless the engine
    core died); an external endpoint's /models with the key."""
    if plan.watch_url is not None:
        return plan.watch_url, api_key
    if plan.health_url is not None:
        return plan.health_url, None
    return f"{plan.base_url}/models", api_key


def benchmark_workload(
    plan: ArmPlan,
    workload: WorkloadSpec,
    model_dir: Path,
    api_key: SecretStr | None,
    progress: Progress | None = None,
    repeat: int = 0,
    home: Path | None = None,
    prompts: PromptSet | None = None,
    launcher: Liveness | None = None,
) -> WorkloadOutcome:
    """Run repeat ``repeat`` of a workload (seed ``workload.seed + repeat``) with ``prompts`` (built here
    from its dataset with the model's tokenizer when not given), scraping the engine's /metrics beside
    it (when the engine is ours) to reconcile client and server figures. ``home`` resolves '{home}'
    in dataset paths.

    The engine is watched meanwhile (:class:`~k3pipe.bench.watch.EngineWatch`: ``launcher``'s
    liveness and the health URL): when it dies or freezes the workload ends at once, and the outcome
    holds what was measured with ``engine_lost`` saying why. A SIGINT or SIGTERM ends it the same
    way, with ``interrupted`` set: the caller records the outcome, then calls :func:`deliver`."""
    seed = workload.seed + repeat
    run_spec = workload.model_copy(update={"seed": seed})
    tokenizer = load_tokenizer(model_dir)
    prompt_set = prompts or workload_prompts(
        workload, tokenizer, repeat, home or Path.cwd(), progress, model_dir
    )
    step = max(1, workload.num_requests // 4)
    label = (
        workload.name if workload.repeats == 1 else f"{workload.name} repeat {repeat + 1}/{workload.repeats}"
    )

    def on_progress(done: int, total: int) -> None:
        if progress and (done % step == 0 or done == total):
            progress(f"{label}: {done}/{total} requests done")

    engine = get_engine(plan.engine)
    scraper = MetricsScraper(engine)
    watch_url, watch_key = watch_target(plan, api_key)
    watch = EngineWatch(watch_url, launcher, watch_key)

    processes, cpu_sets = client_layout(plan.client, workload.concurrency, plan.launch.engine_cpus())
    if progress and (processes > 1 or cpu_sets):
        where = "" if cpu_sets is None else " on CPUs " + "; ".join(",".join(map(str, c)) for c in cpu_sets)
        progress(f"{label}: {workload.concurrency} streams over {processes} client process(es){where}")

    async def go(abort: Abort) -> WorkloadResult:
        # the workload sends through its own transports (run_sharded: one per client process); the scraper has
        # an httpx client of its own
        async with httpx.AsyncClient(trust_env=False, verify=tls(False)) as metrics_client:
            stop = asyncio.Event()
            task = None
            url = plan.metrics_url
            if url:
                task = asyncio.create_task(
                    scraper.run(metrics_client, url, workload.metrics_interval_s, stop)
                )
            watching = asyncio.create_task(watch.run(abort, stop))

            async def window_start() -> None:
                # warm-up has ended and nothing is in flight: this scrape opens the engine window
                if url:
                    await scraper.scrape_once(metrics_client, url)

            try:
                if workload.trace is not None:
                    return await _replay(
                        plan, api_key, run_spec, prompt_set, on_progress, window_start, abort
                    )
                return await run_sharded(
                    plan.client_base_url,
                    plan.client_model,
                    api_key,
                    run_spec,
                    prompt_set.prompts,
                    processes,
                    on_progress,
                    continuous_usage=plan.client_continuous_usage,
                    on_measured_start=window_start,
                    abort=abort,
                    cpus=cpu_sets,
                    realtime=plan.client.realtime,
                )
            finally:
                stop.set()
                # an aborted workload ends now: a scrape or probe of a frozen engine is not waited for
                for helper in (task, watching) if abort.is_set() else (watching,):
                    if helper is not None:
                        helper.cancel()
                for helper in (task, watching):
                    if helper is not None:
                        with contextlib.suppress(asyncio.CancelledError):
                            await helper

    replayed: list[tuple[ReplayOutcome, float]] = []

    async def _replay(
        plan: ArmPlan,
        api_key: SecretStr | None,
        spec: WorkloadSpec,
        prompt_set: PromptSet,
        on_progress: Callable[[int, int], None],
        window_start: Callable[[], Awaitable[None]],
        abort: Abort,
    ) -> WorkloadResult:
        assert spec.trace is not None
        trace = spec.loaded_trace()
        await window_start()  # nothing in flight: the engine's window opens here
        started_at = time.time()
        outcome, records, origin = await replay_trace(
            plan.client_base_url, plan.client_model, api_key, spec, trace, prompt_set.prompts,
            speed=spec.trace.speed, max_idle_s=spec.trace.max_idle_s, thread=spec.trace.thread_answers,
            session_field=spec.trace.session_field, session_tag=f".r{spec.seed}",
            on_progress=on_progress, abort=abort,
        )  # fmt: skip
        replayed.append((outcome, origin))
        t_start = min((r.t_send for r in records), default=origin)
        return WorkloadResult(
            workload=spec.name,
            records=records,
            t_start=t_start,
            t_end=max((r.t_end for r in records), default=t_start),
            started_at_unix_s=started_at + (t_start - origin),
            requests_planned=len(trace.requests),
            aborted=abort.reason,
        )

    # the node's GPUs only matter when the engine is ours (not for an external endpoint)
    with GpuMemorySampler(workload.metrics_interval_s, enabled=plan.launch.runs_here) as gpu:
        result, interrupted = _run_interruptibly(go)
    if interrupted is None:
        watch.check_now()  # lost between two polls, its last requests failing at once
    result = retokenize(result, lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids))
    summary = summarize(result, workload.slo)
    window = bracketing_scrapes(scraper.scrapes, result.t_start, result.t_end)
    engine_metrics = engine_side_summary(window, engine) if len(window) >= 2 else {}
    discrepancies = reconcile(summary.metrics(), engine_metrics) if engine_metrics else []
    replay_metrics: dict[str, float] = {}
    replay_records: tuple[ReplayRecord, ...] = ()
    if replayed:
        trace = workload.loaded_trace()
        outcome, _ = replayed[0]
        assert workload.trace is not None
        usage = {r.index: r.usage_prompt_tokens for r in result.records}
        replay_metrics = fidelity(
            trace,
            replay_plan(trace, workload.trace.speed, workload.trace.max_idle_s),
            outcome,
            [usage.get(i) for i in range(len(trace.requests))],
        )
        replay_records = outcome.records
    return WorkloadOutcome(
        result,
        summary,
        list(scraper.scrapes),
        engine_metrics,
        discrepancies,
        prompts=prompt_set,
        repeat=repeat,
        seed=seed,
        gpu_memory=gpu.samples,
        engine_lost=watch.lost,
        interrupted=interrupted,
        replay=replay_metrics,
        replay_records=replay_records,
    )


def _run_interruptibly(make: Callable[[Abort], Coroutine[Any, Any, T]]) -> tuple[T, int | None]:
    """``asyncio.run`` of ``make(abort)`` that honours SIGINT and SIGTERM promptly, keeping what the
    workload measured: returns its result and the signal that ended it early (None: none did).

    A Python signal handler that raises (KeyboardInterrupt, Prefect's TerminationSignal) can fire
    inside the event loop's own socket code, where asyncio logs and swallows it, and the benchmark
    would run on. Here the loop catches the signal and aborts the workload (its requests in flight
    end as failed records); the caller records the result, then hands the signal on with
    :func:`deliver`, outside the loop.
    """
    abort = Abort()
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(make(abort)), None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signals = [sig for sig, handler in previous.items() if handler is not signal.SIG_IGN]
    received: list[signal.Signals] = []

    async def main() -> T:
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            received.append(sig)
            abort.set(f"interrupted by {sig.name}")

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await make(abort)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    try:
        result = asyncio.run(main())
    finally:
        if received:
            # The caller records what was measured, then deliver()s the signal. A second signal in
            # that window (a second Ctrl-C) must not cut the recording short: the handlers that would
            # raise are held back until deliver() and the signal is said to be pending.
            _HELD.update(previous)
            for sig in signals:
                signal.signal(sig, _pending)
        else:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return result, (int(received[0]) if received else None)


_HELD: dict[signal.Signals, Any] = {}
"""The handlers _run_interruptibly held back after a signal ended a workload; deliver() puts them back."""


def _pending(signum: int, frame: object) -> None:
    # a signal handler: a plain write (logging could wait on a lock the interrupted code holds)
    name = signal.Signals(signum).name
    sys.stderr.write(f"\n{name} again: still recording what was measured, then stopping\n")
    sys.stderr.flush()


def deliver(signum: int) -> None:
    """Hand a signal that ended a workload to the handler installed before it (Prefect's raises
    TerminationSignal, Python's SIGINT handler and k3pipe's CLI KeyboardInterrupt), putting back the
    handlers held while it was recorded. With no Python-level handler the default action would end the
    process at once, skipping the teardown: raise KeyboardInterrupt instead."""
    for held, handler in _HELD.items():
        signal.signal(held, handler)
    _HELD.clear()
    sig = signal.Signals(signum)
    if callable(signal.getsignal(sig)):
        signal.raise_signal(sig)
    raise KeyboardInterrupt(f"interrupted by signal {sig.name}")
