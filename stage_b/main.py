"""Stage-B entry point: one rank of the training-free ticket rollout.

    torchrun --nproc_per_node=2 stage_b/main.py --config configs/stage_b/demo_cpu.yaml [key=value ...]
    python stage_b/main.py --config configs/stage_b/demo_cpu.yaml [key=value ...]      # one process

Parses the config (every problem reported at once, exit 2), then imports torch and the runner
(deferred so ``--help`` and config errors come back instantly) and calls ``run_all``. Exit 0 on
success, 1 when any rank failed: every rank exits non-zero, so torchrun reports the failure.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun stage_b/main.py): make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runs import cli  # noqa: E402 - after the path fix above

log = logging.getLogger("stage_b")


def main(argv: list[str] | None = None) -> int:
    ap = cli.config_parser("stage_b/main.py", __doc__, config_help="Stage-B YAML, e.g. configs/stage_b/demo_cpu.yaml",
                           epilog=__doc__.split("\n\n")[1])
    args = ap.parse_args(argv)
    rank, _ = cli.torchrun_rank()
    from stage_b.config import load_stage_b_config

    if (cfg := cli.load(args.config, args.overrides, loader=load_stage_b_config)) is None:
        return cli.EXIT_USAGE
    cli.setup_process("stage_b", rank)

    from stage_b.runner import run_all  # deferred: torch + transformers

    try:
        summary = run_all(cfg)
    except Exception:
        log.exception("stage-b rank %s failed", rank)
        return 1
    if summary.run_dir:
        log.info("artifacts in %s (guidance step %s)", summary.run_dir, summary.final_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
