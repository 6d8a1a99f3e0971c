"""``python -m rollout_server --config PATH [dotted.key=value ...]`` (also ``make launch-rollout``).

Validates the config, binds the socket, then loads the engine in the background while /health
answers ``loading``; serves with uvicorn; SIGTERM/SIGINT shut down gracefully (in-flight requests
get ``rollout_server.shutdown_grace_s``, an open sync session is aborted).

Exit codes: 0 clean shutdown, 1 unexpected error, 2 config error, 3 engine failed to start,
4 cannot bind the address.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

log = logging.getLogger("rollout_server")

USAGE = """usage: python -m rollout_server --config PATH [key=value ...]

  e.g. python -m rollout_server --config configs/demo_cpu.yaml rollout_server.port=8310
  Serves the policy under rollout_server.* of the config (engine hf|vllm, host, port, auth_token).
  Exit codes: 0 clean, 1 unexpected, 2 config error, 3 engine failed to start, 4 cannot bind."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound before the engine loads so clients see ``loading``, not refusal."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    from common.config import ConfigError, load_config, split_cli

    path, overrides = split_cli(argv)
    if path is None:
        print(f"--config PATH is required\n{USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    srv = cfg.rollout_server
    logging.basicConfig(level=srv.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [rollout_server %(process)d] %(name)s: %(message)s")
    from rollout_server.engines import check_model_dir, served_model_path

    if srv.engine == "hf" and (problem := check_model_dir(served_model_path(cfg))):
        print(problem, file=sys.stderr)
        return 2
    try:
        sock = bind_socket(srv.host, srv.port)
    except OSError as exc:
        log.error("cannot bind %s:%d (%s). Fix: stop whatever holds the port or pass rollout_server.port=<free port>",
                  srv.host, srv.port, exc)
        return 4
    try:
        return run(cfg, sock)
    finally:
        sock.close()


def run(cfg, sock: socket.socket) -> int:
    """Serve until SIGTERM/SIGINT (0) or an engine start failure (3)."""
    import uvicorn

    from rollout_server.app import build_app
    from rollout_server.engines import EngineUnavailable, make_engine

    srv = cfg.rollout_server
    try:
        engine = make_engine(cfg)
    except EngineUnavailable as exc:
        log.error("%s", exc)
        return 3
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        failed.append(message)
        if server is not None:
            server.should_exit = True

    app = build_app(engine, cfg, on_fatal=on_fatal)
    server = uvicorn.Server(uvicorn.Config(app, log_level=srv.log_level.lower(), access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=srv.shutdown_grace_s))
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
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
