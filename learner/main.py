"""One learner rank: the config checks, then ``learner.train.run``.

    torchrun --nproc_per_node=W learner/main.py --config PATH [dotted.key=value ...]
    python learner/main.py --config PATH [...]          # W = 1, no torchrun needed

Loads the config with the world size torchrun announced (errors: exit 2, every problem listed),
names the process, has rank 0 write the run record (``learner/run_record.py``), and only then
imports torch and transformers (``--help`` and config errors answer in well under a second), calls
``learner.train.run`` once, and tears the process group down in ``finally``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (torchrun learner/main.py): import from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cli  # noqa: E402 - after the path fix above

def _record_run(cfg: Any, world_size: int) -> None:
    """Rank 0 keeps what produced the run in its directory, before any training (learner/run_record.py)."""
    from learner.run_record import resume_step, write_run_record

    try:
        step = resume_step(cfg.training.resume, cfg.training.output_dir)
    except FileNotFoundError:
        return  # not a checkpoint: the learner's start reports it; a fresh record here would replace the run's
    write_run_record(cfg, cfg.training.output_dir, world_size=world_size, resumed_from_step=step)


def main(argv: list[str] | None = None) -> int:
    args = cli.config_parser("learner/main.py", __doc__, epilog=__doc__.split("\n\n")[1]).parse_args(argv)
    rank, world_size = cli.torchrun_rank()
    if (cfg := cli.load(args.config, args.overrides, world_size=world_size)) is None:
        return cli.EXIT_USAGE
    cli.setup_process("learner", rank)
    if rank == 0:
        _record_run(cfg, world_size)

    from common.config import ConfigError
    from learner.distributed import Dist  # heavy (torch): deferred until the config is known to be good
    from learner.train import run

    dist = None
    try:
        dist = Dist(cfg.learner.backend, cfg.learner.collective_timeout_s)
        return run(cfg, dist)
    except ConfigError as err:  # rules only checkable at run time (world size, timeouts)
        print(err, file=sys.stderr)
        return cli.EXIT_USAGE
    finally:
        if dist is not None:
            dist.close()


if __name__ == "__main__":
    sys.exit(main())
