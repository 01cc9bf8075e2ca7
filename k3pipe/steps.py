"""The steps of a benchmark, as plain functions: each is what one Prefect task calls.

    pull_image -> launch_engine -> wait_ready -> engine_version -> health gate
    -> benchmark_workload (each workload, each repeat) -> stop

Nothing here imports Prefect; progress goes to an optional callback.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import SecretStr
from tokenizers import Tokenizer

from k3pipe.bench import WorkloadResult, WorkloadSummary, load_tokenizer, run_workload, summarize
from k3pipe.bench.corpora import PromptSet, build_prompts
from k3pipe.bench.summary import retokenize
from k3pipe.coldstart import ensure_compile_cache
from k3pipe.engines import get_engine
from k3pipe.errors import BenchmarkError, SpecError
from k3pipe.health import wait_until_healthy
from k3pipe.launchers import DockerLauncher, ExternalLauncher, Launcher, ProcessLauncher, connect
from k3pipe.metrics import (
    Discrepancy,
    MetricsScraper,
    Scrape,
    bracketing_scrapes,
    engine_side_summary,
    reconcile,
)
from k3pipe.node import GpuMemorySample, GpuMemorySampler
from k3pipe.plan import ArmPlan
from k3pipe.settings import Settings
from k3pipe.sources.images import ImageRecord, resolve_image
from k3pipe.specs import WorkloadSpec

__all__ = [
    "WorkloadOutcome",
    "benchmark_workload",
    "engine_version",
    "launch_engine",
    "prepare_prompts",
    "pull_image",
    "wait_ready",
]

Progress = Callable[[str], None]
T = TypeVar("T")


def launch_engine(
    plan: ArmPlan,
    log_path: Path,
    settings: Settings,
    api_key: SecretStr | None,
    image: ImageRecord | None = None,
    labels: Mapping[str, str] | None = None,
) -> Launcher:
    """Start the engine of ``plan`` (returns once started; see :func:`wait_ready`).

    docker: the container is created from ``image.pinned`` (the digest), labelled with ``labels``.
    """
    launcher: Launcher
    env = plan.engine_env()  # the spec's env + the compile cache's variable
    ensure_compile_cache(plan)
    key_var = get_engine(plan.engine).api_key_env_var
    if api_key is not None and key_var:
        env[key_var] = api_key.get_secret_value()
    if plan.launcher == "external":
        launcher = ExternalLauncher()
    elif plan.launcher == "process":
        launcher = ProcessLauncher(
            plan.command.argv, {**settings.process_env(), **env}, log_path, stop_timeout_s=plan.stop_timeout_s
        )
    elif plan.launcher == "docker":
        if image is None:
            raise SpecError(f"arm {plan.arm!r}: the docker launcher needs the resolved image (pull step)")
        spec = plan.launch
        launcher = DockerLauncher(
            connect(),
            image.pinned,
            plan.command.argv,
            env,
            log_path,
            labels={
                "k3pipe.experiment": plan.experiment,
                "k3pipe.arm": plan.arm,
                "k3pipe.engine": plan.engine,
                **(labels or {}),
            },
            mounts=plan.mounts,
            writable_mounts=plan.writable_mounts,
            gpus=spec.gpus,
            ipc=spec.ipc,
            shm_size=spec.shm_size,
            network=spec.network,
            init=spec.init,
            stop_timeout_s=plan.stop_timeout_s,
        )
    else:
        raise SpecError(f"arm {plan.arm!r}: unknown launcher.kind {plan.launcher!r}")
    launcher.start()
    return launcher


def pull_image(plan: ArmPlan, progress: Progress | None = None) -> ImageRecord:
    """Pull the arm's image (per launcher.pull) and pin it to its registry digest."""
    if not plan.image:
        raise SpecError(f"arm {plan.arm!r}: the docker launcher needs engine.image")
    return resolve_image(connect(), plan.image, plan.launch.pull, progress=progress)


def wait_ready(plan: ArmPlan, launcher: Launcher, progress: Progress | None = None) -> float:
    """Wait until the engine answers its health URL; returns the seconds waited (0 for external)."""
    if plan.health_url is None:
        return 0.0

    def waiting(elapsed: float) -> None:
        if progress:
            progress(f"waiting for {plan.engine} at {plan.health_url}: {elapsed:.0f} s")

    return wait_until_healthy(plan.health_url, launcher, plan.startup_timeout_s, on_wait=waiting)


def engine_version(plan: ArmPlan) -> str | None:
    """The version the running engine reports, if it has a version endpoint."""
    if not plan.version_url:
        return plan.engine_version
    try:
        resp = httpx.get(plan.version_url, timeout=10.0, trust_env=False)
        if resp.status_code == 200:
            return get_engine(plan.engine).version_from(resp.json()) or plan.engine_version
    except (httpx.HTTPError, ValueError):
        pass
    return plan.engine_version


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

    def metrics(self) -> dict[str, float]:
        """The client summary's metrics and the engine-side ones, flat."""
        return {**self.summary.metrics(), **self.engine_metrics}


def workload_prompts(
    workload: WorkloadSpec, tokenizer: Tokenizer, repeat: int, home: Path, progress: Progress | None = None
) -> PromptSet:
    """The prompts of repeat ``repeat`` of a workload (warm-up ones first), from its dataset.

    Raises:
        BenchmarkError: the dataset cannot give them; the message names the workload.
    """
    if not 0 <= repeat < workload.repeats:
        raise SpecError(
            f"workload {workload.name!r}: repeat {repeat} is outside 0..{workload.repeats - 1} (repeats)"
        )
    t0 = time.perf_counter()
    try:
        prompts = build_prompts(
            workload.dataset,
            tokenizer,
            workload.warmup_requests + workload.num_requests,
            workload.input_tokens,
            workload.seed,
            home,
            repeat=repeat,
        )
    except BenchmarkError as exc:
        where = f" (repeat {repeat + 1} of {workload.repeats})" if workload.repeats > 1 else ""
        raise BenchmarkError(f"workload {workload.name!r}{where}: {exc}") from exc
    if progress:
        progress(
            f"{workload.name}: {len(prompts.prompts)} prompts from {prompts.name} "
            f"(digest {prompts.digest}) in {time.perf_counter() - t0:.2f} s"
        )
    return prompts


def prepare_prompts(
    workloads: Sequence[WorkloadSpec], model_dir: Path, home: Path, progress: Progress | None = None
) -> dict[str, list[PromptSet]]:
    """Every workload's prompts, one set per repeat, before any engine starts: a dataset that cannot
    give them fails here, not after a cold start, and every arm gets the same prompts."""
    tokenizer = load_tokenizer(model_dir)
    return {
        w.name: [workload_prompts(w, tokenizer, k, home, progress) for k in range(w.repeats)]
        for w in workloads
    }


def benchmark_workload(
    plan: ArmPlan,
    workload: WorkloadSpec,
    model_dir: Path,
    api_key: SecretStr | None,
    progress: Progress | None = None,
    repeat: int = 0,
    home: Path | None = None,
    prompts: PromptSet | None = None,
) -> WorkloadOutcome:
    """Run repeat ``repeat`` of a workload (seed ``workload.seed + repeat``) with ``prompts`` (built here
    from its dataset with the model's tokenizer when not given), scraping the engine's /metrics beside
    it (when the engine is ours) to reconcile client and server figures. ``home`` resolves '{home}'
    in dataset paths."""
    seed = workload.seed + repeat
    run_spec = workload.model_copy(update={"seed": seed})
    tokenizer = load_tokenizer(model_dir)
    prompt_set = prompts or workload_prompts(workload, tokenizer, repeat, home or Path.cwd(), progress)
    step = max(1, workload.num_requests // 4)
    label = (
        workload.name if workload.repeats == 1 else f"{workload.name} repeat {repeat + 1}/{workload.repeats}"
    )

    def on_progress(done: int, total: int) -> None:
        if progress and (done % step == 0 or done == total):
            progress(f"{label}: {done}/{total} requests done")

    engine = get_engine(plan.engine)
    scraper = MetricsScraper(engine)

    async def go() -> WorkloadResult:
        # the workload sends through its own transport (run_workload(None, ...)); the scraper has
        # an httpx client of its own
        async with httpx.AsyncClient(trust_env=False) as metrics_client:
            stop = asyncio.Event()
            task = None
            url = plan.metrics_url
            if url:
                task = asyncio.create_task(
                    scraper.run(metrics_client, url, workload.metrics_interval_s, stop)
                )

            async def window_start() -> None:
                # warm-up has ended and nothing is in flight: this scrape opens the engine window
                if url:
                    await scraper.scrape_once(metrics_client, url)

            try:
                return await run_workload(
                    None,
                    plan.base_url,
                    plan.model,
                    api_key,
                    run_spec,
                    prompt_set.prompts,
                    on_progress=on_progress,
                    continuous_usage=plan.continuous_usage,
                    on_measured_start=window_start,
                )
            finally:
                stop.set()
                if task is not None:
                    await task

    # the node's GPUs only matter when the engine is ours (not for an external endpoint)
    with GpuMemorySampler(workload.metrics_interval_s, enabled=plan.launcher != "external") as gpu:
        result = _run_interruptibly(go)
    result = retokenize(result, lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids))
    summary = summarize(result, workload.slo)
    window = bracketing_scrapes(scraper.scrapes, result.t_start, result.t_end)
    engine_metrics = engine_side_summary(window, engine) if len(window) >= 2 else {}
    discrepancies = reconcile(summary.metrics(), engine_metrics) if engine_metrics else []
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
    )


def _run_interruptibly(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run`` that honours SIGINT and SIGTERM promptly.

    A Python signal handler that raises (KeyboardInterrupt, Prefect's TerminationSignal) can fire
    inside the event loop's own socket code, where asyncio logs and swallows it, and the benchmark
    would run on. Here the loop catches the signal, cancels the workload, and once the loop is closed
    re-delivers the signal to the handler that was installed before, outside the loop.
    """
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(make())
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signals = [sig for sig, handler in previous.items() if handler is not signal.SIG_IGN]
    received: list[signal.Signals] = []

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_signal(sig: signal.Signals) -> None:
            received.append(sig)
            task.cancel()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await make()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if not received:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # Interrupted: hand the signal to the handler that was installed before (Prefect's raises
    # TerminationSignal, Python's SIGINT handler KeyboardInterrupt). With no Python-level handler the
    # default action would end the process at once, skipping teardown: raise KeyboardInterrupt.
    if callable(previous[received[0]]):
        signal.raise_signal(received[0])
    raise KeyboardInterrupt(f"interrupted by signal {signal.Signals(received[0]).name}")
