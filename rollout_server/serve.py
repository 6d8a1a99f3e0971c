"""The rollout server's serving lifecycle: bind the socket, build the engine and the app, run uvicorn.

The socket is bound before the engine loads, so clients see ``/health`` answer ``loading`` instead of
a refused connection; the engine then loads in the app's lifespan. SIGTERM/SIGINT shut down
gracefully: in-flight requests get ``rollout_server.shutdown_grace_s``, an open sync session is
aborted. What this module does not know: the config's CLI (``rollout_server/__main__.py``) or what
the engine does (``rollout_server/app.py``, ``rollout_server/engines``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import Any

log = logging.getLogger("rollout_server")

EXIT_OK, EXIT_CONFIG, EXIT_ENGINE, EXIT_BIND = 0, 2, 3, 4


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound before the engine loads so clients see ``loading``, not refusal."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: asyncio sets TCP_NODELAY on accepted sockets only when the listening socket says IPPROTO_TCP
    # (base_events._set_nodelay checks sock.proto); a socket made with proto 0 left Nagle on, and every
    # response waited for the client's delayed ACK: +40 ms per request (/health 44 ms -> 1 ms on loopback).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve(cfg: Any) -> int:
    """Bind ``rollout_server.host:port`` and serve until stopped: 0 stopped, 2 weight sync would be open
    beyond loopback, 3 engine failed, 4 cannot bind."""
    from common.config.server import loopback_host

    srv = cfg.rollout_server
    if not loopback_host(srv.host) and not srv.auth_token:  # the config rule already says so; never bind open
        log.error("refusing to bind %s without rollout_server.auth_token: anyone reaching the port could replace "
                  "the served weights through /sync/*. Fix: set rollout_server.auth_token (e.g. "
                  "${oc.env:TANDEM_SYNC_TOKEN}) or bind 127.0.0.1", srv.host)
        return EXIT_CONFIG
    try:
        sock = bind_socket(srv.host, srv.port)
    except OSError as exc:
        log.error("cannot bind %s:%d (%s). Fix: stop whatever holds the port or pass rollout_server.port=<free port>",
                  srv.host, srv.port, exc)
        return EXIT_BIND
    try:
        return run(cfg, sock)
    finally:
        sock.close()


def run(cfg: Any, sock: socket.socket) -> int:
    """Serve on the bound ``sock`` until SIGTERM/SIGINT (0) or an engine start failure (3)."""
    import uvicorn

    from common.data.image_size import ImageSizeError
    from rollout_server.app import build_app
    from rollout_server.engines import EngineUnavailable, make_engine

    srv = cfg.rollout_server
    try:
        engine = make_engine(cfg)
    except (EngineUnavailable, ImageSizeError) as exc:
        log.error("%s", exc)
        return EXIT_ENGINE
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        failed.append(message)
        if server is not None:
            server.should_exit = True

    app = build_app(engine, cfg, on_fatal=on_fatal)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from rollout_server.weight_sync.stream import sniffing_protocol

    # Connections that open with the bucket-stream magic carry sync buckets (rollout_server/weight_sync/stream.py).
    http = sniffing_protocol(AutoHTTPProtocol, app.state.server.sync, srv.max_bucket_mb << 20)
    server = uvicorn.Server(uvicorn.Config(app, log_level=srv.log_level.lower(), access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=srv.shutdown_grace_s, http=http))
    host, port = sock.getsockname()[:2]
    log.info("rollout server pid %d listening on http://%s:%d (engine %s, auth %s); loading %s",
             os.getpid(), host, port, srv.engine, "on" if srv.auth_token else "off", engine.model_path)
    # NOTE: uvicorn re-raises a captured SIGTERM/SIGINT once it has shut down (Kludex/uvicorn#1600), which
    # would end the process by the signal (exit -15) after a clean shutdown; these no-op handlers are
    # what it restores and re-raises into, so a requested stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if failed:
        log.error("exiting: engine failed to start: %s", failed[0])
        return EXIT_ENGINE
    return EXIT_OK
