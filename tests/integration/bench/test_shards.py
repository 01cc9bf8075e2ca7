"""A workload sent by several client processes (k3pipe/bench/shards.py) against the scripted server
(k3pipe/testing/scripted_openai.py, in this process: its perf_counter stamps and the client processes' are on
the one system-wide monotonic clock): the load keeps its meaning, the records merge in order, an abort
stops every process. The definitions themselves run at 1 and 2 processes in test_definitions.py."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from k3pipe.bench import Prompt, WorkloadResult
from k3pipe.bench.client import Abort, schedule_offsets
from k3pipe.bench.shards import run_sharded, slot_shares
from k3pipe.core.errors import BenchmarkError
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI

pytestmark = pytest.mark.serial


def _spec(**fields: object) -> WorkloadSpec:
    base: dict[str, object] = {"name": "w", "input_tokens": 3, "output_tokens": 5, "num_requests": 12}
    return WorkloadSpec.model_validate({**base, **fields})


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(text=f"prompt {i}", tokens=2) for i in range(n)]


def _run(
    server: ScriptedOpenAI, spec: WorkloadSpec, processes: int, abort: Abort | None = None
) -> WorkloadResult:
    prompts = _prompts(spec.warmup_requests + spec.num_requests)
    return asyncio.run(run_sharded(server.base_url, "scripted", None, spec, prompts, processes, abort=abort))


def test_slot_shares_add_up() -> None:
    assert slot_shares(10, 3) == [4, 3, 3]
    assert slot_shares(2, 4) == [1, 1, 0, 0]
    assert all(sum(slot_shares(c, n)) == c for c in range(1, 40) for n in range(1, 9))


def test_records_of_three_processes_equal_one_process(server: ScriptedOpenAI) -> None:
    """The same workload at 1 and 3 processes: the same requests (index, warm-up flag, tokens), in
    index order, and exactly `concurrency` in flight at most."""
    server.script = Script(first_token_delay_s=0.02, inter_token_s=0.01)
    spec = _spec(concurrency=4, warmup_requests=2)
    one = _run(server, spec, 1)
    one_peak = server.max_in_flight
    server.max_in_flight = 0
    three = _run(server, spec, 3)
    shape = [(r.index, r.warmup, r.usage_output_tokens, r.ok, r.chunk_tokens) for r in one.records]
    assert [(r.index, r.warmup, r.usage_output_tokens, r.ok, r.chunk_tokens) for r in three.records] == shape
    assert [r.index for r in three.records] == list(range(14))
    assert one_peak == server.max_in_flight == 4
    assert three.requests_planned == 12
    assert three.aborted is None
    assert not three.stopped_by_duration
    assert three.t_start == min(r.t_send for r in three.records if not r.warmup)
    # the warm-up ended before the first measured send, in every process
    assert max(r.t_end for r in three.records if r.warmup) <= three.t_start


def test_a_poisson_schedule_keeps_its_times_across_processes(server: ScriptedOpenAI) -> None:
    """Request i is due at start + offset_i whichever process sends it; every send is on time."""
    server.script = Script(inter_token_s=0.005)
    spec = _spec(load="poisson", rate_rps=40, concurrency=8, num_requests=20, seed=7)
    result = _run(server, spec, 2)
    measured = [r for r in result.records if not r.warmup]
    assert [r.index for r in measured] == list(range(20))
    due = np.array([r.t_scheduled for r in measured])
    assert np.allclose(due - due[0], schedule_offsets(spec), atol=1e-9)
    lag = np.array([r.t_send - r.t_scheduled for r in measured])
    assert lag.min() >= 0
    assert lag.max() < 0.05  # a 2-core machine running both processes and the server


def test_an_abort_of_the_parent_stops_every_process_keeping_the_records(server: ScriptedOpenAI) -> None:
    server.script = Script(inter_token_s=0.05)
    spec = _spec(concurrency=4, num_requests=40, output_tokens=20)
    abort = Abort()

    aborted_at: list[float] = []

    def on_progress(done: int, total: int) -> None:
        if done >= 6 and not abort.is_set():
            aborted_at.append(time.monotonic())
            abort.set("the engine died")

    async def go() -> WorkloadResult:
        prompts = _prompts(40)
        return await run_sharded(
            server.base_url, "scripted", None, spec, prompts, 2, on_progress, abort=abort
        )

    result = asyncio.run(go())
    assert time.monotonic() - aborted_at[0] < 3  # every process stopped and joined at once
    assert result.aborted == "the engine died"
    done = [r for r in result.records if r.ok]
    assert len(done) >= 6  # what completed before the abort is kept
    assert len(result.records) < 40
    assert any("aborted" in (r.error or "") for r in result.records)  # those in flight, as failed
    assert threading.active_count() < 50


def test_too_few_prompts_and_bad_process_counts_are_refused(server: ScriptedOpenAI) -> None:
    spec = _spec()
    with pytest.raises(BenchmarkError, match="needs 12 prompts"):
        asyncio.run(run_sharded(server.base_url, "m", None, spec, _prompts(3), 2))
    with pytest.raises(BenchmarkError, match="at least 1"):
        asyncio.run(run_sharded(server.base_url, "m", None, spec, _prompts(12), 0))
