"""``python -m rollout_server --config PATH [dotted.key=value ...]`` (also ``make launch-rollout``).

Validates the config, names the process, then hands over to ``rollout_server.serve`` (binds the
socket, loads the engine while /health answers ``loading``, serves with uvicorn, shuts down
gracefully on SIGTERM/SIGINT).

Exit codes: 0 clean shutdown, 1 unexpected error, 2 config error, 3 engine failed to start,
4 cannot bind the address.
"""

from __future__ import annotations

import sys

from common.runs import cli

DESCRIPTION = "Serve the policy under rollout_server.* of the config (engine hf|vllm, host, port, auth_token)."
EPILOG = """e.g. python -m rollout_server --config configs/demo_cpu.yaml rollout_server.port=8310
Exit codes: 0 clean, 1 unexpected, 2 config error, 3 engine failed to start, 4 cannot bind."""


def main(argv: list[str] | None = None) -> int:
    args = cli.config_parser("python -m rollout_server", DESCRIPTION, epilog=EPILOG).parse_args(argv)
    if (cfg := cli.load(args.config, args.overrides)) is None:
        return cli.EXIT_USAGE
    cli.setup_process("rollout_server", level=cfg.rollout_server.log_level)

    from rollout_server.engines import check_model_dir, served_model_path  # deferred: the engine registry

    if cfg.rollout_server.engine == "hf" and (problem := check_model_dir(served_model_path(cfg))):
        print(problem, file=sys.stderr)
        return cli.EXIT_USAGE
    from rollout_server.serve import serve  # deferred: uvicorn, fastapi, the engine

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
