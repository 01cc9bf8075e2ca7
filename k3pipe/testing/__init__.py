"""Fakes that speak the real wire formats, for tests and benchmarks (the library never imports them).

Where nothing real can run here (GPU engines, the ModelScope hub, GPUStack) or where exact timing is
what is tested, a scripted stand-in speaks the real protocol, each module citing the real project's
source it follows:

- :mod:`~k3pipe.testing.openai_wire`: the OpenAI-compatible wire format (chat and completions, SSE
  chunks, usage) the scripted servers share; standard library only.
- :mod:`~k3pipe.testing.fake_engine` (:data:`FAKE_ENGINE`): a scripted vLLM or SGLang server as a
  program (its flags, logs, /metrics, health), standard library only: it also runs alone in the test
  image (tests/docker/Dockerfile copies it and openai_wire.py side by side).
- :mod:`~k3pipe.testing.scripted_openai`: an in-process OpenAI-compatible server whose answers and
  timing a test scripts; :mod:`~k3pipe.testing.scripted_tools`: its tool calls and reasoning, good and
  broken as the real engines spell them; :mod:`~k3pipe.testing.scripted_engine`
  (:data:`SCRIPTED_ENGINE`): that server as an engine program for the process launcher.
- :mod:`~k3pipe.testing.fakehub`: a ModelScope hub on loopback; :mod:`~k3pipe.testing.gpustack_standin`:
  GPUStack's API and worker.

:func:`restartable_port` gives a server that stops and starts again a port nobody else is handed.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

__all__ = ["FAKE_ENGINE", "SCRIPTED_ENGINE", "restartable_port"]

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
"""The scripted vLLM/SGLang engine, run as ``python FAKE_ENGINE --flavor vllm|sglang ...``."""
SCRIPTED_ENGINE = Path(__file__).with_name("scripted_engine.py")
"""The scripted OpenAI server as an engine program (``python SCRIPTED_ENGINE ...``)."""


def restartable_port(host: str = "127.0.0.1") -> int:
    """A free port on ``host`` below the kernel's ephemeral range (``ip_local_port_range``), for a server
    that is stopped and started again on the same port (MLflow down, then back). A port from
    ``bind(0)`` is an ephemeral one: while the server is down, a client's outgoing connection or
    another test's ``bind(0)`` may be handed it, and the restart fails with "address already in use"
    (a CI-like run, 2026-12-07). Ports below that range are handed to nobody who did not ask by number.
    """
    low = 32768  # Linux's default, where /proc does not say
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    floor = 10_000 if low > 12_000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(floor, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} between {floor} and {low}")
