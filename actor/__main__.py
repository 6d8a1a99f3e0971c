"""Entry point: ``python -m actor --rank N [--index I] --config PATH [dotted.key=value ...]``.

Parses arguments and the config (every config error reported at once, exit 2), names the process,
and only then imports the heavy modules (transformers, torch via the encoder) so that ``--help``
and config errors answer in well under a second. Exit codes: 0 done or stopped, 2 bad config or
arguments, 3 no learner within ``actor.learner_wait_timeout_s``, 1 anything unexpected.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actor", description="Channel-B actor feeding one learner rank.")
    parser.add_argument("--rank", type=int, required=True, help="learner rank this actor feeds")
    parser.add_argument("--index", type=int, default=0, help="actor index within the rank (0..actor.num_actors_per_rank-1)")
    parser.add_argument("--config", required=True, help="the run's YAML (configs/...)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.max_samples=8")
    args = parser.parse_args(argv)

    from common.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    world = cfg.derived.world_size
    if not 0 <= args.rank < world or not 0 <= args.index < cfg.actor.num_actors_per_rank:
        print(f"--rank {args.rank} --index {args.index}: outside {world} learner ranks × "
              f"{cfg.actor.num_actors_per_rank} actors per rank (learner.nproc_per_node, actor.num_actors_per_rank)",
              file=sys.stderr)
        return 2

    name = f"actor-r{args.rank}-{args.index}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per /infer call drowns the actor's own log
    _set_process_name(f"tandem-{name}")

    from actor.loop import ActorLoop  # deferred: pulls in transformers and torch

    return ActorLoop(cfg, args.rank, args.index, config_path=args.config).run()


def _set_process_name(name: str) -> None:
    try:
        import setproctitle  # optional

        setproctitle.setproctitle(name)
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
