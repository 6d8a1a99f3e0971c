"""Entry point: ``python -m actor --rank N [--index I] --config PATH [dotted.key=value ...]``.

Parses arguments and the config (every config error reported at once, exit 2), names the process,
and only then imports the heavy modules (transformers, torch via the encoder) so that ``--help``
and config errors answer in well under a second. Exit codes: 0 done or stopped, 2 bad config or
arguments, or a rollout server that resizes images otherwise (``data.min_pixels`` / ``data.max_pixels``),
3 no learner within ``actor.learner_wait_timeout_s``, 1 anything unexpected.
"""

from __future__ import annotations

import sys

from common.runs import cli


def main(argv: list[str] | None = None) -> int:
    ap = cli.config_parser("python -m actor", "Channel-B actor feeding one learner rank.")
    ap.add_argument("--rank", type=int, required=True, help="learner rank this actor feeds")
    ap.add_argument("--index", type=int, default=0, help="actor index within the rank (0..actor.num_actors_per_rank-1)")
    args = ap.parse_args(argv)
    if (cfg := cli.load(args.config, args.overrides)) is None:
        return cli.EXIT_USAGE
    world = cfg.derived.world_size
    if not 0 <= args.rank < world or not 0 <= args.index < cfg.actor.num_actors_per_rank:
        print(f"--rank {args.rank} --index {args.index}: outside {world} learner ranks × "
              f"{cfg.actor.num_actors_per_rank} actors per rank (learner.nnodes × learner.nproc_per_node, actor.num_actors_per_rank)",
              file=sys.stderr)
        return cli.EXIT_USAGE
    cli.setup_process(f"actor-r{args.rank}-{args.index}")  # the name carries the rank: no separate r<rank>

    from actor.loop import ActorLoop  # deferred: pulls in transformers and torch

    loop = ActorLoop(cfg, args.rank, args.index, config_path=args.config)
    code = loop.run()
    if loop.abandoned_inflight:
        # The learner is done and rollouts were still in flight: their HTTP calls run on pool threads, which the
        # interpreter joins at exit, so the process would live on until the server answered (a fenced or
        # re-run batch: seconds) and be SIGTERMed by the launcher meanwhile (exit -15). Metrics, ledger and
        # sockets are closed by run(); nothing else is pending.
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
