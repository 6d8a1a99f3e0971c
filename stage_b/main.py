"""Stage-B entry point.

    torchrun --nproc_per_node=2 stage_b/main.py --config configs/stage_b/demo_cpu.yaml [key=value ...]
    python stage_b/main.py --config configs/stage_b/demo_cpu.yaml [key=value ...]      # one process

Parses the config (every problem reported at once, exit 2), then imports torch and the runner
(deferred so ``--help`` and config errors come back instantly) and calls ``run_all``. Exit 0 on
success, 1 when any rank failed: every rank exits non-zero, so torchrun reports the failure.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun stage_b/main.py): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    from common.config import ConfigError, split_cli
    from stage_b.config import load_stage_b_config

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s stage-b[rank {rank}] %(levelname)s %(name)s: %(message)s")
    path, overrides = split_cli(argv)
    try:
        cfg = load_stage_b_config(path, overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2

    from stage_b.runner import run_all  # deferred: torch + transformers

    try:
        summary = run_all(cfg)
    except Exception:
        logging.getLogger("stage_b").exception("stage-b rank %s failed", rank)
        return 1
    if summary.run_dir:
        logging.getLogger("stage_b").info("artifacts in %s (guidance step %s)", summary.run_dir, summary.final_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
