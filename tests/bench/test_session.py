"""Library steps outside Prefect: signals end a running benchmark loop promptly, keeping its result."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from k3pipe.bench.client import Abort
from k3pipe.bench.session import _run_interruptibly, deliver


def _send_soon(sig: signal.Signals, delay_s: float = 0.3) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


async def _work(abort: Abort) -> str:
    """A workload's sender: it ends as a partial result when the workload is aborted."""
    abort.track()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        return f"partial ({abort.reason})"
    return "whole"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_aborts_the_loop_keeps_the_result_and_restores_handlers(sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    _send_soon(sig)
    result, received = _run_interruptibly(_work)
    assert time.monotonic() - t0 < 10
    assert result == f"partial (interrupted by {sig.name})"
    assert received == sig
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def test_deliver_hands_the_signal_to_the_installed_handler() -> None:
    seen: list[int] = []

    class Stop(BaseException):
        pass

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    try:
        _send_soon(signal.SIGTERM)
        result, received = _run_interruptibly(_work)
        assert received == signal.SIGTERM
        assert result.startswith("partial")
        assert seen == []  # the loop caught it: nothing raised before the result was handed back
        with pytest.raises(Stop):
            deliver(received)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == [signal.SIGTERM]


def test_deliver_without_a_python_handler_raises_keyboard_interrupt() -> None:
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            deliver(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_result_passes_through() -> None:
    async def work(abort: Abort) -> int:
        await asyncio.sleep(0)
        return 7

    assert _run_interruptibly(work) == (7, None)
