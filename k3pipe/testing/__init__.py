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
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FAKE_ENGINE", "SCRIPTED_ENGINE"]

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
"""The scripted vLLM/SGLang engine, run as ``python FAKE_ENGINE --flavor vllm|sglang ...``."""
SCRIPTED_ENGINE = Path(__file__).with_name("scripted_engine.py")
"""The scripted OpenAI server as an engine program (``python SCRIPTED_ENGINE ...``)."""
