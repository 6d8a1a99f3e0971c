"""Learner entry point.

    torchrun --nproc_per_node=W learner/main.py --config PATH [dotted.key=value ...]
    python learner/main.py --config PATH [...]          # W = 1, no torchrun needed

Parses the arguments, loads and validates the config with the world size torchrun announced
(config errors: exit 2, every problem listed), names the process, has rank 0 write the run record
(``run_config.yaml``, ``run_info.json``: ``learner/run_record.py``), and only then imports torch and
transformers (``--help`` and config errors come back in well under a second), calls
``learner.train.run`` once, and tears the process group down in ``finally``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (torchrun learner/main.py): import from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

USAGE = __doc__.split("\n\n")[1]


def _name_process(title: str) -> None:
    """Show ``title`` in ps/top (Linux prctl; 15 characters), best effort."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _record_run(cfg: Any, world_size: int) -> None:
    """Rank 0 keeps what produced the run in its directory, before any training (learner/run_record.py)."""
    from learner.run_record import resume_step, write_run_record

    try:
        step = resume_step(cfg.training.resume, cfg.training.output_dir)
    except FileNotFoundError:
        return  # not a checkpoint: the learner's start reports it; a fresh record here would replace the run's
    write_run_record(cfg, cfg.training.output_dir, world_size=world_size, resumed_from_step=step)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    from common.config import ConfigError, load_config, split_cli

    path, overrides = split_cli(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(path, overrides, world_size=world_size)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s learner[{rank}] %(levelname)s %(name)s: %(message)s")
    _name_process(f"learner-r{rank}")
    if rank == 0:
        _record_run(cfg, world_size)

    from learner.distributed import Dist  # heavy (torch): deferred until the config is known to be good
    from learner.train import run

    dist = None
    try:
        dist = Dist(cfg.learner.backend, cfg.learner.collective_timeout_s)
        return run(cfg, dist)
    except ConfigError as err:  # rules only checkable at run time (world size, timeouts)
        print(err, file=sys.stderr)
        return 2
    finally:
        if dist is not None:
            dist.close()


if __name__ == "__main__":
    sys.exit(main())
