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

pytestmark = pytest.mark.serial


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
    # until the result is recorded and the signal delivered, another one is only said to be pending
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} != before
    with pytest.raises(KeyboardInterrupt):  # pytest's SIGINT handler, or no Python handler (SIGTERM)
        deliver(received)
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def test_a_second_signal_while_the_result_is_recorded_waits_for_deliver(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C twice: the first ends the workload; the second, arriving while what was measured is
    being recorded, must not raise there (the workload run would end FAILED, not KILLED): it is
    said to be pending, and deliver() then hands the first one on."""
    _send_soon(signal.SIGINT)
    _, received = _run_interruptibly(_work)
    assert received == signal.SIGINT
    signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, during the recording
    time.sleep(0.05)
    assert "SIGINT again: still recording what was measured" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        deliver(received)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


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
