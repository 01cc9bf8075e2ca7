"""The engine watched while a workload runs: a dead or frozen engine ends the workload in seconds.

Without it, a workload against an engine that died waited out every request's timeout (124 s for a
frozen endpoint, measured), and one that died between requests sent the rest into refused
connections. :class:`EngineWatch` runs beside the workload in its event loop: every ``interval_s``
it asks the launcher whether the engine still runs, and a URL of the engine whether it answers
(:func:`k3pipe.bench.session.watch_target`: vLLM's health URL; SGLang's /v1/models, since its /health
queues a generation behind the scheduler's work and a long prefill step left it unanswered for 8 s on
a live engine, docs/gpu.md "The study in miniature on one H100"; an external endpoint's ``/models``).
The engine is lost when the launcher says it has exited, or when it has not answered for
``frozen_after_s`` (4 s; at least two probes in a row failed, each given 2 s); the watch then sets the
workload's :class:`~k3pipe.bench.client.Abort` with the reason, and the workload ends with what it has
measured.
What it tells is an engine whose process or HTTP server is gone or frozen; a scheduler stuck behind a
live HTTP server shows as requests that wait out their timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
from pydantic import SecretStr

from k3pipe.bench.client import Abort
from k3pipe.core.http import tls

__all__ = ["EngineWatch", "Liveness"]


class Liveness(Protocol):
    """What the watch asks the launcher (a :class:`k3pipe.launchers.Launcher` is one)."""

    def alive(self) -> bool: ...
    def exit_code(self) -> int | None: ...


@dataclass
class EngineWatch:
    """Polls an engine during a workload (see the module's docstring)."""

    url: str
    """What is probed (:func:`k3pipe.bench.session.watch_target`)."""
    launcher: Liveness | None = None
    api_key: SecretStr | None = None
    interval_s: float = 0.5
    """Between two probes that were answered (after one that was not, the next goes at once)."""
    probe_timeout_s: float = 2.0
    frozen_after_s: float = 4.0
    """Lost when nothing answered for this long and at least two probes in a row failed: a freeze is
    noticed 4-4.5 s after it (benchmarks/faults.py measures it), while an engine must leave two
    probes in a row unanswered for 2 s each to be called frozen (none did in the timing tests, nor a
    vLLM-CPU on two busy cores)."""
    lost: str | None = None
    """Why the engine was declared lost (None: it was not)."""
    probes: int = 0

    async def run(self, abort: Abort, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set or the workload is aborted; sets ``abort`` when the engine is lost."""
        headers = self._headers()
        last_ok = time.monotonic()
        failures = refused = 0
        last_error = ""
        client = httpx.AsyncClient(
            timeout=self.probe_timeout_s, trust_env=False, verify=tls(False), headers=headers
        )
        async with client:
            while not stop.is_set() and not abort.is_set():
                if self.launcher is not None and not self.launcher.alive():
                    code = self.launcher.exit_code()
                    how = f" with code {code}" if code is not None else ""
                    self._lose(abort, f"the engine exited{how} during the workload")
                    return
                self.probes += 1
                ok, last_error = await self._probe(client)
                now = time.monotonic()
                if ok:
                    last_ok, failures, refused = now, 0, 0
                else:
                    failures += 1
                    refused = refused + 1 if last_error == "ConnectError" else 0
                    if refused >= 2:  # nothing listens any more: it is down, not busy
                        self._lose(abort, f"{self._what} at {self.url} refuses connections (it is down)")
                        return
                    if failures >= 2 and now - last_ok >= self.frozen_after_s:
                        self._lose(
                            abort,
                            f"{self._what} stopped answering {self.url} for {now - last_ok:.0f} s "
                            f"(last: {last_error})",
                        )
                        return
                    if last_error.endswith("Timeout"):
                        continue  # it took the whole timeout: ask again at once, not an interval later
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

    @property
    def _what(self) -> str:
        return "the engine" if self.launcher is not None else "the endpoint"

    async def _probe(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        """(answered, what happened): any answer below 500 counts (a 401 is an answer)."""
        try:
            resp = await client.get(self.url)
        except httpx.HTTPError as exc:
            return False, type(exc).__name__
        return resp.status_code < 500, f"HTTP {resp.status_code}"

    def check_now(self) -> None:
        """After the workload: an engine that died, or an endpoint that refuses connections, between
        two polls (its last requests then failed at once) is lost too."""
        if self.lost is not None:
            return
        if self.launcher is not None:
            if not self.launcher.alive():
                self.lost = f"the engine exited with code {self.launcher.exit_code()} during the workload"
            return
        try:
            httpx.get(
                self.url,
                timeout=self.probe_timeout_s,
                trust_env=False,
                verify=tls(False),
                headers=self._headers(),
            )
        except httpx.ConnectError:
            self.lost = f"the endpoint at {self.url} refuses connections (it went down during the workload)"
        except httpx.HTTPError:
            pass

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"} if self.api_key else {}

    def _lose(self, abort: Abort, reason: str) -> None:
        self.lost = reason
        abort.set(reason)
