"""Free loopback ports for tests that bind real sockets (one fresh set per test, never shared)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux default 32768..60999)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port_block(n: int = 2, *, low: int = 20000, high: int = 60000, tries: int = 500) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1 (e.g. a transport.base_port for n/2 ranks).

    Outside the kernel's ephemeral range where ``low..high`` leaves room: a port found free there can be
    taken by any process's next outgoing connection (gloo, torchrun, HTTP clients of the other test worker)
    before the test's server binds it ("Address already in use").
    """
    eph_low, eph_high = _ephemeral_range()
    if eph_low - low >= max(n, 1000):  # the room below the ephemeral range
        high = min(high, eph_low)
    elif high - eph_high >= max(n, 1000):  # or above it
        low = max(low, eph_high + 1)
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - n)
        if all(_bindable(base + k) for k in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found in {tries} tries")
