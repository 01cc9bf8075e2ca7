"""The engine watch during a workload: what it probes per engine, and that a busy SGLang is not lost.

On the H100 (2026-12-06, docs/gpu.md "The study in miniature on one H100") SGLang 0.5.16's /health went
unanswered for 8 s while the scheduler ran the first 32K-token prefill chunk of a 64K warm-up request:
its /health queues a 1-token generation behind the scheduler's work (http_server.py:616-690), while its
HTTP server kept answering /metrics every second. The watch stopped a live engine. It now probes
SGLang's /v1/models (the HTTP process alone), vLLM's /health as before (0.22.0 answers it at once
unless the engine core died: serve/instrumentator/health.py:22, AsyncLLM.check_health)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from pydantic import SecretStr

from k3pipe.bench.client import Abort
from k3pipe.bench.session import watch_target
from k3pipe.bench.watch import EngineWatch
from k3pipe.engines import get_engine
from k3pipe.experiment.load import load_experiment
from k3pipe.planning.plan import plan_arm
from tests.conftest import REPO

KEY = SecretStr("a-watch-test-key")


def test_each_engine_is_watched_where_a_busy_engine_still_answers() -> None:
    spec = load_experiment(REPO / "experiments" / "mla-study-h100.yaml")
    vllm = plan_arm(spec, spec.arm("vllm"), Path("/h"), {"model": "/m"})
    sglang = plan_arm(spec, spec.arm("sglang"), Path("/h"), {"model": "/m"})
    assert get_engine("sglang").watch_path == "/v1/models"
    assert get_engine("vllm").watch_path is None
    # SGLang: readiness stays /health (503 until its warm-up request is done), the watch asks /v1/models
    assert sglang.health_url == "http://127.0.0.1:30011/health"
    assert watch_target(sglang, KEY) == ("http://127.0.0.1:30011/v1/models", KEY)  # needs the key
    # vLLM: /health, which needs no key
    assert vllm.watch_url is None
    assert watch_target(vllm, KEY) == ("http://127.0.0.1:8021/health", None)
    # an endpoint k3pipe did not start: its /models, with the key
    external = vllm.model_copy(update={"health_url": None, "base_url": "http://gw:9/v1"})
    assert watch_target(external, KEY) == ("http://gw:9/v1/models", KEY)


async def _busy_sglang(host: str = "127.0.0.1") -> tuple[asyncio.Server, int]:
    """An HTTP server as SGLang's was while its scheduler ran a long prefill step: /health does not
    answer (its generation waits behind the step), /v1/models answers at once."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if b" /health " in request:
            await asyncio.sleep(30)
        body = b'{"data": []}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, host, 0)
    return server, server.sockets[0].getsockname()[1]


def _watch(url: str, seconds: float) -> str | None:
    async def go() -> str | None:
        server, port = await _busy_sglang()
        watch = EngineWatch(
            url.format(port=port), None, None, interval_s=0.05, probe_timeout_s=0.2, frozen_after_s=0.5
        )
        abort, stop = Abort(), asyncio.Event()
        task = asyncio.create_task(watch.run(abort, stop))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), seconds)
        stop.set()
        await task
        server.close()
        return watch.lost

    return asyncio.run(go())


def test_a_busy_sglang_is_lost_on_health_and_alive_on_v1_models() -> None:
    """The sitting's false alarm, in small: probing /health declares the busy engine lost (the old
    watch); probing /v1/models does not."""
    lost = _watch("http://127.0.0.1:{port}/health", 2.0)
    assert lost is not None
    assert lost.startswith("the endpoint stopped answering")
    assert "ReadTimeout" in lost
    assert _watch("http://127.0.0.1:{port}/v1/models", 1.5) is None
