"""Fail-fast rules of the ``rollout_server`` config section: its trust boundary and request budgets.

Called by :func:`common.config._check_rules` with the section and the problem collector (every
problem names the dotted key, the value and the fix). Split from ``common/config.py`` to keep that
file under the layout limit; the schema of the section is ``common.config_schema.RolloutServerConfig``.

What this module does not know: how the server enforces the limits (``rollout_server/guard.py``).
"""

from __future__ import annotations

import ipaddress
from typing import Any


def loopback_host(host: str) -> bool:
    """True when a server bound to ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name (or 0.0.0.0-like wildcard spelled otherwise): it may resolve to anything
        return False


def check_server_rules(srv: Any, problems: Any) -> None:
    """Weight sync locked beyond loopback; request budgets positive. ``problems.add(key, value, why, fix)``."""
    if isinstance(srv.host, str) and not loopback_host(srv.host) and not srv.auth_token:
        problems.add("rollout_server.auth_token", srv.auth_token,
                     f"rollout_server.host {srv.host!r} is reachable beyond loopback, and without a token anyone "
                     "who reaches the port can replace the served weights through /sync/*",
                     "set rollout_server.auth_token to a secret every process of the run reads (in the YAML: "
                     "auth_token: ${oc.env:TANDEM_SYNC_TOKEN}, then export TANDEM_SYNC_TOKEN=$(openssl rand -hex 16)),"
                     " or bind rollout_server.host: 127.0.0.1")
    for key in ("max_request_mb", "max_request_tokens", "max_bucket_mb", "max_batch_items"):
        value = getattr(srv, key)
        if isinstance(value, int) and value < 1:
            problems.add(f"rollout_server.{key}", value, "must be ≥ 1", f"set rollout_server.{key} to a positive limit")
    for key in ("max_request_megapixels", "max_image_megapixels"):
        mp = getattr(srv, key)
        if isinstance(mp, (int, float)) and not mp > 0:
            problems.add(f"rollout_server.{key}", mp, "must be > 0", f"set rollout_server.{key} to a positive budget")
