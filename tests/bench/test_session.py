"""Library steps outside Prefect: signals stop a running benchmark loop promptly."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from k3pipe.bench.session import _run_interruptibly


def _send_soon(sig: signal.Signals, delay_s: float = 0.3) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_cancels_the_loop_and_restores_handlers(sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    cancelled = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    t0 = time.monotonic()
    if sig == signal.SIGTERM:
        # with no Python-level SIGTERM handler the step raises KeyboardInterrupt (teardown still runs)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        _send_soon(sig)
        with pytest.raises(KeyboardInterrupt):
            _run_interruptibly(work)
    finally:
        signal.signal(signal.SIGTERM, before[signal.SIGTERM])
    assert time.monotonic() - t0 < 10
    assert cancelled == [True]
    assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]


def test_custom_handler_receives_the_signal() -> None:
    seen: list[int] = []

    class Stop(BaseException):
        pass

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    try:
        _send_soon(signal.SIGTERM)
        with pytest.raises(Stop):
            _run_interruptibly(lambda: asyncio.sleep(30))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == [signal.SIGTERM]


def test_result_passes_through() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert _run_interruptibly(work) == 7
