"""k3pipe.testing.restartable_port: a port for a server that stops and starts again, out of the range
the kernel hands to ``bind(0)`` and to outgoing connections (test_spool's MLflow restart once found its
ephemeral port taken by another test while it was down)."""

from __future__ import annotations

import socket
from pathlib import Path

from k3pipe.testing import restartable_port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {restartable_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn at random, not a fixed port two runs would share
    port = ports.pop()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free when handed out
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] >= low  # what bind(0) hands out lies above it
