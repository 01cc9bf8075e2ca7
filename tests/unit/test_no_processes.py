"""The unit tier starts no process (tests/unit/conftest.py refuses them): checked here on each way
one starts."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.unit.conftest import ProcessStarted


def test_a_subprocess_is_refused_by_name() -> None:
    with pytest.raises(ProcessStarted, match=r"subprocess: .*python.* -c pass"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_asyncio_subprocesses_and_shells_are_refused() -> None:
    async def spawn() -> None:
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

    with pytest.raises(ProcessStarted):
        asyncio.run(spawn())
    with pytest.raises(ProcessStarted, match=r"os\.system: true"):
        os.system("true")


def test_forks_are_refused() -> None:
    with pytest.raises(ProcessStarted, match=r"os\.fork"):
        os.fork()
    process = multiprocessing.get_context("fork").Process(target=print)
    with pytest.raises(ProcessStarted):
        process.start()
