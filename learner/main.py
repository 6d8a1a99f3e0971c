"""One learner rank: the config checks, then ``learner.train.run``.

    torchrun --nproc_per_node=W learner/main.py --config PATH [dotted.key=value ...]
    python learner/main.py --config PATH [...]          # W = 1, no torchrun needed
    python -m launcher --config PATH launcher.node_rank=k   # node k of learner.nnodes (docs/multinode.md)

Loads the config with the world size torchrun announced (errors: exit 2, every problem listed),
names the process, has rank 0 refuse bad records (``data.on_bad_record``) or a start that would mix with
another run (``common/runs/output_dir.py``), both exit 2, and write the run record (``learner/run_record.py``),
and only then imports torch and transformers (``--help`` and config errors answer in well under a second),
calls ``learner.train.run`` once, and tears the process group down in ``finally``. Rank means the global rank
(``RANK``): on several nodes the run record is node 0's, and every node must share ``training.output_dir``
(checked once the ranks have joined, ``Dist.check_shared_dir``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun learner/main.py): import from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runs import cli  # noqa: E402 - after the path fix above


def main(argv: list[str] | None = None) -> int:
    args = cli.config_parser("learner/main.py", __doc__, epilog=__doc__.split("\n\n")[1]).parse_args(argv)
    rank, world_size = cli.torchrun_rank()
    if (cfg := cli.load(args.config, args.overrides, world_size=world_size)) is None:
        return cli.EXIT_USAGE
    cli.setup_process("learner", rank)
    if rank == 0:  # before anything is written: refuse a start that would mix with another run, keep the record
        from learner.run_record import start_run

        if (refused := start_run(cfg, world_size)) is not None:
            print(refused, file=sys.stderr)
            return cli.EXIT_USAGE

    from common.config.load import ConfigError
    from learner.distributed import Dist, SharedDirError  # heavy (torch): deferred until the config is known good
    from learner.train import run

    dist = None
    try:
        dist = Dist(cfg.learner.backend, cfg.learner.collective_timeout_s)
        if cfg.learner.nnodes > 1:
            dist.check_shared_dir(cfg.training.output_dir)
        with dist.peer_failures_named():
            return run(cfg, dist)
    except (ConfigError, SharedDirError) as err:  # rules only checkable at run time (world size, timeouts, nodes)
        print(err, file=sys.stderr)
        return cli.EXIT_USAGE
    finally:
        if dist is not None:
            dist.close()


if __name__ == "__main__":
    sys.exit(main())
