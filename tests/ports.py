"""Free loopback ports for tests that bind real sockets (one fresh set per test, never shared)."""

from __future__ import annotations

import random
import socket


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int = 2, *, low: int = 20000, high: int = 60000, tries: int = 500) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1 (e.g. a transport.base_port for n/2 ranks)."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - n)
        if all(_bindable(base + k) for k in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found in {tries} tries")
